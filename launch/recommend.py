"""The route and stage schedule the quantify-first measurements support.

    python -m launch.measure_mismatch --config C --checkpoint CKPT --workdir OUT --routes a,b
    python -m launch.sparse_coverage --config C --checkpoint CKPT --workdir OUT
    python -m launch.throughput_report --config C --workdir RUN
    python -m launch.recommend --config C --workdir OUT --run RUN

Reads OUT/report.json (measure_mismatch), OUT/coverage.json (sparse_coverage) and
RUN/throughput.json (throughput_report; --run defaults to OUT) and prints the route, e.g.
"B then A" with the step to switch at, each reason citing its number
(agentic_rl/quantify/recommend.py has the rules). A missing report is named in the
reasons. Writes OUT/recommendation.md and .json; --json prints the recommendation.
"""

import json
import os

from absl import app
from absl import flags

from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "The run's config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where measure_mismatch and sparse_coverage "
                               "wrote.", required=True)
_RUN = flags.DEFINE_string("run", "", "The training run throughput_report read (default: "
                           "--workdir).")
_JSON = flags.DEFINE_bool("json", False, "Print the recommendation as JSON.")


def _load(path):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def main(argv):
  del argv
  from agentic_rl.quantify import recommend
  out = _WORKDIR.value
  if not os.path.isdir(out):
    raise app.UsageError(f"--workdir={out}: not a folder.")
  config = _CONFIG.value
  rec = recommend.recommend(
      _load(os.path.join(out, "report.json")), _load(os.path.join(out, "coverage.json")),
      _load(os.path.join(_RUN.value or out, "throughput.json")),
      num_steps=int(config.rl.num_steps), block_size=int(config.model.block_size),
      topk_tokens=int(config.model.topk_tokens))
  with open(os.path.join(out, "recommendation.json"), "w") as f:
    json.dump(rec, f, indent=1)
  with open(os.path.join(out, "recommendation.md"), "w") as f:
    f.write(recommend.markdown(rec))
  print(json.dumps(rec) if _JSON.value else recommend.markdown(rec), flush=True)


if __name__ == "__main__":
  app.run(main)
