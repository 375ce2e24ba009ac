"""Model parameters as one safetensors file: what a shipped base checkpoint holds.

A run's orbax checkpoint carries optimiser state, the data iterator and the step; a base
model needs only its weights. Names are the params tree's key paths joined by "/"
(`layer_0/attn/w_q_dnh`), so the file reads in any safetensors tool. Loading checks
every name, shape and dtype against the model the config builds and says what differs.
The file holds the unrolled layout whatever config.model.scan_layers says: saving a
scanned tree unstacks it, loading into one stacks (model/layer_stack.py), so a file loads
into either.
Files written before the attention params took one letter per axis hold the old names
(`LEGACY_PARAM_NAMES`); loading reads them under the new ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from agentic_rl.model import layer_stack

PARAMS_FILE = "params.safetensors"

# Old attention param name -> new, applied on load to the last component of a file's names.
# The attention params were renamed so that each suffix letter means one axis (issue 29:
# d d_model, n query heads, k kv heads, h head_dim); files saved before (the shipped base
# until its issue-30 rebuild) hold the old names and are not rewritten. Only names in this table are mapped: any other name the model lacks is
# still reported as unexpected, under the name the file gives it. Saving writes new names.
LEGACY_PARAM_NAMES = {"w_q_dhk": "w_q_dnh", "w_k_dhk": "w_k_dkh", "w_v_dhk": "w_v_dkh",
                      "w_o_hkd": "w_o_nhd", "w_gate_dh": "w_gate_dn", "b_gate_h": "b_gate_n"}


def _name(path) -> str:
  parts = []
  for key in path:
    parts.append(str(getattr(key, "key", getattr(key, "idx", key))))
  return "/".join(parts)


def current_name(name: str) -> str:
  """`name` with an old attention param name (LEGACY_PARAM_NAMES) as its last component
  replaced by the new one; any other name unchanged."""
  head, sep, last = name.rpartition("/")
  return head + sep + LEGACY_PARAM_NAMES.get(last, last)


def _with_current_names(arrays: dict, where: str) -> tuple[dict, dict]:
  """(arrays under current names, current name -> the file's name where they differ)."""
  renamed, file_names = {}, {}
  for name, array in arrays.items():
    new = current_name(name)
    if new in renamed:
      both = sorted([file_names.get(new, new), name])
      raise ValueError(f"{where} holds both {both[0]!r} and {both[1]!r}: one param under "
                       f"its old and its new name.")
    renamed[new] = array
    if new != name:
      file_names[new] = name
  return renamed, file_names


def rename_keys(tree, mapping: dict[str, str | None]):
  """`tree` with every dict key found in `mapping` renamed (or, mapped to None, dropped with
  its subtree), through dicts, tuples, named tuples (optax states) and dataclasses
  (TrainState); leaves unchanged. Orbax checkpoints key params by name, so a checkpoint
  written before LEGACY_PARAM_NAMES restores into `rename_keys(layout, {new: old})` and is
  renamed back with LEGACY_PARAM_NAMES."""
  if isinstance(tree, dict):
    return {mapping.get(k, k): rename_keys(v, mapping) for k, v in tree.items()
            if mapping.get(k, k) is not None}
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return type(tree)(*(rename_keys(v, mapping) for v in tree))
  if isinstance(tree, (tuple, list)):
    return type(tree)(rename_keys(v, mapping) for v in tree)
  if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
    return dataclasses.replace(tree, **{f.name: rename_keys(getattr(tree, f.name), mapping)
                                        for f in dataclasses.fields(tree) if f.init})
  return tree


def flatten(params) -> dict[str, np.ndarray]:
  """Name -> host array, in the unrolled layout (a scanned tree is unstacked)."""
  params = layer_stack.unstacked(jax.device_get(params))
  return {_name(path): np.ascontiguousarray(np.asarray(leaf))
          for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


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
  """The params saved at `path`, in the structure, shapes and dtypes of `like` (stacked
  when `like` is scanned: the file's unrolled layers go to their slots).

  Names under `fresh_prefixes` (e.g. a value head the base never had; unrolled names, as
  in the file) may be absent from the file: they keep `like`'s values, which must then be
  real arrays.
  """
  file = params_path(path)
  if file is None:
    raise FileNotFoundError(f"{source}={path!r}: no {PARAMS_FILE} there.")
  arrays, file_names = _with_current_names(load_file(file), f"{source}={path!r}: {file}")
  expected = flatten(like)
  for name in set(expected) - set(arrays):
    if name.startswith(fresh_prefixes):  # False for no prefixes
      arrays[name] = expected[name]

  def shown(name):  # The file's own name, and the one it was read as if renamed.
    return f"{file_names[name]} (as {name})" if name in file_names else name

  missing = sorted(set(expected) - set(arrays))
  unexpected = sorted(file_names.get(k, k) for k in set(arrays) - set(expected))
  wrong = [f"{shown(k)}: file {arrays[k].shape} {arrays[k].dtype}, model {v.shape} {v.dtype}"
           for k, v in expected.items()
           if k in arrays and (arrays[k].shape != v.shape or arrays[k].dtype != v.dtype)]
  if missing or unexpected or wrong:
    lines = ([f"missing {len(missing)}: {missing[:8]}"] if missing else []) + \
        ([f"unexpected {len(unexpected)}: {unexpected[:8]}"] if unexpected else []) + \
        ([f"mismatched {len(wrong)}: {wrong[:8]}"] if wrong else [])
    raise ValueError(f"{source}={path!r}: {file} does not fit the model this config "
                     f"builds ({'; '.join(lines)}).")
  scan = layer_stack.scan_of(like)
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(
      layer_stack.unstack(like, scan))
  return layer_stack.stack(jax.tree_util.tree_unflatten(
      treedef, [arrays[_name(p)] for p, _ in leaves_with_path]), scan)


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
