"""Our params -> a Hugging Face checkpoint folder that transformers loads.

    export_params(params_flat, spec, out_dir, hf_config_base=None)

Writes `model.safetensors` (or shards of at most `shard_bytes` with
`model.safetensors.index.json`) under the Hugging Face names, and `config.json` (the
family's fields over `hf_config_base`, the config.json the model was imported with, so
fields we do not model, such as token ids, survive). The transforms are exact, so import
then export gives back the same tensors. Written into `<out>.partial-*` and renamed at the
end, like the import.

A model is exportable when a Hugging Face decoder of its family computes the same function:
every layer dense (F), or S/G layers only with `as_dense=True` (the exported model then
attends densely: a different function, chosen knowingly), and S gates still at their
pass-through start (unit_sigmoid at zero, or none).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Mapping

import numpy as np

from agentic_rl.interop import new_folder
from agentic_rl.interop.hf_source import INDEX_FILE, SINGLE_FILE
from agentic_rl.interop.safetensors_writer import StreamingWriter
from agentic_rl.model import families
from agentic_rl.model.config import ModelSpec
from agentic_rl.model.families import layout

_GATES = ("w_gate_dn", "b_gate_n")


def check_exportable(spec: ModelSpec, names, read: Callable[[str], np.ndarray],
                     as_dense: bool) -> None:
  """Raises ValueError naming what the Hugging Face model could not reproduce."""
  pattern = "".join(spec.layer_types)
  if set(pattern) != {"F"} and not as_dense:
    raise ValueError(f"config.model.layer_pattern gives layers {pattern!r}: a Hugging Face "
                     "decoder attends densely in every layer, so the export would compute a "
                     "different function. Pass as_dense (--as_dense) to export anyway.")
  for name in names:
    if name.rsplit("/", 1)[-1] not in _GATES:
      continue
    if spec.s_gate != "unit_sigmoid" or np.any(read(name) != 0):
      raise ValueError(f"{name}: the S layers' output gate (config.model.s_gate="
                       f"{spec.s_gate!r}) is not a pass-through, and a Hugging Face decoder "
                       "has no such gate.")
  extra = [n for n in layout.fresh_params(spec, list(names)) if n.rsplit("/", 1)[-1] not in _GATES]
  if extra:
    raise ValueError(f"params with no Hugging Face counterpart: {extra[:8]} (a value head "
                     "or a routing bias): export the policy without them.")


def export_params(dtypes: Mapping[str, np.dtype], read: Callable[[str], np.ndarray],
                  spec: ModelSpec,
                  out_dir: str, *, hf_config_base: Mapping[str, Any] | None = None,
                  model_type: str | None = None, as_dense: bool = False,
                  shard_bytes: int | None = None, extra_files: tuple[str, ...] = ()) -> str:
  """Writes the params (name -> dtype in `dtypes`, each read when written by `read`) as a
  Hugging Face folder; returns its path."""
  names = list(dtypes)
  out_dir = new_folder.absent(out_dir, "export")
  family = families.family_for_spec(spec, model_type or (hf_config_base or {}).get("model_type"))
  check_exportable(spec, names, read, as_dense)
  rules = layout.rules(spec)
  missing = sorted({r.ours for r in rules} - set(names))
  if missing:
    raise ValueError(f"the params lack {len(missing)} tensors the {family.model_type} layout "
                     f"needs: {missing[:8]}.")
  hf_cfg = {**(hf_config_base or {}), **family.to_hf(spec)}
  if hf_config_base and hf_config_base.get("max_position_embeddings", 0) >= spec.max_seq_len:
    # Our max_seq_len is a cache capacity (the import caps it); the model's context is the
    # checkpoint's.
    hf_cfg["max_position_embeddings"] = hf_config_base["max_position_embeddings"]
  with new_folder.renamed_at_the_end(out_dir) as tmp:
    _write_tensors(tmp, rules, {k: np.dtype(v) for k, v in dtypes.items()}, read, shard_bytes)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2, sort_keys=True)
    for path in extra_files:
      shutil.copy2(path, os.path.join(tmp, os.path.basename(path)))
  return out_dir


def _write_tensors(folder, rules, dtypes, read, shard_bytes):
  """One file, or shards in rule order of at most shard_bytes (a tensor never splits)."""
  sizes = [(r, int(np.prod(r.shape)) * dtypes[r.ours].itemsize) for r in rules]
  shards: list[list] = [[]]
  total = 0
  for r, size in sizes:
    if shard_bytes and shards[-1] and total + size > shard_bytes:
      shards.append([])
      total = 0
    shards[-1].append(r)
    total += size
  files = ([SINGLE_FILE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  weight_map = {}
  for file, shard in zip(files, shards):
    planned = {}
    for r in shard:
      for name in r.hf:
        planned[name] = (r.hf_shape, dtypes[r.ours])
        weight_map[name] = file
    with StreamingWriter(os.path.join(folder, file), planned, {"format": "pt"}) as w:
      for r in shard:
        for name, array in zip(r.hf, r.to_hf(read(r.ours))):
          w.write(name, array)
  if len(shards) > 1:
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": sum(s for _, s in sizes)},
                 "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
