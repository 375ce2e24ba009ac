"""The active route's model, specs, learner step and engines; rebuilt when the stage
switches (config.train.switch_to_route_a_at: throughput early, consistency late)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from agentic_rl.model import config as model_config_lib
from agentic_rl.model import transformer
from agentic_rl.rl import config as rl_config_lib
from agentic_rl.rl import train_step as train_step_lib
from agentic_rl.rollout import config as rollout_config_lib
from agentic_rl.rollout import engine as engine_lib
from agentic_rl.train import config as train_config_lib


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

  def init_state(self, seed: int) -> train_step_lib.TrainState:
    """Fresh params from `seed` and a fresh optimiser state. The KL reference is the
    policy RL starts from: set when SFT hands over or start params load, then carried."""
    params = self.model.init(jax.random.key(seed))
    ref = params if self.rl_spec.loss.kl_coef > 0 else None
    return train_step_lib.init_train_state(self.model, params, self.rl_spec, ref_params=ref)

  def close(self):
    self.engine.close()
    self.eval_engine.close()


class Routes:
  """The route of each RL step, built once per stage."""

  def __init__(self, base_config: ml_collections.ConfigDict, train_spec, tokenizer,
               env_factory: Callable):
    self.base_config = base_config
    self.train_spec = train_spec
    self.tokenizer = tokenizer
    self.env_factory = env_factory
    self.current: Route | None = None

  def config_for_step(self, rl_step: int) -> tuple[str, ml_collections.ConfigDict]:
    switch = self.train_spec.switch_to_route_a_at
    if switch >= 0 and rl_step >= switch:
      return "A", train_config_lib.apply_overrides(self.base_config,
                                                   self.base_config.route_a)
    return "base", self.base_config

  def for_step(self, rl_step: int) -> Route:
    name, config = self.config_for_step(rl_step)
    if self.current is None or self.current.name != name:
      if self.current is not None:
        self.current.close()
      self.current = self._build(name, config)
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
                                      self.env_factory)
    eval_engine = engine_lib.RolloutEngine(model, None, eval_spec, self.tokenizer,
                                           self.env_factory)
    return Route(name, config, model, rl_spec, rollout_spec, eval_spec,
                 train_step_lib.make_train_step(model, rl_spec), engine, eval_engine)

  def close(self):
    if self.current is not None:
      self.current.close()
