"""Imports a Hugging Face checkpoint (Qwen3, Qwen3-MoE, Llama 3) as a folder runs start from.

    python -m launch.import_hf --hf_dir DIR --workdir OUT [--dtype float32|bfloat16]
    python -m launch.train --config OUT/config.py --workdir /tmp/rl
    python -m launch.train --config OUT/config.py:retrofit --workdir /tmp/rl_hybrid

DIR holds config.json (transformers 4.x or 5.x spelling) and model.safetensors, or shards
with model.safetensors.index.json. OUT gets params.safetensors (our names), config.json
(our model and tokenizer sections), config.py (the SWE RL job on this model; its
`retrofit` argument makes the 3:1 S/G hybrid), hf_config.json and the tokenizer files.
`config.train.init_checkpoint=OUT` starts any config of the same model from it.

Bad input stops before anything is written (agentic_rl/interop/hf_import.py): an
unsupported config.json value, a missing, unexpected or misshapen tensor, or a shard the
index names but the folder lacks, each named. Tensors stream one at a time: peak host
memory is about one shard's mapped pages plus one param, never the whole model.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
from absl import logging

_HF_DIR = flags.DEFINE_string("hf_dir", None, "A Hugging Face model folder.", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The folder to write (must not exist).",
                               required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                           "The params' dtype (and the model's compute and cache dtype).")
_MAX_SEQ_LEN = flags.DEFINE_integer(
    "max_seq_len", 4096, "Cache capacity (config.model.max_seq_len), at most the "
    "checkpoint's max_position_embeddings.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from agentic_rl.interop import hf_import, run_config
  out = hf_import.import_checkpoint(_HF_DIR.value, _WORKDIR.value, dtype=_DTYPE.value,
                                    max_seq_len=_MAX_SEQ_LEN.value,
                                    config_py=run_config.CONFIG_PY)
  print(json.dumps({"workdir": out, "config": f"{out}/config.py"}))


if __name__ == "__main__":
  app.run(main)
