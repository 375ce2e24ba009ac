"""Envs by name: the registry resolves each env's spec, tasks, families and expert."""

import ml_collections
import pytest

from agentic_rl.envs import countdown
from agentic_rl.envs import registry
from agentic_rl.envs.config import EnvSpec, default_env_config


def test_names_resolve_to_their_specs():
  assert {"swe", "countdown"} <= set(registry.names())
  assert isinstance(registry.build_spec(default_env_config(), max_turns=5), EnvSpec)
  spec = registry.build_spec(countdown.default_config(), max_turns=7)
  assert isinstance(spec, countdown.CountdownSpec) and spec.max_turns == 7
  assert registry.family_of(spec).name == "countdown"
  with pytest.raises(ValueError, match=r"config.env.name='chess': expected one of"):
    registry.build_spec(ml_collections.ConfigDict({"name": "chess"}))
  c = countdown.default_config()
  c.tiers.short.max_start = 0
  with pytest.raises(ValueError, match=r"config.env.tiers.short.max_start=0"):
    registry.build_spec(c)


def test_countdown_tasks_families_and_expert():
  spec = registry.build_spec(countdown.default_config(), max_turns=12)
  family = registry.get("countdown")
  train = family.task_source(spec, "train", "long")
  held = family.task_source(spec, "heldout", "long")
  assert train[3] == train[3] and 4 <= train[3]["start"] <= 8 and train[3]["pad"] == 2
  starts = {train[i]["start"] for i in range(50)}
  assert starts == set(range(4, 9))  # Every start of the tier is drawn.
  assert [held[i] for i in range(20)] != [train[i] for i in range(20)]
  assert family.task_family(train[3]) == f"start_{train[3]['start']}"
  with pytest.raises(ValueError, match="unknown tier 'huge'"):
    family.task_source(spec, "train", "huge")
  task = train[3]
  episode = family.play_expert(family.make_env(spec, None), task)
  # By hand: start n takes n + 1 right answers; the last says 0 and scores 1.
  assert len(episode.turns) == task["start"] + 1 and episode.reward == 1.0
  assert episode.turns[-1] == ("ok <tool_call>say 0</tool_call>", "Done.")


def test_the_countdown_turn_budget_ends_an_episode():
  spec = registry.build_spec(countdown.default_config(), max_turns=2)
  env = countdown.CountdownEnv(spec)
  env.reset({"start": 5, "pad": 0})
  assert not env.step("<tool_call>say 5</tool_call>").done
  last = env.step("<tool_call>say 9</tool_call>")
  assert last.done and last.reward == 0.0 and last.info["end_reason"] == "turn_budget"


def test_the_run_audit_log_takes_the_env_audit_options(tmp_path):
  c = default_env_config()
  c.audit_max_arg_chars, c.audit_fsync = 16, True
  spec = registry.build_spec(c, max_turns=4)
  log = registry.family_of(spec).make_audit_log(spec, str(tmp_path / "audit.jsonl"))
  try:
    assert (log._max_arg_chars, log._fsync) == (16, True)
  finally:
    log.close()
