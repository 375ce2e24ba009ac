"""What a training run's rollouts looked like, where their time went, and what route B
would save at those lengths.

    python -m launch.throughput_report --config configs/quickstart.py --workdir /tmp/quickstart
    python -m launch.throughput_report --config configs/quickstart.py --workdir RUN --json

--workdir is a launch.train run (its episodes.jsonl and metrics.jsonl); --config is the
run's config (route A and route B are derived from it, agentic_rl/quantify/
mismatch_routes.py). Reports turn, token and observation-length distributions, the
rollout time split (decode, prefill, env wait, host; idle slots), KV bytes per slot
against the budget for both routes, and one decode step of each route timed at the p50
and p90 lengths (--no_time_routes skips it). Writes throughput.json, throughput.md and
throughput_hist.png into the run's workdir.
"""

import json
import os

from absl import app
from absl import flags
from absl import logging

from launch import compilation_cache
from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "The run's config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A launch.train run's workdir.",
                               required=True)
_TIME_ROUTES = flags.DEFINE_bool("time_routes", True, "Time both routes' decode steps.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed decode steps per route and length.")
_JSON = flags.DEFINE_bool("json", False, "Print the report as one JSON object.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from agentic_rl.quantify import throughput_report as tr
  compilation_cache.enable()
  workdir = _WORKDIR.value
  report = tr.report(workdir, _CONFIG.value, time_routes=_TIME_ROUTES.value,
                     repeats=_REPEATS.value)
  with open(os.path.join(workdir, "throughput.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(workdir, "throughput.md"), "w") as f:
    f.write(tr.markdown(report))
  tr.write_histograms(tr.read_jsonl(os.path.join(workdir, "episodes.jsonl")),
                      os.path.join(workdir, "throughput_hist.png"))
  if _JSON.value:
    print(json.dumps(report), flush=True)
  else:
    print(tr.markdown(report))
    print(f"reports: {workdir}/throughput.md, throughput.json, throughput_hist.png")


if __name__ == "__main__":
  app.run(main)
