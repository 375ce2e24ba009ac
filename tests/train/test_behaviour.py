"""train/behaviour.py on hand-built episodes: edits, retries, and how failures end."""

import math
import types

import numpy as np
import pytest

from agentic_rl.train import behaviour


def _episode(tools, reward, end_reason):
  infos = [None]  # The prompt turn has no tool call.
  for tool in tools:
    name, _, decision = tool.partition(":")
    infos.append({"tool": name, "decision": decision or "allowed"})
  return types.SimpleNamespace(tool_infos=infos, reward=reward, end_reason=end_reason)


EPISODES = [
    # One edit, solved.
    _episode(["ls", "test", "replace", "test", "submit"], 1.0, "submit"),
    # Edit, test, edit: a retry, solved.
    _episode(["test", "replace", "test", "replace", "test", "submit"], 1.0, "submit"),
    # Two edits with no test between: not a retry; a wrong submit.
    _episode(["replace", "replace", "submit"], 0.5, "submit"),
    # A test before any edit does not make the later edit a retry; a denied edit is no
    # edit; out of turns.
    _episode(["test", "replace", "replace:denied", "test"], 0.0, "turn_budget"),
    # A retry that fails: edit, test, edit, then out of turns.
    _episode(["replace", "test", "replace"], 0.0, "turn_budget"),
]


def test_counts_by_hand():
  got = [behaviour.episode_counts(e) for e in EPISODES]
  assert [g["multi_edit"] for g in got] == [0, 1, 1, 0, 1]
  assert [g["retried"] for g in got] == [0, 1, 0, 0, 1]
  assert [g["solved"] for g in got] == [1, 1, 0, 0, 0]
  assert [g["wrong_submits"] for g in got] == [0, 0, 1, 0, 0]
  assert [g["out_of_turns"] for g in got] == [0, 0, 0, 1, 1]
  counts = behaviour.count_vector(EPISODES)
  scores = behaviour.behaviour_scores(counts)
  assert scores["heldout/multi_edit_share"] == pytest.approx(3 / 5)
  assert scores["heldout/retried_share"] == pytest.approx(2 / 5)
  assert scores["heldout/retry_success_rate"] == pytest.approx(1 / 2)
  assert scores["heldout/solved_with_retry_share"] == pytest.approx(1 / 2)
  assert scores["heldout/wrong_submit_share"] == pytest.approx(1 / 5)
  assert scores["heldout/out_of_turns_share"] == pytest.approx(2 / 5)
  assert scores["heldout/wrong_submits"] == 1 and scores["heldout/out_of_turns"] == 2


def test_no_retry_leaves_its_rates_undefined_not_zero():
  scores = behaviour.behaviour_scores(behaviour.count_vector(EPISODES[:1]))
  assert scores["heldout/retry_success_rate"] is None
  assert scores["heldout/solved_with_retry_share"] == 0.0


def test_share_change_interval_by_hand():
  before = {"heldout/retried_solved": 5, "heldout/solved": 100}
  after = {"heldout/retried_solved": 30, "heldout/solved": 120}
  change = behaviour.share_change(before, after, "retried_solved", "solved")
  p0, p1 = 0.05, 0.25
  se = math.sqrt(p0 * 0.95 / 100 + p1 * 0.75 / 120)
  assert change["change"] == pytest.approx(0.20)
  np.testing.assert_allclose(change["ci95"], [0.20 - 1.959964 * se, 0.20 + 1.959964 * se])
  assert behaviour.share_change({}, after, "retried_solved", "solved") is None
