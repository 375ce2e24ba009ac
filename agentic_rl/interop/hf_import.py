"""A Hugging Face checkpoint folder -> a params folder our runs start from.

    out = import_checkpoint(hf_dir, out_dir, dtype="float32")

The output folder holds what `config.train.init_checkpoint` (and so launch.train,
launch.evaluate and launch.check_consistency) read as a base: `params.safetensors` under
our names, `config.json` (our model and tokenizer sections: the layout fingerprint),
`config.py` (a get_config() for the RL main job on this model), the source `hf_config.json`
(for the export) and the tokenizer files that came with the checkpoint.

Order, so that a bad input writes nothing: config.json is read and mapped to a ModelSpec
(an unsupported field value is named); every shard's header is read (a shard the index
names but the folder lacks is named); every tensor the model needs is checked present, of
the right shape and a float dtype, and every tensor in the files must be used (each
mismatch is named). Only then is anything written, into `<out>.partial-*` beside the
output, renamed to `out_dir` at the very end: a half-written import never looks complete.

Memory: tensors stream one at a time, read from a memory-mapped shard, converted and
written to the output at their planned offset (StreamingWriter). Peak host memory is the
mapped pages of the shard being read plus a few copies of one of our params (its source
tensors, the converted array, a cast when the dtype changes; for a stacked expert weight,
all E experts of one projection), never the model: measured 3.6x our largest param, 14% of
the model, on a 12-shard checkpoint (tests/hf/test_import_export.py).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax.numpy as jnp

from agentic_rl.interop import new_folder
from agentic_rl.interop.hf_source import CheckpointError, TensorSource
from agentic_rl.interop.safetensors_writer import StreamingWriter
from agentic_rl.model import families
from agentic_rl.model.config import DTYPES, ModelSpec
from agentic_rl.model.families import layout
from agentic_rl.model.families.tensors import TensorRule

PARAMS_FILE = "params.safetensors"
HF_CONFIG_FILE = "hf_config.json"
# Files the tokenizer and the chat template live in; copied when the checkpoint has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "chat_template.json", "special_tokens_map.json", "generation_config.json")
_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
# Buffers some exports carry that are recomputed, not learned.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_hf_config(hf_dir: str) -> dict[str, Any]:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(path):
    raise CheckpointError(f"{hf_dir}: no config.json (a Hugging Face model folder has one).")
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:
    raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def plan(spec: ModelSpec, source: TensorSource) -> list[TensorRule]:
  """The rules that fill our params from `source`; raises CheckpointError naming every
  missing, unexpected or misshapen tensor (nothing read but the headers)."""
  rules = layout.rules(spec)
  wanted = {name: r for r in rules for name in r.hf}
  have = set(source.names)
  missing = sorted(set(wanted) - have)
  unexpected = sorted(n for n in have - set(wanted) if not n.endswith(_IGNORED_SUFFIXES)
                      and not (spec.tie_embeddings and n == "lm_head.weight"))
  wrong = [f"{n}: {source.shape(n)} {source.dtype(n)}, expected {r.hf_shape} float"
           for n, r in wanted.items() if n in have
           and (source.shape(n) != r.hf_shape or source.dtype(n) not in _FLOAT_DTYPES)]
  if missing or unexpected or wrong:
    parts = ([f"missing {len(missing)}: {missing[:6]}"] if missing else []) + \
        ([f"unexpected {len(unexpected)}: {unexpected[:6]}"] if unexpected else []) + \
        ([f"wrong shape or dtype {len(wrong)}: {wrong[:6]}"] if wrong else [])
    raise CheckpointError(f"{source.where}: the tensors do not fit the {spec.num_layers}-layer "
                          f"model its config.json describes ({'; '.join(parts)}).")
  return rules


def import_checkpoint(hf_dir: str, out_dir: str, *, dtype: str = "float32",
                      max_seq_len: int = 4096, config_py: str | None = None) -> str:
  """Imports `hf_dir` into `out_dir` (which must not exist yet); returns out_dir."""
  if dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r}: expected one of {DTYPES}.")
  out_dir = new_folder.absent(out_dir, "import")
  hf_cfg = read_hf_config(hf_dir)
  spec = families.spec_from_hf(hf_cfg, max_seq_len=max_seq_len, dtype=dtype,
                               param_dtype=dtype, cache_dtype=dtype)
  source = TensorSource.from_dir(hf_dir)
  rules = plan(spec, source)
  np_dtype = jnp.dtype(dtype)
  with new_folder.renamed_at_the_end(out_dir) as tmp:
    meta = {"description": f"imported from {os.path.abspath(hf_dir)} "
                           f"({hf_cfg['model_type']})", "source": os.path.abspath(hf_dir)}
    with StreamingWriter(os.path.join(tmp, PARAMS_FILE),
                         {r.ours: (r.shape, np_dtype) for r in rules}, meta) as writer:
      for r in rules:
        writer.write(r.ours, r.to_ours([source.read(n) for n in r.hf]).astype(np_dtype,
                                                                              copy=False))
    _write_json(os.path.join(tmp, HF_CONFIG_FILE), hf_cfg)
    tokenizer = _copy_tokenizer(hf_dir, tmp)
    _write_json(os.path.join(tmp, "config.json"),
                {"model": _model_section(spec),
                 "tokenizer": _tokenizer_section(tokenizer, tmp, out_dir)})
    if config_py is not None:
      with open(os.path.join(tmp, "config.py"), "w") as f:
        f.write(config_py)
  return out_dir


def _model_section(spec: ModelSpec) -> dict:
  from agentic_rl.config_schema import to_config_dict
  return to_config_dict(spec).to_dict()


def _tokenizer_section(has_tokenizer: bool, written: str, out_dir: str) -> dict:
  """The model's own tokenizer and, when it has one, its chat template (which lays out the
  turns: config.tokenizer.chat_template='file'); else the byte tokenizer."""
  from agentic_rl.config_schema import to_config_dict
  from agentic_rl.rollout.tokenizer_config import validate_tokenizer_config
  section = {"kind": "byte"} if not has_tokenizer else {
      "kind": "hf", "path": out_dir,
      "chat_template": "file" if _has_chat_template(written) else ""}
  # Every field written out, as a run's config holds it: the fingerprint hashes the section.
  return to_config_dict(validate_tokenizer_config(section)).to_dict()


def _has_chat_template(folder: str) -> bool:
  if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
    return True
  path = os.path.join(folder, "tokenizer_config.json")
  if not os.path.isfile(path):
    return False
  with open(path) as f:
    return bool(json.load(f).get("chat_template"))


def _copy_tokenizer(hf_dir: str, out: str) -> bool:
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(hf_dir, name)):
      shutil.copy2(os.path.join(hf_dir, name), os.path.join(out, name))
  return os.path.isfile(os.path.join(out, "tokenizer.json"))


def _write_json(path: str, value) -> None:
  with open(path, "w") as f:
    json.dump(value, f, indent=1, sort_keys=True)
    f.write("\n")
