"""The loop's task stream and train solve-rate stderr, against hand-made expectations."""

import numpy as np
import pytest

from agentic_rl.train.loop import _solve_stderr_by_task, _TaskStream


def test_stream_is_a_seeded_permutation_per_tier_read_by_position():
  sources = {"tiny": range(10), "easy": range(7)}
  a, b = _TaskStream(sources, seed=3), _TaskStream(sources, seed=3)
  first = [a("tiny") for _ in range(10)]
  assert sorted(int(t.split("/")[1]) for t in first) == list(range(10))  # a permutation
  assert [b("tiny") for _ in range(10)] == first  # every process sees the same order
  assert a("tiny") == first[0]  # then it repeats
  assert a("easy").startswith("easy/") and a.position == {"tiny": 11, "easy": 1}
  resumed = _TaskStream(sources, seed=3)
  resumed.position.update(a.position)
  assert resumed("tiny") == first[1]


def test_solve_stderr_counts_tasks_not_episodes():
  # Tasks 1 and 2, two episodes each: per-task solve rates 1.0 and 0.0.
  tasks, rewards = np.asarray([1, 1, 2, 2]), np.asarray([1.0, 1.0, 0.5, 0.0])
  assert _solve_stderr_by_task(tasks, rewards) == pytest.approx(
      np.std([1.0, 0.0], ddof=1) / 2 ** 0.5)
  assert _solve_stderr_by_task(np.asarray([5, 5]), np.asarray([1.0, 0.0])) == 0.0
