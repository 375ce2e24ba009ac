"""Held-out scores of a saved checkpoint: pass@1, the pass@k curve and each task's solves.

    python -m launch.evaluate --config configs/quickstart.py --checkpoint /tmp/quickstart \
        --config.train.eval_samples=16 --config.train.eval_tasks=32 --workdir /tmp/eval

--checkpoint is a run's workdir, its checkpoints/ folder or one step folder (the latest
step unless one is named). The eval settings are the config's (config.train.eval_tasks,
eval_samples, eval_temperature, and config.rollout for turns and lengths), so a score
compares with a run's `heldout/*` metrics when the settings match. Prints one JSON line;
`heldout/sharpening_headroom` is pass@n - pass@1, the most RL that only sharpens can win.
--workdir holds the sandboxes' audit log.
"""

import json

from absl import app
from absl import flags
from absl import logging

from launch import compilation_cache
from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "Config file.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Workdir, checkpoints/ or step folder.",
                                  required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the audit log goes.", required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  compilation_cache.enable()  # Reruns, resumes and seeds load programs from disk.
  from agentic_rl.train.trainer import Trainer  # After flag parsing: --help stays fast.
  trainer = Trainer(_CONFIG.value, _WORKDIR.value)
  try:
    result = trainer.evaluate_checkpoint(_CHECKPOINT.value, source="--checkpoint")
  finally:
    trainer.close()
  if trainer.info.is_primary:
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
  app.run(main)
