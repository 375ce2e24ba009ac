"""Our params tree straight from a Hugging Face checkpoint, in memory (parity checks and
tests; runs start from an imported folder instead, see hf_import.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.interop import hf_import
from agentic_rl.interop.hf_source import TensorSource
from agentic_rl.model.config import ModelSpec
from agentic_rl.model import layer_stack
from agentic_rl.model.families import layout
from agentic_rl.model.transformer import Model


def load(spec: ModelSpec, source: TensorSource, rng_seed: int = 0) -> dict:
  """The params of `Model(spec)`: every Hugging Face tensor through its rule, and the params
  no tensor fills (S gates of a retrofit, a value head) at their initial values. Built
  unrolled, as the rules name them; stacked at the end when spec.scan_layers."""
  rules = hf_import.plan(spec, source)
  flat = {r.ours: jnp.asarray(r.to_ours([source.read(n) for n in r.hf]).astype(
      np.dtype(jnp.dtype(spec.param_dtype)))) for r in rules}
  model = Model(spec.replace(scan_layers=False))
  names = [_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(model.param_shapes())]
  fresh = layout.fresh_params(spec, names)
  if fresh:
    init = {_name(p): leaf for p, leaf in
            jax.tree_util.tree_leaves_with_path(model.init(jax.random.key(rng_seed)))}
    flat.update({name: init[name] for name in fresh})
  return layer_stack.stack_layers(layout.nest(flat), spec)


def _name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")
