"""The train-inference mismatch of each route, on real rollouts from a checkpoint.

    python -m launch.measure_mismatch --config configs/quickstart.py \
        --checkpoint configs/assets/base_tiny_bpe --workdir /tmp/mismatch
    python -m launch.measure_mismatch --config configs/quickstart.py \
        --checkpoint /tmp/quickstart --workdir /tmp/mismatch --routes a,b --json

Per route (agentic_rl/quantify/mismatch_routes.py: a, b, and each single change between
them), the engine samples --num_tasks groups of the config's env with the same seeds, and
the learner scores the same tokens under the route's replay settings. Routes that differ
only in replay (e.g. b and b_no_routing_replay) share one sampling, so the report also
compares them token by token: replay's effect alone, without sampling noise. Writes
report.json, report.md, mismatch_hist.png (|log r| per route) and mismatch_by_turn.png
(k3 by turn) to --workdir. --json prints {"routes": {name: {"k1", "k3",
"abs_logp_diff_p99", "routing_agreement", ...}}}. --checkpoint is a run's workdir,
checkpoints/ or step folder, or a params folder; it is checked against the config's model
before any route runs.
"""

import json
import os

from absl import app
from absl import flags
from absl import logging

from launch import compilation_cache
from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "Config file.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Run workdir, checkpoint or params "
                                  "folder.", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the reports go.", required=True)
_ROUTES = flags.DEFINE_string("routes", "", "Comma list of routes (default: all).")
_TASKS = flags.DEFINE_integer("num_tasks", 8, "Task groups sampled per route.")
_JSON = flags.DEFINE_bool("json", False, "Print the routes' figures as one JSON object.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from agentic_rl.quantify import mismatch_report, mismatch_routes
  names = mismatch_routes.parse_routes(_ROUTES.value)  # Bad names fail before any work.
  if _TASKS.value <= 0:
    raise app.UsageError(f"--num_tasks={_TASKS.value}: expected a positive integer.")
  compilation_cache.enable()
  config = _CONFIG.value
  mismatch_report.check_checkpoint(config, _CHECKPOINT.value)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  measured, samples = [], {}
  for name in names:
    m = mismatch_report.measure_route(config, name, _CHECKPOINT.value, _TASKS.value, samples)
    measured.append(m)
    if not _JSON.value:
      print(f"{name}: k3 {m.report['k3']:.3g}, |log r| p99 {m.report['abs_logp_diff_p99']:.3g}"
            f" over {m.report['num_tokens']} tokens", flush=True)
  summary = mismatch_report.summary_json(measured)
  out = _WORKDIR.value
  with open(os.path.join(out, "report.json"), "w") as f:
    json.dump({"checkpoint": _CHECKPOINT.value, "num_tasks": _TASKS.value, **summary}, f,
              indent=1)
  header = (f"# Mismatch by route\n\ncheckpoint `{_CHECKPOINT.value}`, {_TASKS.value} task "
            "groups per route, the same seeds; log r = log p_learner - log p_sampler over "
            "generated tokens.")
  with open(os.path.join(out, "report.md"), "w") as f:
    f.write(mismatch_report.markdown(measured, header))
  mismatch_report.write_histograms(measured, os.path.join(out, "mismatch_hist.png"))
  mismatch_report.write_by_turn(measured, os.path.join(out, "mismatch_by_turn.png"))
  if _JSON.value:
    print(json.dumps(summary), flush=True)
  else:
    print(f"reports: {out}/report.md, report.json, mismatch_hist.png, mismatch_by_turn.png")


if __name__ == "__main__":
  app.run(main)
