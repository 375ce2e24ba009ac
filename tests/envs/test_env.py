"""The SWE env's protocol: turns, budgets, rewards, process signal, permissions, bounds."""

import os
import subprocess
import time

import pytest

from agentic_rl.envs.audit import AuditLog, verify_audit_log
from agentic_rl.envs.env import Env, StepResult
from agentic_rl.envs.swe_env import SweEnv, episode_reward
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config, live_pids_of_uid

INFO_KEYS = {"tool", "decision", "process_signal", "tests_passed", "tests_total", "turn"}


def fix_action(task, bug):
  return F("replace", path=task.module_path, start=bug.line, end=bug.line, text=bug.correct_line)


def test_protocol_shape_and_a_solved_episode(tmp_path):
  task = generate_task(1, "easy")
  audit = AuditLog(str(tmp_path / "audit.jsonl"))
  with SweEnv(env_config(), audit) as env:
    assert isinstance(env, Env)
    first = env.reset(task)
    assert "<tool_call>" in first and "submit" in first
    r = env.step(F("ls"))
    assert isinstance(r, StepResult)
    obs, reward, done, info = r
    assert task.module_path in obs and task.test_path in obs
    assert INFO_KEYS <= set(info) and "end_reason" not in info and not done and reward == 0.0
    r = env.step(fix_action(task, task.bugs[0]))
    # Reward and process signal grade the hidden cases.
    assert r.info["process_signal"] == pytest.approx(
        (task.num_hidden - task.hidden_initial_passed) / task.num_hidden)
    r = env.step(F("submit"))
    assert r.done and r.reward == 1.0 and r.info["end_reason"] == "submit"
    assert f"{task.num_hidden}/{task.num_hidden} hidden tests pass" in r.observation
    with pytest.raises(RuntimeError, match="after the episode ended"):
      env.step(F("ls"))
  audit.close()
  v = verify_audit_log(audit.path)
  assert v.ok and v.lines == 3 and v.by_tool == {"ls": 1, "replace": 1, "submit": 1}


def test_step_before_reset_raises():
  with pytest.raises(RuntimeError, match="before reset"):
    SweEnv(env_config()).step(F("ls"))


def test_malformed_unknown_denied_and_bad_calls_are_turns_with_audited_decisions():
  task = generate_task(2, "easy")  # python is not on the easy allowlist
  audit = AuditLog(None)
  actions = [
      ("I think the bug is in line 3.", None, "error", "no tool call found"),
      (F("ls") + F("test"), None, "error", "2 tool calls"),
      ("<tool_call>rm -rf /</tool_call>", None, "error", "unknown tool 'rm'"),
      ("<tool_call>view</tool_call>", "view", "error", "missing PATH"),
      (F("python", code="print(1)"), "python", "denied", "not allowed for this task"),
      (F("replace", path=task.test_path, start=1, end=1, text="import os"), "replace",
       "denied", "read-only"),
      (F("view", path="../../etc/passwd"), "view", "denied", "'..' is not allowed"),
      (F("view", path="/etc/passwd"), "view", "denied", "absolute paths"),
      (F("view", path="missing.py"), "view", "error", "no such file"),
      (F("view", path=task.module_path, start=999), "view", "error", "past the end"),
      (F("replace", path=task.module_path, start=5, end=1, text="x"), "replace", "error",
       "bad range"),
  ]
  with SweEnv(env_config(max_turns=50), audit) as env:
    env.reset(task)
    for turn, (action, tool, decision, fragment) in enumerate(actions, start=1):
      obs, reward, done, info = env.step(action)
      assert (info["tool"], info["decision"], info["turn"]) == (tool, decision, turn), obs
      assert fragment in obs and not done and reward == 0.0
      assert info["process_signal"] == 0.0
  assert [e["decision"] for e in audit.entries] == [a[2] for a in actions]
  assert audit.entries[0]["args"] == {"raw": actions[0][0]}


@pytest.mark.parametrize("mode", ["zero", "measured"])
def test_turn_budget_ends_the_episode(mode):
  task = generate_task(3, "easy")
  with SweEnv(env_config(max_turns=3, budget_end_reward=mode)) as env:
    env.reset(task)
    assert not env.step(F("ls")).done
    assert not env.step(fix_action(task, task.bugs[0])).done
    r = env.step(F("ls"))
    assert r.done and r.info["end_reason"] == "turn_budget"
    assert "turn budget reached" in r.observation
    assert r.reward == (1.0 if mode == "measured" else 0.0)


def test_time_budget_ends_the_episode_without_running_the_action():
  task = generate_task(4, "easy")
  audit = AuditLog(None)
  with SweEnv(env_config(time_budget_s=0.5), audit) as env:
    env.reset(task)
    assert not env.step(F("ls")).done
    time.sleep(0.6)
    r = env.step(fix_action(task, task.bugs[0]))
    assert r.done and r.info["end_reason"] == "time_budget" and r.reward == 0.0
    assert "time budget" in r.observation and r.info["decision"] == "denied"
    assert r.info["tests_passed"] == task.hidden_initial_passed  # The fix was not applied.
  assert len(audit.entries) == 2 and audit.entries[1]["reason"] == "time budget exhausted"


@pytest.mark.parametrize("on_edit", [True, False])
def test_process_signal_sums_to_the_change_in_pass_fraction(on_edit):
  task = generate_task(5, "easy")
  bug = task.bugs[0]
  total, initial = task.num_hidden, task.hidden_initial_passed
  with SweEnv(env_config(process_signal_on_edit=on_edit)) as env:
    env.reset(task)
    script = [
        F("test"),
        F("replace", path=task.module_path, start=bug.line, end=bug.line,
          text=bug.buggy_line + " +"),  # A syntax error: every test fails.
        F("test"),
        fix_action(task, bug),
        F("view", path=task.module_path),
        F("submit"),
    ]
    signals, passed = [], []
    for a in script:
      r = env.step(a)
      signals.append(r.info["process_signal"])
      passed.append(r.info["tests_passed"])
  assert r.reward == 1.0
  assert sum(signals) == pytest.approx(1.0 - initial / total)
  if on_edit:  # Credit lands on the edits themselves.
    assert signals == pytest.approx([0.0, -initial / total, 0.0, 1.0, 0.0, 0.0])
  else:  # Only turns that run the tests see the change.
    assert signals == pytest.approx([0.0, 0.0, -initial / total, 0.0, 0.0, 1.0])
  assert passed[2] == 0


@pytest.mark.parametrize("tier", ["tiny", "easy", "medium"])
def test_looking_testing_and_submitting_without_an_edit_earns_exactly_zero(tier):
  # The give-up optimum of partial credit: tests the untouched repo passes earn nothing.
  task = next(t for t in (generate_task(s, tier) for s in range(40))
              if t.hidden_initial_passed > 0)
  with SweEnv(env_config()) as env:
    env.reset(task)
    env.step(F("ls"))
    r = env.step(F("test"))
    assert "FAIL" in r.observation or "ERROR" in r.observation
    r = env.step(F("submit"))
  assert r.done and r.reward == 0.0 and r.info["tests_passed"] == task.hidden_initial_passed
  # The submit observation counts the hidden cases and shows none of them.
  assert (f"submitted: {task.hidden_initial_passed}/{task.num_hidden} hidden tests pass"
          in r.observation)
  assert "FAIL" not in r.observation and "want" not in r.observation


def test_partial_credit_is_an_option_and_counts_passing_tests():
  task = generate_task(6, "medium")
  assert task.hidden_initial_passed > 0
  with SweEnv(env_config(reward="tests_fraction")) as env:
    env.reset(task)
    r = env.step(F("submit"))
  assert r.done and r.reward == pytest.approx(task.hidden_initial_passed / task.num_hidden)


def test_repairing_one_of_two_bugs_earns_its_share_of_the_failing_tests():
  task = next(t for t in (generate_task(s, "medium") for s in range(40)) if len(t.bugs) == 2)
  with SweEnv(env_config()) as env:
    env.reset(task)
    r = env.step(fix_action(task, task.bugs[0]))
    passed = r.info["tests_passed"]
    r = env.step(F("submit"))
  failing = task.num_hidden - task.hidden_initial_passed
  assert 0 < passed - task.hidden_initial_passed < failing
  assert r.reward == pytest.approx((passed - task.hidden_initial_passed) / failing)


@pytest.mark.parametrize("mode,passed,initial,total,want", [
    # Hand-computed: (newly passing - newly failing) / initially failing, floored at 0.
    ("repaired_fraction", 2, 2, 4, 0.0), ("repaired_fraction", 3, 2, 4, 0.5),
    ("repaired_fraction", 4, 2, 4, 1.0), ("repaired_fraction", 1, 2, 4, 0.0),
    ("repaired_fraction", 4, 0, 4, 1.0), ("repaired_fraction", 3, 3, 3, 1.0),
    ("tests_fraction", 3, 2, 4, 0.75), ("outcome", 3, 2, 4, 0.0), ("outcome", 4, 2, 4, 1.0)])
def test_episode_reward_formulas(mode, passed, initial, total, want):
  assert episode_reward(mode, passed, initial, total) == want


def test_editing_or_shadowing_the_tests_does_not_pass_them(tmp_path):
  task = generate_task(7, "medium")  # python is allowed
  mod = task.module_path[:-3]
  lines = task.files[task.module_path].split("\n")
  for b in task.bugs:
    lines[b.line - 1] = b.correct_line
  fixed_src = "\n".join(lines)
  with SweEnv(env_config()) as env:
    env.reset(task)
    ws = env._sandbox.workspace.path
    attack = (
        f"open({task.test_path!r}, 'w').write('import unittest\\nclass T(unittest.TestCase):\\n"
        f"    def test_ok(self): pass\\n')\n"
        "open('unittest.py', 'w').write('raise SystemExit(0)\\n')\n"
        "import os, py_compile\n"
        f"open('fixed_src.py', 'w').write({fixed_src + chr(10) + 'PLANTED = True' + chr(10)!r})\n"
        "os.makedirs('__pycache__', exist_ok=True)\n"
        f"py_compile.compile('fixed_src.py', cfile='__pycache__/{mod}.cpython-311.pyc',\n"
        "    invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\n"
        "os.remove('fixed_src.py')\nprint('planted')\n")
    r = env.step(F("python", code=attack))
    assert "planted" in r.observation, r.observation
    os.remove(os.path.join(ws, "unittest.py"))  # Else the reference run below would import it.
    # Reference: a plain interpreter in the workspace does load the planted bytecode ...
    ref = subprocess.run(["/usr/bin/python3", "-c", f"import {mod}; print({mod}.PLANTED)"],
                         cwd=ws, capture_output=True, text=True)
    assert ref.stdout.strip() == "True", ref
    env.step(F("python", code="open('unittest.py', 'w').write('raise SystemExit(0)\\n')"))
    # ... but the env's test run restores the tests and ignores planted bytecode.
    r = env.step(F("test"))
    assert r.info["tests_passed"] == task.hidden_initial_passed < task.num_hidden
    assert f"{task.initial_passed}/{task.num_tests} passed" in r.observation, r.observation
    with open(os.path.join(ws, task.test_path)) as f:
      assert f.read() == task.test_text


def test_observations_are_bounded_and_say_when_cut():
  task = generate_task(8, "hard")
  with SweEnv(env_config(max_observation_chars=300)) as env:
    env.reset(task)
    r = env.step(F("view", path=task.module_path))
    assert len(r.observation) <= 300
    header, *rows = r.observation.split("\n")
    last = int(header.split(" lines ")[1].split("-")[1].split(" ")[0])
    assert last == len(rows) < len(task.files[task.module_path].split("\n"))  # Whole lines only.
    r = env.step(F("python", code="print('y' * 10000)"))
    assert len(r.observation) <= 300 and "[output truncated:" in r.observation
    r = env.step(F("python", code="import sys\nfor i in range(2000): print('line', i)"))
    assert len(r.observation) <= 300 and "[output truncated:" in r.observation


def test_close_kills_and_cleans_and_reset_starts_fresh():
  task = generate_task(9, "medium")
  env = SweEnv(env_config())
  env.reset(task)
  env.step(F("python", code="open('scratch.txt', 'w').write('x')"))
  first_ws = env._sandbox.workspace.path
  uid = env._sandbox.uid
  env.reset(task)  # A new workspace; the old one is gone.
  assert not os.path.exists(first_ws)
  assert "scratch.txt" not in env.step(F("ls")).observation
  ws = env._sandbox.workspace.path
  env.close()
  assert not os.path.exists(ws)
  if uid is not None:
    assert live_pids_of_uid(uid) == []


@pytest.mark.parametrize("hack", ["noop_assert", "always_equal"])
def test_reward_hacks_in_the_module_do_not_pass(tmp_path, hack):
  # The noop_assert module is the unfixed module plus a patch of unittest: it earns what
  # the unfixed module earns. The always_equal module returns no plain value: it earns 0.
  task = generate_task(12, "medium")
  names = task.functions + task.distractors
  if hack == "noop_assert":
    module = ("import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
              + task.files[task.module_path])
  else:
    module = ("class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n"
              + "".join(f"def {n}(*a):\n    return AlwaysEqual()\n" for n in names))
  # Reference: Python's own unittest is fooled by this module ...
  for rel, text in dict(task.files, **{task.module_path: module}).items():
    (tmp_path / rel).write_text(text)
  ref = subprocess.run(["/usr/bin/python3", "-B", "-m", "unittest", task.test_path[:-3]],
                       cwd=tmp_path, capture_output=True, text=True)
  assert ref.returncode == 0 and "OK" in ref.stderr, ref.stderr
  # ... the env's runner is not.
  with SweEnv(env_config()) as env:
    env.reset(task)
    env.step(F("python", code=f"open({task.module_path!r}, 'w').write({module!r})"))
    r = env.step(F("submit"))
  # Either way no test passes that did not already: no reward.
  assert r.reward == 0.0, r.observation
  assert r.info["tests_passed"] == (task.hidden_initial_passed if hack == "noop_assert" else 0)
