"""Model parameters as one safetensors file: what a shipped base checkpoint holds.

A run's orbax checkpoint carries optimiser state, the data iterator and the step; a base
model needs only its weights. Names are the params tree's key paths joined by "/"
(`decoder/layer_0/attn/wq`), so the file reads in any safetensors tool. Loading checks
every name, shape and dtype against the model the config builds and says what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

PARAMS_FILE = "params.safetensors"


def _name(path) -> str:
  parts = []
  for key in path:
    parts.append(str(getattr(key, "key", getattr(key, "idx", key))))
  return "/".join(parts)


def flatten(params) -> dict[str, np.ndarray]:
  return {_name(path): np.ascontiguousarray(np.asarray(leaf))
          for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(params))}


def save_params(path: str, params, metadata: dict | None = None) -> str:
  """Writes `params` to `path` (a file, or a folder that gets params.safetensors)."""
  if os.path.isdir(path) or not path.endswith(".safetensors"):
    os.makedirs(path, exist_ok=True)
    path = os.path.join(path, PARAMS_FILE)
  meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
  save_file(flatten(params), path, metadata=meta)
  return path


def file_sha256(path: str) -> str:
  """sha256 of a params file's bytes: what base.json records for the file beside it."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def params_path(path: str) -> str | None:
  """The safetensors file `path` names (itself, or a folder's params.safetensors), or None."""
  if path.endswith(".safetensors") and os.path.isfile(path):
    return path
  candidate = os.path.join(path, PARAMS_FILE)
  return candidate if os.path.isfile(candidate) else None


def load_params(path: str, like: Any, source: str = "params file", *,
                fresh_prefixes: tuple[str, ...] = ()):
  """The params saved at `path`, in the structure, shapes and dtypes of `like`.

  Names under `fresh_prefixes` (e.g. a value head the base never had) may be absent from the
  file: they keep `like`'s values, which must then be real arrays.
  """
  file = params_path(path)
  if file is None:
    raise FileNotFoundError(f"{source}={path!r}: no {PARAMS_FILE} there.")
  arrays = load_file(file)
  expected = flatten(like)
  for name in set(expected) - set(arrays):
    if name.startswith(fresh_prefixes):  # False for no prefixes
      arrays[name] = expected[name]
  missing = sorted(set(expected) - set(arrays))
  unexpected = sorted(set(arrays) - set(expected))
  wrong = [f"{k}: file {arrays[k].shape} {arrays[k].dtype}, model {v.shape} {v.dtype}"
           for k, v in expected.items()
           if k in arrays and (arrays[k].shape != v.shape or arrays[k].dtype != v.dtype)]
  if missing or unexpected or wrong:
    lines = ([f"missing {len(missing)}: {missing[:8]}"] if missing else []) + \
        ([f"unexpected {len(unexpected)}: {unexpected[:8]}"] if unexpected else []) + \
        ([f"mismatched {len(wrong)}: {wrong[:8]}"] if wrong else [])
    raise ValueError(f"{source}={path!r}: {file} does not fit the model this config "
                     f"builds ({'; '.join(lines)}).")
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(like)
  return jax.tree_util.tree_unflatten(
      treedef, [arrays[_name(p)] for p, _ in leaves_with_path])


def read_metadata(path: str) -> dict:
  """The metadata written with the params (JSON values decoded)."""
  from safetensors import safe_open
  with safe_open(params_path(path) or path, framework="numpy") as f:
    meta = f.metadata() or {}
  out = {}
  for k, v in meta.items():
    try:
      out[k] = json.loads(v)
    except json.JSONDecodeError:
      out[k] = v
  return out
