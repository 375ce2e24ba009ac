"""The active route's model, specs, learner step and engines; rebuilt when the stage
switches (config.train.switch_to_route_a_at: throughput early, consistency late)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from agentic_rl.model import config as model_config_lib
from agentic_rl.model import transformer
from agentic_rl.parallel import placement
from agentic_rl.rl import config as rl_config_lib
from agentic_rl.rl import train_step as train_step_lib
from agentic_rl.rollout import config as rollout_config_lib
from agentic_rl.rollout import engine as engine_lib
from agentic_rl.train import config as train_config_lib
from agentic_rl.train import learner_lengths


@dataclasses.dataclass
class Route:
  name: str  # "base" or "A"
  config: ml_collections.ConfigDict
  model: transformer.Model
  rl_spec: Any
  rollout_spec: Any
  eval_spec: Any  # rollout_spec with the held-out temperature and sample count.
  train_step: Any
  engine: engine_lib.RolloutEngine
  eval_engine: engine_lib.RolloutEngine
  mesh: Any = None  # The learner's mesh (None: wherever JAX puts things).
  sampler_mesh: Any = None  # The engines' mesh (parallel/placement.sampler_mesh).

  def init_state(self, seed: int) -> train_step_lib.TrainState:
    """Fresh params from `seed` and a fresh optimiser state, each born in its shards on
    the mesh. The KL reference is the policy RL starts from: set when SFT hands over or
    start params load, then carried."""
    key = jax.random.key(seed)
    if self.mesh is None:
      return self._state_from(self.model.init(key))
    shardings = placement.state_shardings(self.layout, self.mesh)
    params = self.model.init(key, out_shardings=shardings.params)
    return jax.jit(self._state_from, out_shardings=shardings)(params)

  def sampler_params(self, params):
    """`params` as the engines take them (placement.to_sampler): the same arrays with one
    process; gathered once onto this process's devices with several."""
    if self.sampler_mesh is None:
      return params
    return placement.to_sampler(params, self.sampler_mesh)

  def _state_from(self, params) -> train_step_lib.TrainState:
    ref = params if self.rl_spec.loss.kl_coef > 0 else None
    return train_step_lib.init_train_state(self.model, params, self.rl_spec, ref_params=ref)

  @functools.cached_property
  def layout(self):
    """Shapes and dtypes of this route's train state (no arrays)."""
    return jax.eval_shape(self._state_from, self.model.param_shapes())

  def adopt(self, state: train_step_lib.TrainState, seed: int) -> train_step_lib.TrainState:
    """`state` in this route's layout; as given when it already is. At a switch to a route
    with a value head (route A's critic), the head starts fresh from `seed`; every param
    and optimiser moment both layouts have carries over, cast to this route's dtypes; the
    KL reference gets the same treatment."""
    if _same_layout(state, self.layout):
      return state
    fresh = self.init_state(seed)
    params = graft(fresh.params, state.params)
    opt_state = graft(fresh.opt_state, state.opt_state)  # Fresh moments are zeros.
    ref = fresh.ref_params
    if ref is not None:
      ref = graft(ref, state.ref_params if state.ref_params is not None else params)
    return state.replace(params=params, opt_state=opt_state, ref_params=ref)

  def close(self):
    self.engine.close()
    self.eval_engine.close()


def _same_layout(tree, layout) -> bool:
  if jax.tree.structure(tree) != jax.tree.structure(layout):
    return False
  return all(x.shape == y.shape and x.dtype == y.dtype
             for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(layout)))


def graft(into, source):
  """`into` with each leaf that `source` has at the same path taken from `source`, cast to
  `into`'s dtype; leaves only `into` has keep their values. A shared path whose shapes
  differ is an error naming it."""
  source_leaves = {jax.tree_util.keystr(path): leaf
                   for path, leaf in jax.tree_util.tree_leaves_with_path(source)}

  def take(path, leaf):
    name = jax.tree_util.keystr(path)
    if name not in source_leaves:
      return leaf
    src = source_leaves[name]
    if src.shape != leaf.shape:
      raise ValueError(f"cannot carry {name} over to the new route: shape {src.shape}, "
                       f"the route expects {leaf.shape}")
    return jnp.asarray(src, leaf.dtype)

  return jax.tree_util.tree_map_with_path(take, into)


class Routes:
  """The route of each RL step, built once per stage."""

  def __init__(self, base_config: ml_collections.ConfigDict, train_spec, tokenizer,
               env_factory: Callable, mesh=None):
    """mesh: the learner's (parallel/mesh.build_mesh); None leaves placement to JAX."""
    self.base_config = base_config
    self.mesh = mesh
    self.sampler_mesh = None if mesh is None else placement.sampler_mesh(mesh)
    self.train_spec = train_spec
    self.tokenizer = tokenizer
    self.env_factory = env_factory
    self.current: Route | None = None

  def name_for_step(self, rl_step: int) -> str:
    switch = self.train_spec.switch_to_route_a_at
    return "A" if switch >= 0 and rl_step >= switch else "base"

  def config_for_step(self, rl_step: int) -> tuple[str, ml_collections.ConfigDict]:
    name = self.name_for_step(rl_step)
    if name == "A":
      return name, train_config_lib.route_a_config(self.base_config)
    return name, self.base_config

  def for_step(self, rl_step: int) -> Route:
    # Called every RL step: the route's config is built only when the stage changes.
    if self.current is None or self.current.name != self.name_for_step(rl_step):
      if self.current is not None:
        self.current.close()
      self.current = self._build(*self.config_for_step(rl_step))
    return self.current

  def _build(self, name: str, config: ml_collections.ConfigDict) -> Route:
    spec = model_config_lib.validate(config.model)
    model = transformer.Model(spec)
    rl_spec = rl_config_lib.validate(config.rl, config.model, config.rollout)
    rollout_spec = rollout_config_lib.validate(config.rollout, spec, seed=config.seed)
    tc = self.train_spec
    greedy = {"top_k": 0, "top_p": 1.0} if tc.eval_temperature == 0 else {}
    eval_spec = dataclasses.replace(rollout_spec, temperature=tc.eval_temperature,
                                    group_size=tc.eval_samples, **greedy)
    # Weights arrive through set_params before every use.
    engine = engine_lib.RolloutEngine(model, None, rollout_spec, self.tokenizer,
                                      self.env_factory, mesh=self.sampler_mesh)
    eval_engine = engine_lib.RolloutEngine(model, None, eval_spec, self.tokenizer,
                                           self.env_factory, mesh=self.sampler_mesh)
    return Route(name, config, model, rl_spec, rollout_spec, eval_spec,
                 train_step_lib.make_train_step(
                     model, rl_spec, donate=True,
                     lengths=learner_lengths.learner_lengths(tc.learner_lengths,
                                                             rollout_spec.max_len)),
                 engine, eval_engine,
                 self.mesh, self.sampler_mesh)

  def close(self):
    if self.current is not None:
      self.current.close()
