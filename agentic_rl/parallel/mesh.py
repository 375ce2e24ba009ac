"""The device mesh `config.mesh` describes, and params placed on it from the start.

    mesh = build_mesh(validate_mesh_config(config.mesh), model_spec)
    params = init_sharded(model, jax.random.key(seed), mesh)   # never whole on one device

Axes are Auto: jit propagates the shardings the rules give inputs and outputs (GSPMD), and
the expert-parallel path takes its axis explicitly with jax.shard_map.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh

from agentic_rl.config_schema import FieldError
from agentic_rl.parallel import rules
from agentic_rl.parallel.mesh_config import AXES, MeshSpec, check_model


def build_mesh(spec: MeshSpec, model_spec=None, devices=None) -> Mesh:
  """A mesh over `devices` (default: every device of every process) with axes AXES."""
  devices = list(jax.devices() if devices is None else devices)
  try:
    sizes = spec.resolve(len(devices))
  except FieldError as err:
    raise err.at("config.mesh") from None
  if model_spec is not None:
    check_model(sizes, model_spec)
  return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES,
                       axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def param_shardings(model, mesh: Mesh):
  """NamedShardings of the model's params by the rules, from shapes only."""
  return rules.named(mesh, rules.param_specs(model.param_shapes(), rules.mesh_sizes(mesh)))


def init_sharded(model, rng, mesh: Mesh):
  """The model's params, each created directly in its shards (jit with out_shardings)."""
  return model.init(rng, out_shardings=param_shardings(model, mesh))
