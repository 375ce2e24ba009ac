"""Held-out scores from sampled episodes: pass@1, pass@k and the pass@k curve.

A task is solved by an episode when every test passes at submit (reward 1). With n
samples of a task of which c solve it, the unbiased pass@k estimate is
1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained
on Code"), averaged over tasks; at k = n it is "any sample solved it".

pass@n - pass@1 bounds what sharpening alone can win: RL that only moves probability
onto answers the policy already samples lifts pass@1 at most to pass@n.
"""

from __future__ import annotations

import math

import numpy as np

SOLVED_REWARD = 1.0 - 1e-9  # Solved = every test passes at submit.


def episode_rates(prefix: str, rewards_n: np.ndarray) -> dict:
  """Mean reward, solve rate and episode count of a set of episodes' rewards."""
  rewards_n = np.asarray(rewards_n, np.float64)
  return {f"{prefix}/reward_mean": float(rewards_n.mean()),
          f"{prefix}/solve_rate": float(np.mean(rewards_n >= SOLVED_REWARD)),
          f"{prefix}/episodes": int(rewards_n.size)}


def heldout_solved_matrix(task_index_n, rewards_n, num_tasks: int, samples: int) -> np.ndarray:
  """[num_tasks, samples] of 1.0 where that sample of that task solved it (reward >= 1)."""
  solved_bk = np.zeros((num_tasks, samples), np.float32)
  filled = np.zeros(num_tasks, np.int64)
  for task, reward in zip(task_index_n, rewards_n):
    if filled[task] >= samples:
      raise ValueError(f"held-out task {task} has more than {samples} samples")
    solved_bk[task, filled[task]] = float(reward >= SOLVED_REWARD)
    filled[task] += 1
  if (filled != samples).any():
    raise ValueError(f"held-out evaluation expected {samples} samples per task, got "
                     f"{filled.tolist()}")
  return solved_bk


def heldout_scores(solved_bk: np.ndarray) -> dict:
  """pass@1 (mean over samples) and pass@k (any of the k samples) over tasks."""
  k = solved_bk.shape[1]
  return {"heldout/solve_rate": float(solved_bk.mean()),
          "heldout/pass_at_k": float(solved_bk.max(axis=1).mean()),
          "heldout/samples_per_task": int(k)}


def pass_at_k(solves_b: np.ndarray, samples: int, k: int) -> float:
  """Unbiased pass@k averaged over tasks, from each task's solve count out of `samples`."""
  solves_b = np.asarray(solves_b, np.int64)
  if not 1 <= k <= samples:
    raise ValueError(f"pass@k needs 1 <= k <= samples; got k={k}, samples={samples}")
  if solves_b.size == 0 or solves_b.min() < 0 or solves_b.max() > samples:
    raise ValueError(f"solve counts must lie in [0, {samples}]; got {solves_b.tolist()}")
  total = math.comb(samples, k)
  return float(np.mean([1.0 - math.comb(samples - int(c), k) / total for c in solves_b]))


def pass_at_k_curve(solved_bk: np.ndarray) -> dict[int, float]:
  """{k: pass@k} for k = 1, 2, 4, ... below the sample count, and the sample count."""
  samples = solved_bk.shape[1]
  ks = sorted({2 ** i for i in range(samples.bit_length()) if 2 ** i < samples} | {samples})
  solves_b = solved_bk.sum(axis=1).round().astype(np.int64)
  return {k: pass_at_k(solves_b, samples, k) for k in ks}
