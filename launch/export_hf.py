"""Exports our params as a Hugging Face checkpoint folder that transformers loads.

    python -m launch.export_hf --checkpoint IMPORTED_OR_BASE_FOLDER --out DIR
    python -m launch.export_hf --checkpoint RUN_WORKDIR --config OUT/config.py --out DIR

--checkpoint is a params folder (an import's output, a shipped base: params.safetensors
with config.json beside it) or a run's workdir / checkpoints / step folder, read under
--config (a run started from an import takes the import's hf_config.json and tokenizer
files along). DIR gets model.safetensors (or shards under --max_shard_mb, with an index) and
config.json: the family's fields over the hf_config.json the model was imported with, so
token ids and other fields we do not model survive. Import then export gives back the
same tensors (tests/hf/test_import_export.py).

The Hugging Face model attends densely everywhere: a hybrid (S/G layers) is refused unless
--as_dense, and S gates must still be at their pass-through start.
"""

from __future__ import annotations

import json
import os

from absl import app
from absl import flags
from absl import logging

from launch import config_flag

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Params folder, or a run's checkpoint.",
                                  required=True)
_OUT = flags.DEFINE_string("out", None, "The folder to write (must not exist).", required=True)
_CONFIG = config_flag.define_config(None, "For a run's checkpoint: the config it ran under.")
_MODEL_TYPE = flags.DEFINE_enum("model_type", None, ["qwen3", "qwen3_moe", "llama"],
                                "Family to write (default: the import's, else by the model).")
_AS_DENSE = flags.DEFINE_bool("as_dense", False, "Export S/G layers as dense attention.")
_MAX_SHARD_MB = flags.DEFINE_float("max_shard_mb", 0, "Shard above this size (0: one file).")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from agentic_rl.interop import hf_export, hf_import
  from agentic_rl.interop.hf_source import TensorSource
  from agentic_rl.model.config import validate
  from agentic_rl.train import params_file

  path = _CHECKPOINT.value
  file = params_file.params_path(path)
  if file is not None:
    folder = os.path.dirname(file)
    with open(os.path.join(folder, "config.json")) as f:
      spec = validate(json.load(f)["model"])
    source = TensorSource.from_file(file)
    names = {params_file.current_name(k): k for k in source.names}  # Old files: new names.
    dtypes = {n: source.numpy_dtype(k) for n, k in names.items()}
    read = lambda n: source.read(names[n])  # noqa: E731
  else:
    if _CONFIG.value is None:
      raise app.UsageError(f"--checkpoint={path!r} is a run's checkpoint: pass --config.")
    spec = validate(_CONFIG.value.model)
    from agentic_rl.train.trainer import load_params_with
    params, _ = load_params_with(_CONFIG.value, path, "--checkpoint")
    flat = params_file.flatten(params)
    dtypes = {n: a.dtype for n, a in flat.items()}
    read = flat.__getitem__
    # A run started from an import: its Hugging Face config and tokenizer come along.
    start = _CONFIG.value.train.init_checkpoint
    folder = start if start and params_file.params_path(start) else None
  base = None
  if folder and os.path.isfile(os.path.join(folder, hf_import.HF_CONFIG_FILE)):
    with open(os.path.join(folder, hf_import.HF_CONFIG_FILE)) as f:
      base = json.load(f)
  extra = tuple(os.path.join(folder, n) for n in hf_import.TOKENIZER_FILES
                if folder and os.path.isfile(os.path.join(folder, n)))
  out = hf_export.export_params(
      dtypes, read, spec, _OUT.value, hf_config_base=base, model_type=_MODEL_TYPE.value,
      as_dense=_AS_DENSE.value, extra_files=extra,
      shard_bytes=int(_MAX_SHARD_MB.value * 2 ** 20) or None)
  print(json.dumps({"out": out, "model_type": json.load(open(os.path.join(out, "config.json")))
                    ["model_type"]}))


if __name__ == "__main__":
  app.run(main)
