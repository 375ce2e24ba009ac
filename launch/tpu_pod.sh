#!/usr/bin/env bash
# Launch the training job on every host of a Cloud TPU pod slice.
#
#   TPU_NAME=my-pod ZONE=us-central2-b CONFIG=configs/route_b_throughput.py \
#     WORKDIR=gs://bucket/runs/exp1 bash launch/tpu_pod.sh [--config.rl.num_steps=1000 ...]
#
# Every host runs the same command; jax.distributed.initialize() discovers the
# others from the TPU environment (config.train.num_processes is then ignored),
# each host rolls out its share of task groups on its own CPUs and the learner
# step runs data-parallel over the global device mesh. WORKDIR must be shared
# storage that orbax can write from every host (e.g. a GCS bucket).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${CONFIG:=configs/quickstart.py}" "${WORKDIR:?set WORKDIR}"
REPO_DIR="${REPO_DIR:-~/agentic_rl}"

gcloud compute tpus tpu-vm scp --recurse --zone "$ZONE" --worker=all . "$TPU_NAME:$REPO_DIR"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e
  cd $REPO_DIR
  sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap util-linux procps
  pip install -q -e . 'jax[tpu]'
  python -m launch.train --config $CONFIG --workdir $WORKDIR $*
"
