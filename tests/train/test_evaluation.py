"""Held-out scoring: the solved matrix, pass@1 / pass@k, the unbiased pass@k curve
against a brute-force average over every k-subset of the samples, and the per-task
standard errors of pass@1 and of a paired before/after gain."""

import itertools

import numpy as np
import pytest

from agentic_rl.train.evaluation import (episode_rates, heldout_scores, heldout_solved_matrix,
                                         paired_gain, pass1_stderr, pass_at_k, pass_at_k_curve)


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


def test_pass1_stderr_hand_computed():
  # Per-task means 1/2, 0, 1: mean 1/2, sample variance ((0)^2 + (1/2)^2 + (1/2)^2) / 2
  # = 1/4, so stderr = sqrt(1/4) / sqrt(3) = 1 / (2 sqrt 3).
  solved = np.array([[0, 1], [0, 0], [1, 1]], np.float32)
  assert pass1_stderr(solved) == pytest.approx(1 / (2 * np.sqrt(3)))
  assert pass1_stderr(solved) == pytest.approx(solved.mean(1).std(ddof=1) / np.sqrt(3))


def test_pass1_stderr_counts_tasks_not_episodes():
  # Every task either always or never solved: 8 tasks x 16 samples are only 8 independent
  # draws, so the error is the 8-task one, far above the 128-episode binomial error.
  solved = np.repeat(np.array([1, 0, 1, 1, 0, 0, 1, 0], np.float32)[:, None], 16, axis=1)
  per_task = np.sqrt(0.5 * 0.5 * 8 / 7 / 8)  # std(ddof=1) / sqrt(8) of four 1s, four 0s
  assert pass1_stderr(solved) == pytest.approx(per_task)
  assert pass1_stderr(solved) > 3 * np.sqrt(0.5 * 0.5 / solved.size)


def test_pass1_stderr_edge_cases():
  assert pass1_stderr(np.array([[1, 0, 1]], np.float32)) == 0.0  # one task: no spread
  assert pass1_stderr(np.ones((4, 3), np.float32)) == 0.0
  with pytest.raises(ValueError, match=r"\[num_tasks, samples\] matrix"):
    pass1_stderr(np.ones(3))
  with pytest.raises(ValueError, match=r"\[num_tasks, samples\] matrix"):
    pass1_stderr(np.zeros((0, 2)))


def test_paired_gain_hand_computed():
  # 3 tasks; before has 2 samples per task, after has 4 (sample counts may differ).
  before = np.array([[0, 1], [0, 0], [1, 1]], np.float32)          # means 1/2, 0, 1
  after = np.array([[1, 1, 1, 0], [0, 1, 0, 0], [1, 1, 1, 1]], np.float32)  # 3/4, 1/4, 1
  # Per-task differences 1/4, 1/4, 0: gain 1/6, sample variance
  # ((1/12)^2 + (1/12)^2 + (1/6)^2) / 2 = 1/48, stderr = sqrt(1/48) / sqrt(3) = 1/12.
  result = paired_gain(before, after)
  assert result["gain"] == pytest.approx(after.mean() - before.mean())
  assert result["gain"] == pytest.approx(1 / 6)
  assert result["stderr"] == pytest.approx(1 / 12)
  assert result["ci95_low"] == pytest.approx(1 / 6 - 1.959964 / 12)
  assert result["ci95_high"] == pytest.approx(1 / 6 + 1.959964 / 12)
  assert result["num_tasks"] == 3
  assert set(result) == {"gain", "stderr", "ci95_low", "ci95_high", "num_tasks"}


def test_paired_gain_matches_numpy_and_beats_unpaired_when_correlated():
  # Task difficulty dominates both scores, so before and after are strongly correlated
  # per task and pairing cancels most of the variance.
  rng = np.random.default_rng(0)
  difficulty_b = rng.random(40)
  before = (rng.random((40, 8)) < difficulty_b[:, None]).astype(np.float32)
  after = (rng.random((40, 6)) < np.clip(difficulty_b + 0.1, 0, 1)[:, None]).astype(np.float32)
  result = paired_gain(before, after)
  diff = after.mean(1) - before.mean(1)
  assert result["gain"] == pytest.approx(after.mean() - before.mean())
  assert result["stderr"] == pytest.approx(diff.std(ddof=1) / np.sqrt(40))
  assert np.corrcoef(before.mean(1), after.mean(1))[0, 1] > 0.6
  unpaired = np.hypot(pass1_stderr(before), pass1_stderr(after))
  assert result["stderr"] < 0.6 * unpaired


def test_paired_gain_one_task_and_no_change():
  one = paired_gain(np.array([[0, 1]]), np.array([[1, 1, 1]]))
  assert one["gain"] == pytest.approx(0.5)
  assert one["stderr"] == 0.0 and one["ci95_low"] == one["ci95_high"] == pytest.approx(0.5)
  same = np.array([[0, 1], [1, 1]], np.float32)
  assert paired_gain(same, same) == {"gain": 0.0, "stderr": 0.0, "ci95_low": 0.0,
                                     "ci95_high": 0.0, "num_tasks": 2}


def test_paired_gain_rejects_different_task_counts():
  with pytest.raises(ValueError, match="3 tasks before and 2 after"):
    paired_gain(np.ones((3, 4)), np.ones((2, 4)))
  with pytest.raises(ValueError, match="after_bk must be a non-empty"):
    paired_gain(np.ones((3, 4)), np.ones(3))
