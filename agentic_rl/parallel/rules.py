"""The logical-axis rules: which mesh axes each tensor dimension is sharded over. One table.

Every array in the model is named with one letter per axis (`w_q_dnh`, `x_btd`,
`k_bskh`: WORKSPACE.md, "Axis letters"), so a dimension's logical axis is its letter and
the rule is per letter. Params and their optimiser moments shard d_model over fsdp (ZeRO-3
style: gathered per layer when used), heads, FFN hidden and vocab over tensor, experts over
expert (and d_model of every other param over expert too). Activations, batches and KV
caches shard the batch over data, fsdp and expert, heads over tensor. A dimension that its mesh axes do not divide, or whose axis a previous dimension
of the same array took, stays whole (replicated): a kv-head count below the tensor axis,
for example. Under config.model.scan_layers a scanned group's params lead with r, the
axis of the group's repeats, which no rule names: never sharded (the scan slices it).
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from agentic_rl.model import cache as cache_lib
from agentic_rl.model import layer_stack

# The expert axis doubles as FSDP for everything but the experts (whose own axis it is),
# and carries batch rows: tokens travel to their experts' shard and back.
PARAM_RULES: dict[str, tuple[str, ...]] = {
    "d": ("fsdp", "expert"), "n": ("tensor",), "k": ("tensor",), "f": ("tensor",),
    "v": ("tensor",), "e": ("expert",),
}
ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    "b": ("data", "fsdp", "expert"), "n": ("tensor",), "k": ("tensor",), "v": ("tensor",),
}
BATCH_AXES = ACTIVATION_RULES["b"]

# Params whose names carry no axis letters (flax's own names), by their last two path keys.
_NAMED_PARAMS = {("embed", "embedding"): "vd", ("unembed", "kernel"): "dv",
                 ("value_head", "kernel"): "d_", ("value_head", "bias"): "_"}


def _slot_start(path: tuple[str, ...]) -> int | None:
  """Under config.model.scan_layers, where a scanned group's param (`layers/slot_{j}/...`)
  starts in `path`; None for any other."""
  for i, (a, b) in enumerate(zip(path, path[1:])):
    if a == layer_stack.STACK and b.startswith("slot_"):
      return i
  return None


def param_letters(path: tuple[str, ...], ndim: int) -> str:
  """One letter per axis of the param at `path` ('_' for an axis no rule shards). A
  scanned group's param leads with r, the axis of its layers' repeats: no rule shards it,
  so each device holds every layer's slice of what it holds of one."""
  start = _slot_start(path)
  if start is not None:
    return "r" + param_letters(path[start + 2:], ndim - 1)
  name = path[-1]
  if tuple(path[-2:]) in _NAMED_PARAMS:
    return _NAMED_PARAMS[tuple(path[-2:])]
  if name == "scale":  # RMSNorm: over d_model, or over head_dim for q_norm / k_norm.
    return "_" if path[-2] in ("q_norm", "k_norm") else "d"
  letters = name.rsplit("_", 1)[-1]
  if "_" in name and len(letters) == ndim:
    return letters
  raise ValueError(f"param {'/'.join(path)} has no axis letters the sharding rules can read "
                   f"(expected a name ending in _<one letter per axis of its {ndim} axes>).")


def spec_for(letters: str, shape: tuple[int, ...], sizes: dict[str, int],
             rules: dict[str, tuple[str, ...]]) -> P:
  """The PartitionSpec of an array with these axis letters and shape on a mesh of `sizes`."""
  used: set[str] = set()
  out: list[Any] = []
  for letter, dim in zip(letters, shape):
    axes = tuple(a for a in rules.get(letter, ()) if sizes.get(a, 1) > 1 and a not in used)
    if axes and dim % math.prod(sizes[a] for a in axes) == 0:
      used.update(axes)
      out.append(axes[0] if len(axes) == 1 else axes)
    else:
      out.append(None)
  return P(*out)


def _keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_specs(tree, sizes: dict[str, int]):
  """PartitionSpecs for a params tree, or any tree whose leaves sit under param names
  (optimiser moments: the param's path is the tail of the moment's path). Scalars and
  leaves under no param name (a step count) are replicated."""
  def one(path, leaf):
    shape = tuple(getattr(leaf, "shape", ()))
    if not shape:
      return P()
    keys = _keys(path)
    try:
      letters = param_letters(keys, len(shape))
    except ValueError:
      if any(k.startswith("layer_") or k in ("embed", "unembed", layer_stack.STACK)
             for k in keys):
        raise
      return P()
    return spec_for(letters, shape, sizes, PARAM_RULES)
  return jax.tree_util.tree_map_with_path(one, tree)


# KV-cache entries by key (model/cache.py): the ring or full keys and values, their
# positions, the G layers' block summaries, each row's length.
_CACHE_LETTERS = {"k": "bskh", "v": "bskh", "pos": "bs", "block_keys": "bckh", "lengths": "b"}


def cache_specs(cache, sizes: dict[str, int]):
  """PartitionSpecs for a KV-cache pytree: rows over the batch axes, kv heads over tensor.
  A scanned slot's buffers (cache["stack"]) lead with r, never sharded."""
  def one(path, leaf):
    keys = _keys(path)
    letters = _CACHE_LETTERS.get(keys[-1])
    if letters is not None and keys[0] == cache_lib.STACK:
      letters = "r" + letters
    if letters is None or len(letters) != leaf.ndim:
      raise ValueError(f"cache entry {'/'.join(_keys(path))} {leaf.shape}: no axis letters.")
    return spec_for(letters, tuple(leaf.shape), sizes, ACTIVATION_RULES)
  return jax.tree_util.tree_map_with_path(one, cache)


def batch_spec(letters: str, shape: tuple[int, ...], sizes: dict[str, int]) -> P:
  """An activation or batch array's spec (`letters` one per axis, e.g. 'bt' for tokens)."""
  return spec_for(letters, shape, sizes, ACTIVATION_RULES)


def batch_shards(sizes: dict[str, int]) -> int:
  """How many shards a batch's rows split into on a mesh of `sizes` (data x fsdp x expert)."""
  return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


def named(mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def mesh_sizes(mesh) -> dict[str, int]:
  """Axis name -> size, of a Mesh or an AbstractMesh (the context mesh under jit)."""
  return dict(mesh.shape)
