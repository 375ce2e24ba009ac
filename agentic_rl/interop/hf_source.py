"""The tensors of a Hugging Face checkpoint folder, read one at a time.

A folder holds `model.safetensors`, or shards named by `model.safetensors.index.json`
(`weight_map`: tensor -> shard file). Opening reads only the shards' headers (names, shapes,
dtypes); `read(name)` memory-maps that tensor's shard and copies out the one tensor. So a
consumer that reads, converts and writes one tensor at a time holds about one tensor (plus
the mapped pages of the shard it is in) at a time.

Transformers 5 keeps a Qwen3-MoE layer's experts fused in memory (`experts.gate_up_proj`
[E, 2F, D], `experts.down_proj` [E, D, F]). A file written that way reads here under the
Hub's per-expert names (`experts.{j}.gate_proj.weight` ...), so one tensor table serves both.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import jax.numpy as jnp
import numpy as np

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FUSED = re.compile(r"^(?P<mlp>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
  """A checkpoint folder that is incomplete or malformed (named in the message)."""


class TensorSource:
  """name -> (shape, dtype), and `read(name)`, over a checkpoint folder or in-memory arrays."""

  def __init__(self, entries: dict[str, tuple[tuple[int, ...], str]],
               reader: Callable[[str], np.ndarray], where: str,
               row_reader: Callable[[str, int], np.ndarray] | None = None):
    self._entries, self._read, self.where = entries, reader, where
    # One expert's slice of a fused [E, ...] tensor, without reading the other E - 1.
    self._read_row = row_reader or (lambda name, j: reader(name)[j])
    self._virtual: dict[str, tuple[str, int, slice | None]] = {}
    self._unfuse()

  @classmethod
  def from_dir(cls, hf_dir: str) -> "TensorSource":
    return cls._from_shards(hf_dir, _shard_map(hf_dir))

  @classmethod
  def from_file(cls, path: str) -> "TensorSource":
    """One safetensors file of any naming (our params.safetensors, say)."""
    return cls._from_shards(os.path.dirname(path) or ".", {}, single=os.path.basename(path))

  @classmethod
  def _from_shards(cls, hf_dir: str, shard_of: dict[str, str],
                   single: str = SINGLE_FILE) -> "TensorSource":
    from safetensors import safe_open

    entries: dict[str, tuple[tuple[int, ...], str]] = {}
    for shard in sorted(set(shard_of.values()) or {single}):
      with safe_open(os.path.join(hf_dir, shard), framework="numpy") as f:
        for name in f.keys():
          if shard_of.get(name, shard) != shard:
            raise CheckpointError(f"{hf_dir}: tensor {name!r} is in {shard} but the index "
                                  f"names {shard_of[name]}.")
          sl = f.get_slice(name)
          entries[name] = (tuple(sl.get_shape()), sl.get_dtype())
    listed_only = sorted(set(shard_of) - set(entries))
    if listed_only:
      raise CheckpointError(f"{hf_dir}/{INDEX_FILE} lists {len(listed_only)} tensors no shard "
                            f"holds: {listed_only[:8]}.")

    def read(name):
      shard = shard_of.get(name, single)
      with safe_open(os.path.join(hf_dir, shard), framework="numpy") as f:
        return f.get_tensor(name)

    def read_row(name, j):
      shard = shard_of.get(name, single)
      with safe_open(os.path.join(hf_dir, shard), framework="numpy") as f:
        return f.get_slice(name)[j]

    return cls(entries, read, hf_dir, read_row)

  @classmethod
  def from_arrays(cls, arrays: dict[str, np.ndarray], where: str = "arrays") -> "TensorSource":
    return cls({k: (tuple(v.shape), _dtype_name(v.dtype)) for k, v in arrays.items()},
               lambda name: arrays[name], where)

  def _unfuse(self):
    for name, (shape, dtype) in list(self._entries.items()):
      m = _FUSED.match(name)
      if not m or len(shape) != 3:
        continue
      e, rows, cols = shape
      for j in range(e):
        if m["proj"] == "down_proj":
          self._virtual[f"{m['mlp']}.{j}.down_proj.weight"] = (name, j, None)
        else:
          f = rows // 2
          self._virtual[f"{m['mlp']}.{j}.gate_proj.weight"] = (name, j, slice(0, f))
          self._virtual[f"{m['mlp']}.{j}.up_proj.weight"] = (name, j, slice(f, rows))

  @property
  def names(self) -> list[str]:
    fused = {src for src, _, _ in self._virtual.values()}
    return sorted((set(self._entries) - fused) | set(self._virtual))

  def shape(self, name: str) -> tuple[int, ...]:
    if name in self._virtual:
      src, _, rows = self._virtual[name]
      _, r, c = self._entries[src][0]
      return (rows.stop - rows.start, c) if rows is not None else (r, c)
    return self._entries[name][0]

  def numpy_dtype(self, name: str) -> np.dtype:
    code = self.dtype(name)
    # jnp.dtype knows bfloat16 (ml_dtypes); plain numpy does not.
    return jnp.dtype({"F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "F64": "float64", "I32": "int32", "I64": "int64"}.get(code, code.lower()))

  def dtype(self, name: str) -> str:
    return self._entries[self._virtual[name][0] if name in self._virtual else name][1]

  def read(self, name: str) -> np.ndarray:
    if name in self._virtual:
      src, j, rows = self._virtual[name]
      a = self._read_row(src, j)
      return np.ascontiguousarray(a if rows is None else a[rows])
    return self._read(name)


def _dtype_name(dtype) -> str:
  names = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
  return names.get(np.dtype(dtype).name, np.dtype(dtype).name.upper())


def _shard_map(hf_dir: str) -> dict[str, str]:
  """tensor -> shard file, from the index; {} for a single-file checkpoint."""
  index = os.path.join(hf_dir, INDEX_FILE)
  if not os.path.isfile(index):
    if not os.path.isfile(os.path.join(hf_dir, SINGLE_FILE)):
      raise CheckpointError(f"{hf_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} is there.")
    return {}
  try:
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
  except (OSError, ValueError, KeyError) as e:
    raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e}).") from e
  missing = sorted({s for s in weight_map.values()
                    if not os.path.isfile(os.path.join(hf_dir, s))})
  if missing:
    raise CheckpointError(f"{index} names shard(s) that are not in {hf_dir}: {missing}.")
  return dict(weight_map)
