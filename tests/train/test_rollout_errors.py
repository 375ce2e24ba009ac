"""The main job survives an environment that raises: the trajectory ends with env_error,
rollout/end_env_error counts it, and the RL step trains on the batch as usual."""

import dataclasses
import itertools
import json
import os

import numpy as np
import pytest

from agentic_rl.envs import registry
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.train import reporting
from agentic_rl.train.trainer import Trainer
from tests.train.tiny_config import tiny_config


class FlakySweEnv(SweEnv):
  """Every other env raises on its second step, as a host-side bug would."""

  _count = itertools.count()

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._flaky = next(FlakySweEnv._count) % 2 == 1
    self._steps = 0

  def step(self, action_text):
    self._steps += 1
    if self._flaky and self._steps == 2:
      raise RuntimeError("the host lost the sandbox")
    return super().step(action_text)


@pytest.mark.slow
def test_an_env_that_raises_ends_its_trajectory_and_the_run_goes_on(tmp_path, monkeypatch):
  # A flaky variant of the SWE env, by name: the trainer builds envs only through the registry.
  flaky = dataclasses.replace(
      registry.get("swe"), name="flaky_swe",
      make_env=lambda spec, audit_log: FlakySweEnv(spec, audit_log=audit_log))
  monkeypatch.setitem(registry._BUILDERS, "flaky_swe", lambda: flaky)
  monkeypatch.setitem(registry._FAMILIES, "flaky_swe", flaky)
  config = tiny_config()
  config.env.name = "flaky_swe"
  config.train.sft_steps = 0
  config.rl.num_steps = 1
  summary = Trainer(config, str(tmp_path)).run()
  assert summary["rl_steps"] == 1
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    [rl] = [m for m in map(json.loads, f) if "rollout/reward_mean" in m]
  ends = {k: v for k, v in rl.items() if k.startswith("rollout/end_")}
  assert set(ends) == {f"rollout/end_{r}" for r in reporting.END_REASONS + ("other",)}
  assert ends["rollout/end_env_error"] >= 1
  assert sum(ends.values()) == rl["rollout/episodes"]
  assert rl["skipped_steps"] == 0 and np.isfinite(rl["loss"])
