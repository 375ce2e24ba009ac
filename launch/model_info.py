"""Parameters and KV-cache bytes of a config, from shapes alone (nothing is allocated).

    python -m launch.model_info --config configs/full_scale.py [--json]
"""

import json

from absl import app
from absl import flags

from agentic_rl.model import config as model_config
from agentic_rl.model import sizing
from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "Config file.")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")


def main(argv):
  del argv
  report = sizing.model_report(model_config.validate(_CONFIG.value.model))
  print(json.dumps(report, indent=1) if _JSON.value else sizing.format_report(report))


if __name__ == "__main__":
  app.run(main)
