"""Env config validation: defaults pass, each bad field is named in the error."""

import pytest

from agentic_rl.envs.config import ALL_TOOLS, default_env_config, validate_env_config


def test_defaults_validate():
  c = default_env_config()
  assert validate_env_config(c) is c
  assert set(c.tiers.keys()) == {"tiny", "easy", "medium", "hard"}
  for t in c.tiers.values():
    assert set(t.allowlist) <= set(ALL_TOOLS) and "submit" in t.allowlist


@pytest.mark.parametrize("field,value,fragment", [
    ("max_turns", 0, "max_turns = 0"),
    ("time_budget_s", -1.0, "time_budget_s = -1.0"),
    ("budget_end_reward", "half", "budget_end_reward = 'half'"),
    ("max_observation_chars", 50, "max_observation_chars = 50"),
    ("max_body_chars", 10_000, "max_body_chars = 10000"),
    ("sandbox.isolation", "docker", "sandbox.isolation = 'docker'"),
    ("sandbox.timeout_s", 0, "sandbox.timeout_s = 0"),
    ("sandbox.memory_mb", 4, "sandbox.memory_mb = 4"),
    ("sandbox.max_processes", 1, "sandbox.max_processes = 1"),
    ("sandbox.output_kill_bytes", 10, "sandbox.output_kill_bytes = 10"),
    ("sandbox.uid_base", 0, "sandbox.uid_base = 0"),
    ("tiers.easy.num_bugs", 5, "tiers.easy.num_bugs = 5"),
    ("tiers.easy.allowlist", ("ls", "rm"), "unknown: ['rm']"),
    ("tiers.easy.allowlist", ("ls", "test"), "includes 'submit'"),
    ("default_tier", "nightmare", "default_tier = 'nightmare'"),
    ("bug_families", ("typo",), "bug_families"),
    ("max_turns", True, "max_turns = True"),
])
def test_bad_fields_are_named(field, value, fragment):
  c = default_env_config()
  *parents, leaf = field.split(".")
  target = c
  for p in parents:
    target = target[p]
  target[leaf] = value
  with pytest.raises(ValueError, match="env config") as e:
    validate_env_config(c)
  assert fragment in str(e.value), str(e.value)


def test_overlapping_splits_are_rejected():
  c = default_env_config()
  c.splits.heldout_seed_start = c.splits.train_seed_start + c.splits.train_size - 1
  with pytest.raises(ValueError, match="splits overlap"):
    validate_env_config(c)


def test_not_a_configdict():
  with pytest.raises(ValueError, match="ConfigDict"):
    validate_env_config({"max_turns": 3})
