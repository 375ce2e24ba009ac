"""The main job: SFT warm start, then agentic RL on the embedded SWE environment.

    python -m launch.train --config configs/quickstart.py --workdir /tmp/run
    python -m launch.train --config configs/quickstart.py --config.rl.num_steps=50 --workdir DIR

Restarting with the same --workdir resumes from its latest checkpoint.
"""

from absl import app
from absl import flags
from absl import logging

from launch import compilation_cache
from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, logs and summary.json.",
                               required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it writes at INFO.
  compilation_cache.enable()  # Reruns, resumes and seeds load programs from disk.
  from agentic_rl.train.trainer import Trainer  # After flag parsing: --help stays fast.
  Trainer(_CONFIG.value, _WORKDIR.value).run()


if __name__ == "__main__":
  app.run(main)
