"""A safetensors file written one tensor at a time.

`safetensors.numpy.save_file` takes every tensor at once. Here the header (names, dtypes,
shapes, offsets) is written first, from shapes known in advance, and each tensor's bytes
follow as it is produced; so writing a model holds one tensor, not the model. The file is
the standard format: `safetensors.safe_open` and `load_file` read it.
"""

from __future__ import annotations

import json
import struct
from typing import Mapping

import numpy as np

_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
           "int32": "I32", "int64": "I64", "uint8": "U8", "bool": "BOOL"}


class StreamingWriter:
  """with StreamingWriter(path, {name: (shape, dtype)}, metadata) as w: w.write(name, array)
  for every name, in any order; closing checks that each was written once."""

  def __init__(self, path: str, layout: Mapping[str, tuple[tuple[int, ...], str]],
               metadata: Mapping[str, str] | None = None):
    self._layout = {k: (tuple(int(d) for d in shape), np.dtype(dtype))
                    for k, (shape, dtype) in layout.items()}
    header, offset, self._offsets = {}, 0, {}
    for name in sorted(self._layout):
      shape, dtype = self._layout[name]
      size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
      header[name] = {"dtype": _DTYPES[dtype.name], "shape": list(shape),
                      "data_offsets": [offset, offset + size]}
      self._offsets[name] = offset
      offset += size
    if metadata:
      header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # The data starts 8-byte aligned.
    self._data_start = 8 + len(blob)
    self._file = open(path, "wb")
    self._file.write(struct.pack("<Q", len(blob)) + blob)
    self._file.truncate(self._data_start + offset)
    self._written: set[str] = set()
    self.path = path

  def write(self, name: str, array: np.ndarray) -> None:
    if name not in self._layout:
      raise KeyError(f"{self.path}: {name!r} is not in the planned layout.")
    shape, dtype = self._layout[name]
    if tuple(array.shape) != shape or array.dtype != dtype:
      raise ValueError(f"{self.path}: {name} is {array.shape} {array.dtype}; the layout "
                       f"planned {shape} {dtype}.")
    if name in self._written:
      raise ValueError(f"{self.path}: {name} written twice.")
    self._file.seek(self._data_start + self._offsets[name])
    # A uint8 view of the same memory: written without a bytes copy.
    self._file.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    self._written.add(name)

  def close(self) -> None:
    self._file.close()
    missing = sorted(set(self._layout) - self._written)
    if missing:
      raise ValueError(f"{self.path}: {len(missing)} planned tensors never written: "
                       f"{missing[:8]}.")

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *_):
    if exc_type is None:
      self.close()
    else:
      self._file.close()
