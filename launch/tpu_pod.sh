#!/usr/bin/env bash
# Launch the training job on every host of a Cloud TPU pod slice.
#
#   TPU_NAME=my-pod ZONE=us-central2-b CONFIG=configs/route_b_throughput.py \
#     WORKDIR=gs://bucket/runs/exp1 bash launch/tpu_pod.sh [--config.rl.num_steps=1000 ...]
#
# Every host runs the same command; jax.distributed.initialize() discovers the
# others from the TPU environment (config.train.num_processes is then ignored),
# each host rolls out its share of task groups on its own chips and the learner
# step runs over the global device mesh (config.mesh). WORKDIR must be shared
# storage that orbax can write from every host (e.g. a GCS bucket).
#
# MESH sets config.mesh for the slice: comma-separated axis=size, axes left out
# keep the config's values (data=-1 takes the chips the others leave). Per slice,
# 4 chips a host (check a choice first: python -m launch.memory_plan --config C
# --mesh ... --hbm_gib 95):
#   the tiny quickstart model, any slice:    MESH=data=-1            (pure data parallel)
#   Qwen3-30B-A3B (configs/qwen3_30b_a3b.py), remat=full, 95 GiB v5p chips:
#     v5p-32  (16 chips):   MESH=data=1,fsdp=4,expert=4     (43.5 GiB a chip)
#     v5p-64  (32 chips):   MESH=data=2,fsdp=4,expert=4
#     v5p-128 (64 chips):   MESH=data=4,fsdp=4,expert=4
#   full_scale (configs/full_scale.py), remat=full:
#     v5p-512 (256 chips):  MESH=data=1,fsdp=8,tensor=4,expert=8   (25.1 GiB a chip)
# Rollout runs per host, on that host's chips (as much of the tensor, expert and
# fsdp axes as they hold: parallel/placement.sampler_mesh).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${CONFIG:=configs/quickstart.py}" "${WORKDIR:?set WORKDIR}"
REPO_DIR="${REPO_DIR:-~/agentic_rl}"
MESH_FLAGS=""
for part in ${MESH:+${MESH//,/ }}; do
  MESH_FLAGS="$MESH_FLAGS --config.mesh.${part}"
done

gcloud compute tpus tpu-vm scp --recurse --zone "$ZONE" --worker=all . "$TPU_NAME:$REPO_DIR"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e
  cd $REPO_DIR
  sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap util-linux procps
  pip install -q -e . 'jax[tpu]'
  python -m launch.train --config $CONFIG --workdir $WORKDIR $MESH_FLAGS $*
"
