"""Held-out scoring: the solved matrix, pass@1 / pass@k, and the unbiased pass@k curve
against a brute-force average over every k-subset of the samples."""

import itertools

import numpy as np
import pytest

from agentic_rl.train.evaluation import (episode_rates, heldout_scores, heldout_solved_matrix, pass_at_k,
                                         pass_at_k_curve)


def test_heldout_scores_hand_computed():
  # 3 tasks x 2 samples, trajectories in any order: task 0 solved once, task 1 never,
  # task 2 twice (a reward just under 1 is a partial pass, not a solve).
  solved = heldout_solved_matrix([2, 0, 1, 0, 2, 1], [1.0, 0.5, 0.0, 1.0, 1.0, 0.999],
                                 num_tasks=3, samples=2)
  np.testing.assert_array_equal(solved, [[0, 1], [0, 0], [1, 1]])
  scores = heldout_scores(solved)
  assert scores["heldout/solve_rate"] == pytest.approx(3 / 6)
  assert scores["heldout/pass_at_k"] == pytest.approx(2 / 3)
  assert scores["heldout/samples_per_task"] == 2


def test_heldout_solved_matrix_rejects_a_wrong_sample_count():
  with pytest.raises(ValueError, match="expected 2 samples per task"):
    heldout_solved_matrix([0, 0, 1], [1.0, 1.0, 1.0], num_tasks=2, samples=2)
  with pytest.raises(ValueError, match="more than 1 samples"):
    heldout_solved_matrix([0, 0], [1.0, 0.0], num_tasks=1, samples=1)


def _brute_force_pass_at_k(solved_bn: np.ndarray, k: int) -> float:
  """Mean over tasks of the fraction of k-subsets of the samples holding a solve."""
  n = solved_bn.shape[1]
  per_task = [np.mean([row[list(sub)].max() for sub in itertools.combinations(range(n), k)])
              for row in solved_bn]
  return float(np.mean(per_task))


def test_pass_at_k_matches_every_subset_average():
  rng = np.random.default_rng(0)
  solved_bn = (rng.random((7, 6)) < rng.random((7, 1))).astype(np.float32)
  solved_bn[0] = 0  # never solved
  solved_bn[1] = 1  # always solved
  counts = solved_bn.sum(axis=1).astype(int)
  for k in range(1, 7):
    assert pass_at_k(counts, 6, k) == pytest.approx(_brute_force_pass_at_k(solved_bn, k))
  assert pass_at_k(counts, 6, 1) == pytest.approx(solved_bn.mean())
  assert pass_at_k(counts, 6, 6) == pytest.approx(solved_bn.max(axis=1).mean())


def test_pass_at_k_hand_computed():
  # 4 samples, 1 solve: pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6.
  assert pass_at_k([1], 4, 2) == pytest.approx(0.5)
  assert pass_at_k([1, 4], 4, 2) == pytest.approx(0.75)


def test_pass_at_k_curve_keys_and_monotone():
  rng = np.random.default_rng(1)
  solved = (rng.random((5, 6)) < 0.4).astype(np.float32)
  curve = pass_at_k_curve(solved)
  assert list(curve) == [1, 2, 4, 6]
  values = list(curve.values())
  assert values == sorted(values)
  assert curve[6] == pytest.approx(solved.max(axis=1).mean())
  assert list(pass_at_k_curve(np.ones((2, 1), np.float32))) == [1]


def test_pass_at_k_rejects_bad_input():
  with pytest.raises(ValueError, match="1 <= k <= samples"):
    pass_at_k([1], 4, 5)
  with pytest.raises(ValueError, match=r"solve counts must lie in \[0, 4\]"):
    pass_at_k([5], 4, 1)


def test_episode_rates_hand_computed():
  rates = episode_rates("rollout", [1.0, 0.5, 0.0, 1.0, 0.999])
  assert rates == {"rollout/reward_mean": pytest.approx(3.499 / 5),
                   "rollout/solve_rate": pytest.approx(2 / 5), "rollout/episodes": 5}
