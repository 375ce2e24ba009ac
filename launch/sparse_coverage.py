"""How much of dense attention the block top-k indexer keeps, on real queries and keys.

    python -m launch.sparse_coverage --config configs/quickstart.py \
        --checkpoint configs/assets/base_tiny_bpe --workdir /tmp/coverage
    python -m launch.sparse_coverage --config configs/quickstart.py \
        --checkpoint /tmp/quickstart --workdir /tmp/coverage --block_sizes 1,8 --json

The engine samples --num_tasks groups of the config's env from the checkpoint; the first
--num_trajectories are run through the learner's forward, and the queries and keys of
every G layer (every layer of a model without G layers) are scored over the grid of
--block_sizes x --topk_tokens (k a multiple of B): the dense attention mass the selected
tokens hold (coverage), the share of the dense top-k tokens selected (recall), and the
indexer's FLOPs and bytes per query (agentic_rl/quantify/sparse_coverage.py). The design's
pair (B=8, k=4096 against B=1, k=2048 at --design_context) is measured at this context
with k scaled alike, and printed beside the design's numbers. Writes coverage.json,
coverage.md and coverage.png (coverage against k, one line per B) to --workdir; --json
prints {"rows": [...], "seed_pair": {...}}.
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
_BLOCKS = flags.DEFINE_list("block_sizes", ["1", "4", "8", "16"], "Block sizes B.")
_TOPK = flags.DEFINE_list("topk_tokens", ["16", "32", "64", "128", "256"],
                          "Token budgets k (each a multiple of B).")
_TASKS = flags.DEFINE_integer("num_tasks", 2, "Task groups sampled.")
_TRAJS = flags.DEFINE_integer("num_trajectories", 4, "Trajectories measured (the first).")
_DESIGN = flags.DEFINE_integer("design_context", 1 << 15, "The context, in tokens, the "
                               "design's pair is scaled from (the notes do not state it).")
_JSON = flags.DEFINE_bool("json", False, "Print the rows and the design's pair as JSON.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from agentic_rl.quantify import coverage_report, rollouts
  try:
    blocks, topk = [int(b) for b in _BLOCKS.value], [int(k) for k in _TOPK.value]
  except ValueError as e:
    raise app.UsageError(f"--block_sizes and --topk_tokens take integers: {e}") from None
  try:
    grid = coverage_report.parse_grid(blocks, topk)  # Bad grids fail before any work.
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  for name, flag in (("--num_tasks", _TASKS), ("--num_trajectories", _TRAJS)):
    if flag.value <= 0:
      raise app.UsageError(f"{name}={flag.value}: expected a positive integer.")
  config = _CONFIG.value
  # Before any work: the grid against the longest context a trajectory can reach.
  from agentic_rl.model import config as model_config
  from agentic_rl.quantify import sparse_coverage
  from agentic_rl.rollout import config as rollout_config
  max_len = rollout_config.validate(config.rollout, model_config.validate(config.model)).max_len
  try:
    sparse_coverage.check_grid(grid, max_len)
  except ValueError as e:
    raise app.UsageError(f"{e} (config.rollout.max_len={max_len})") from None
  compilation_cache.enable()
  config.model.scan_layers = False  # The captured queries and keys are per layer.
  config.train.allow_fingerprint_change = tuple(dict.fromkeys(
      tuple(config.train.allow_fingerprint_change) + ("scan_layers",)))
  sampled = rollouts.sample(config, _CHECKPOINT.value, _TASKS.value)
  trajs = sampled.trajectories[:_TRAJS.value]
  report = coverage_report.measure(sampled.model, sampled.params, trajs, grid,
                                   design_context=_DESIGN.value)
  out = _WORKDIR.value
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "coverage.json"), "w") as f:
    json.dump({"checkpoint": _CHECKPOINT.value, **report}, f, indent=1)
  with open(os.path.join(out, "coverage.md"), "w") as f:
    f.write(coverage_report.markdown(report))
  coverage_report.write_plot(report, os.path.join(out, "coverage.png"))
  if _JSON.value:
    print(json.dumps({"rows": report["rows"], "seed_pair": report["seed_pair"]}), flush=True)
  else:
    print(coverage_report.markdown(report))
    print(f"reports: {out}/coverage.md, coverage.json, coverage.png")


if __name__ == "__main__":
  app.run(main)
