"""The scanned params layout (config.model.scan_layers) and the unrolled one, converted.

Unrolled, layer i's params sit under `layer_{i}`. Scanned (`ModelSpec.layer_scan`), the
first `unrolled` layers keep their names and the rest sit under `layers/slot_{j}`, each
param with a leading axis of `repeats` (axis letter r): layer `unrolled + r * period + j`
is `layers/slot_{j}[r]`. Params files keep the unrolled layout, whatever the run's
(train/params_file.py); these pure functions convert at that boundary.

    stacked = stack_layers(params, spec)      # unrolled -> spec's layout
    params = unstack_layers(stacked, spec)    # and back, exactly
    params = unstacked(tree)                  # the unrolled layout of either, no spec needed

Leaves may be numpy or jax arrays, or ShapeDtypeStructs (eval_shape trees).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model.config import LayerScan, ModelSpec

STACK = "layers"  # The scanned group's module: params under layers/slot_{j}.


def layer_name(i: int) -> str:
  return f"layer_{i}"


def slot_name(j: int) -> str:
  return f"slot_{j}"


def scan_of(params: Mapping[str, Any]) -> LayerScan | None:
  """The layout a params tree is in, read from its keys and the repeat axis: None when
  unrolled."""
  slots = params.get(STACK) if isinstance(params, Mapping) else None
  if not (isinstance(slots, Mapping) and slots and all(str(k).startswith("slot_")
                                                        for k in slots)):
    return None
  repeats = jax.tree.leaves(slots)[0].shape[0]
  unrolled = sum(1 for k in params if k.startswith("layer_"))
  return LayerScan(unrolled=unrolled, period=len(slots), repeats=repeats)


def _stack_leaves(*leaves):
  first = leaves[0]
  if isinstance(first, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(leaves),) + tuple(first.shape), first.dtype)
  if all(isinstance(x, np.ndarray) for x in leaves):  # Host arrays stay on the host.
    return np.stack(leaves)
  return jnp.stack(leaves)


def _index_leaf(x, r: int):
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype)
  return x[r]


def stack(params: Mapping[str, Any], scan: LayerScan | None):
  """Unrolled params in the layout `scan` describes (unchanged for None)."""
  if scan is None:
    return params
  if scan_of(params) is not None:
    raise ValueError("params are already in the scanned layout (config.model.scan_layers): "
                     f"they hold '{STACK}'.")
  scanned = {layer_name(scan.layer(j, r)) for j in range(scan.period)
             for r in range(scan.repeats)}
  missing = sorted(scanned - set(params))
  if missing:
    raise ValueError(f"params lack {missing[:4]}: not the unrolled layout of a "
                     f"{scan.unrolled + scan.period * scan.repeats}-layer model.")
  out = {k: v for k, v in params.items() if k not in scanned}
  out[STACK] = {
      slot_name(j): jax.tree.map(_stack_leaves, *[params[layer_name(scan.layer(j, r))]
                                                  for r in range(scan.repeats)])
      for j in range(scan.period)}
  return out


def unstack(params: Mapping[str, Any], scan: LayerScan | None):
  """Params in the layout `scan` describes, unrolled (unchanged for None)."""
  if scan is None:
    return params
  out = {k: v for k, v in params.items() if k != STACK}
  for j in range(scan.period):
    slot = params[STACK][slot_name(j)]
    for r in range(scan.repeats):
      out[layer_name(scan.layer(j, r))] = jax.tree.map(lambda x, r=r: _index_leaf(x, r), slot)
  return out


def stack_layers(params: Mapping[str, Any], spec: ModelSpec):
  """Unrolled params (as an unscanned model inits them, or a file holds them) in `spec`'s
  layout: scanned when spec.scan_layers, else unchanged."""
  return stack(params, spec.layer_scan)


def unstack_layers(params: Mapping[str, Any], spec: ModelSpec):
  """Params in `spec`'s layout, unrolled; `stack_layers` inverts it exactly."""
  return unstack(params, spec.layer_scan)


def unstacked(params):
  """Any params tree in the unrolled layout (its own layout read by `scan_of`)."""
  return unstack(params, scan_of(params))


def _is_params(tree, key: str) -> bool:
  return isinstance(tree, Mapping) and key in tree


def stack_layers_in(tree, spec: ModelSpec):
  """`stack_layers` on every params-shaped dict inside `tree` (an optax state's moments);
  other leaves (a step count) unchanged."""
  scan = spec.layer_scan
  if scan is None:
    return tree
  key = layer_name(scan.layer(0, 0))
  return jax.tree.map(lambda x: stack(x, scan) if _is_params(x, key) else x, tree,
                      is_leaf=lambda x: _is_params(x, key))


def unstack_layers_in(tree, spec: ModelSpec):
  """`unstack_layers` on every params-shaped dict inside `tree`; the inverse of
  `stack_layers_in`."""
  scan = spec.layer_scan
  if scan is None:
    return tree
  return jax.tree.map(lambda x: unstack(x, scan) if scan_of(x) else x, tree,
                      is_leaf=lambda x: scan_of(x) is not None)
