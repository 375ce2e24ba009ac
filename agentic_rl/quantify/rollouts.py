"""Real trajectories for the quantify commands: the engine samples the config's env from a
checkpoint, the same tasks and seeds whatever the config's route."""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any


@dataclasses.dataclass
class Sampled:
  trajectories: list
  model: Any  # model/transformer.Model of the config
  params: Any
  rl_spec: Any
  rollout_spec: Any


def sample(config, checkpoint: str, num_tasks: int) -> Sampled:
  """`num_tasks` groups of the config's default tier (its train task stream, seeded by
  config.seed), sampled by the config's engine with task seeds 0..num_tasks-1 from the
  params saved at `checkpoint` (loaded as the trainer loads them: layout checked)."""
  from agentic_rl.train.trainer import Trainer  # The trainer imports the whole stack.
  with tempfile.TemporaryDirectory() as scratch:
    trainer = Trainer(config, scratch)
    try:
      params, _ = trainer.load_params(checkpoint, "--checkpoint")
      route = trainer.routes.for_step(0)
      route.engine.set_params(route.sampler_params(params), 0)
      tier = trainer.env_spec.default_tier
      tasks = [trainer.tasks.task(trainer.tasks.next_task(tier)) for _ in range(num_tasks)]
      trajs = route.engine.run(tasks, task_seeds=list(range(num_tasks)))
      return Sampled(trajs, route.model, params, route.rl_spec, route.rollout_spec)
    finally:
      trainer.close()
