"""Env config: defaults pass, each bad field is named in the error, the spec is built once."""

import pytest

from agentic_rl.envs.config import (ALL_TOOLS, EnvSpec, default_env_config,
                                    validate_env_config)


def test_defaults_validate_and_a_built_spec_passes_through():
  c = default_env_config()
  spec = validate_env_config(c)
  assert isinstance(spec, EnvSpec) and spec == EnvSpec()
  assert validate_env_config(spec) is spec  # Built once: no second validation.
  assert set(spec.tiers) == {"tiny", "easy", "medium", "hard"}
  for t in spec.tiers.values():
    assert set(t.allowlist) <= set(ALL_TOOLS) and "submit" in t.allowlist
  assert validate_env_config(c, max_turns=7).max_turns == 7


@pytest.mark.parametrize("field,value,fragment", [
    ("time_budget_s", -1.0, "config.env.time_budget_s=-1.0"),
    ("budget_end_reward", "half", "config.env.budget_end_reward='half'"),
    ("max_observation_chars", 50, "config.env.max_observation_chars=50"),
    ("max_body_chars", 10_000, "config.env.max_body_chars=10000"),
    ("sandbox.isolation", "docker", "config.env.sandbox.isolation='docker'"),
    ("sandbox.timeout_s", 0, "config.env.sandbox.timeout_s=0"),
    ("sandbox.memory_mb", 4, "config.env.sandbox.memory_mb=4"),
    ("sandbox.max_processes", 1, "config.env.sandbox.max_processes=1"),
    ("sandbox.output_kill_bytes", 10, "config.env.sandbox.output_kill_bytes=10"),
    ("sandbox.uid_base", 0, "config.env.sandbox.uid_base=0"),
    ("tiers.easy.num_bugs", 5, "config.env.tiers.easy.num_bugs=5"),
    ("tiers.easy.allowlist", ("ls", "rm"), "unknown: ['rm']"),
    ("tiers.easy.allowlist", ("ls", "test"), "includes 'submit'"),
    ("default_tier", "nightmare", "config.env.default_tier='nightmare'"),
    ("bug_families", ("typo",), "config.env.bug_families"),
    ("view_max_lines", True, "config.env.view_max_lines=True: expected an integer"),
    ("sandbox.timeoutt_s", 1.0, "unknown field timeoutt_s; valid fields:"),
])
def test_bad_fields_are_named(field, value, fragment):
  c = default_env_config().to_dict()
  *parents, leaf = field.split(".")
  target = c
  for p in parents:
    target = target[p]
  target[leaf] = value
  with pytest.raises(ValueError) as e:
    validate_env_config(c)
  assert fragment in str(e.value), str(e.value)


def test_the_turn_budget_has_one_knob():
  with pytest.raises(ValueError, match="config.rollout.max_turns=0"):
    validate_env_config(default_env_config(), max_turns=0)
  c = default_env_config().to_dict()
  c["max_turns"] = 3
  with pytest.raises(ValueError, match=r"config.env.max_turns is set from "
                                       r"config.rollout.max_turns"):
    validate_env_config(c)


def test_overlapping_splits_are_rejected():
  c = default_env_config()
  c.splits.heldout_seed_start = c.splits.train_seed_start + c.splits.train_size - 1
  with pytest.raises(ValueError, match="disjoint from the train seeds"):
    validate_env_config(c)


def test_not_a_section():
  with pytest.raises(ValueError, match="expected a section"):
    validate_env_config(3)
