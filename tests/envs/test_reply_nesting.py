"""A reply nested 100,000 deep: the decoder's contract stays total.

Before, json.loads raised RecursionError, which the grader did not catch: every call
logged a traceback, `submit` could not end the episode, a `replace` was applied but
reported as failed, and the test count went stale. Now such a reply fails the run with
an observation saying why, and costs time linear in its size.
"""

import json
import time

import pytest

from agentic_rl.envs import grading
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config
from tests.envs.forged_reply import forging_lines

TASK = generate_task(4, "easy")


# Within an honest reply's size (so nesting, not size, is what refuses them).
@pytest.mark.parametrize("deep", ["[" * 10_000, "[" * 5_000 + "]" * 5_000,
                                  '{"outcomes": ' + "{" * 10_000, '{"a": ' * 1_000 + "1"])
def test_a_deep_reply_is_malformed_not_an_exception(deep):
  t0 = time.process_time()
  with pytest.raises(grading.MalformedReply, match="nested deeper"):
    grading.parse_reply(TASK, TASK.hidden_cases, deep)
  assert time.process_time() - t0 < 0.1


def test_a_reply_nested_100_000_deep_is_refused_at_a_glance():
  t0 = time.process_time()
  with pytest.raises(grading.MalformedReply, match="honest"):
    grading.parse_reply(TASK, TASK.hidden_cases, "[" * 100_000)
  assert time.process_time() - t0 < 0.1


def test_a_deep_value_fails_only_its_case():
  deep = ["N"]
  for _ in range(40):  # Deeper than any value encode_plain writes.
    deep = ["L", [deep]]
  n = len(TASK.cases)
  outcomes = [{"status": "value", "value": deep}] + [{"status": "error", "error": "E"}] * (n - 1)
  report = grading.parse_reply(TASK, TASK.cases,
                               json.dumps({"import_error": None, "outcomes": outcomes}))
  assert report.results[0].status == "error" and "nested deeper" in report.results[0].error


def test_a_module_that_forges_a_deep_reply_is_graded_as_a_failed_run(isolation):
  forged = forging_lines('b"[" * 10_000')  # Deep enough for RecursionError, small enough to read.
  bug = TASK.bugs[0]
  with SweEnv(env_config(isolation, timeout_s=5.0)) as env:
    env.reset(TASK)
    fixed = env.step(F("replace", path=TASK.module_path, start=bug.line, end=bug.line,
                       text=bug.correct_line))
    assert fixed.info["tests_passed"] == TASK.num_hidden
    # The edit is applied and reported as applied; its hidden run measured 0, not stale.
    edited = env.step(F("replace", path=TASK.module_path, start=1, end=0,
                        text="\n".join(forged)))
    assert edited.observation.startswith(f"{TASK.module_path}: inserted"), edited.observation
    assert edited.info["decision"] == "allowed" and edited.info["tests_passed"] == 0
    assert "unreadable" in edited.info["reason"]
    tested = env.step(F("test"))
    assert "its reply was unreadable" in tested.observation, tested.observation
    assert f"0/{TASK.num_tests} passed" in tested.observation
    assert tested.info["tests_passed"] == 0
    # submit ends the episode, and pays nothing.
    submitted = env.step(F("submit"))
  assert submitted.done and submitted.info["end_reason"] == "submit"
  assert submitted.reward == 0.0
  assert "unreadable" in submitted.observation
