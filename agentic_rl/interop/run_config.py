"""The config.py an import writes beside the params: the SWE RL job on the imported model.

It reads config.json beside it (our model and tokenizer sections), so the file is the same
for every import; `:retrofit` turns the dense layers into the 3:1 hybrid (S, S, S, G) over
the same weights (launch/hf_parity.py measures what that costs the model).
"""

CONFIG_PY = '''"""RL on the SWE env from the Hugging Face model imported into this folder.

    python -m launch.train --config THIS_FOLDER/config.py --workdir /tmp/rl
    python -m launch.train --config THIS_FOLDER/config.py:retrofit --workdir /tmp/rl_hybrid

Written by launch.import_hf. The model and tokenizer sections come from config.json beside
this file (with a chat template, the env takes the model's native JSON tool calls); the RL
recipe is configs/quickstart.py's. `retrofit` makes layers S, S, S, G:
S gates start as a pass-through, G layers select blocks by pooled keys, and the layout
fingerprint is allowed to change from the dense import.
"""

import json
import os

from agentic_rl.interop import run_config


def get_config(arg=""):
  here = os.path.dirname(os.path.abspath(__file__))
  with open(os.path.join(here, "config.json")) as f:
    saved = json.load(f)
  return run_config.build(here, saved, retrofit=(arg == "retrofit"))
'''


def build(folder: str, saved: dict, *, retrofit: bool = False):
  """configs/quickstart.py's RL job with `saved`'s model and tokenizer, started from
  `folder`."""
  from agentic_rl.config_schema import to_config_dict
  from agentic_rl.model.config import validate
  from agentic_rl.rollout.tokenizer_config import validate_tokenizer_config
  from configs import quickstart

  config = quickstart.get_config()
  # Each section through its own checks and back: the saved JSON's lists become tuples.
  config.model = to_config_dict(validate(saved["model"]))
  config.tokenizer = to_config_dict(validate_tokenizer_config(saved["tokenizer"]))
  if config.tokenizer.get("chat_template"):
    config.env.tool_format = "json"  # The model's native calls, as its template writes them.
  r = config.rollout
  r.max_len = 0  # The imported model's max_seq_len: a real tokenizer's prompts are longer.
  r.max_new_tokens_per_turn = 256  # JSON calls spell out argument names.
  config.train.init_checkpoint = folder
  if retrofit:
    m = config.model
    m.layer_pattern, m.s_gate = "SSSG", "unit_sigmoid"
    config.train.allow_fingerprint_change = ("layer_pattern",)
  return config

