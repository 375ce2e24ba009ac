"""No stale pay at a budget's end: `budget_end_reward='measured'` measures the module as
it is then, or pays zero.

Before, with the hidden run after each edit on (the default), the budget's end paid the
last count the env had: fix the bug, then re-break the module where no run measures it
(a `python` edit) or behind a reply the host cannot decode, and the turn budget paid
1.00 for the broken module.
"""

import pytest

from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config
from tests.envs.forged_reply import forging_lines


def _fix(task):
  bug = task.bugs[0]
  return F("replace", path=task.module_path, start=bug.line, end=bug.line,
           text=bug.correct_line)


def _run(isolation, task, actions, **overrides):
  cfg = env_config(isolation, timeout_s=5.0, budget_end_reward="measured",
                   max_turns=len(actions), **overrides)
  with SweEnv(cfg) as env:
    env.reset(task)
    return [env.step(a) for a in actions]


def test_re_breaking_a_fixed_module_behind_a_decode_failure_pays_nothing(isolation):
  task = generate_task(4, "easy")
  forged = "\n".join(forging_lines('b"[" * 10_000'))
  fixed, broken, last = _run(isolation, task, [
      _fix(task), F("replace", path=task.module_path, start=1, end=0, text=forged), F("ls")])
  assert fixed.info["tests_passed"] == task.num_hidden
  assert last.done and last.info["end_reason"] == "turn_budget"
  assert last.reward == 0.0, last.observation
  assert "reward 0.00" in last.observation


def test_re_breaking_a_fixed_module_with_python_pays_what_the_broken_module_earns(isolation):
  task = generate_task(6, "medium")  # python is on the medium allowlist.
  unfixed = task.files[task.module_path]
  rebreak = F("python", code=f"open({task.module_path!r}, 'w').write({unfixed!r})")
  fixed, _, last = _run(isolation, task, [_fix(task), rebreak, F("ls")],
                        reward="tests_fraction")
  assert fixed.info["tests_passed"] > task.hidden_initial_passed
  assert last.done and last.info["end_reason"] == "turn_budget"
  assert last.reward == pytest.approx(task.hidden_initial_passed / task.num_hidden)
  assert last.info["tests_passed"] == task.hidden_initial_passed


def test_a_run_that_fails_on_the_host_at_the_budget_end_pays_zero(monkeypatch):
  task = generate_task(4, "easy")
  cfg = env_config("fallback", timeout_s=5.0, budget_end_reward="measured", max_turns=2)
  with SweEnv(cfg) as env:
    env.reset(task)
    assert env.step(_fix(task)).info["tests_passed"] == task.num_hidden

    def broken(*_, **__):
      raise OSError("the host could not run it")
    monkeypatch.setattr(env._sandbox, "request", broken)
    last = env.step(F("ls"))
  assert last.done and last.reward == 0.0 and last.info["tests_passed"] == 0


def test_a_fixed_module_still_earns_at_the_budget_end(isolation):
  task = generate_task(4, "easy")
  _, last = _run(isolation, task, [_fix(task), F("ls")])
  assert last.done and last.info["end_reason"] == "turn_budget" and last.reward == 1.0
