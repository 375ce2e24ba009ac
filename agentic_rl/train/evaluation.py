"""Held-out scores from sampled episodes: pass@1, pass@k and the pass@k curve.

A task is solved by an episode when every test passes at submit (reward 1). With n
samples of a task of which c solve it, the unbiased pass@k estimate is
1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained
on Code"), averaged over tasks; at k = n it is "any sample solved it".

pass@n - pass@1 bounds what sharpening alone can win: RL that only moves probability
onto answers the policy already samples lifts pass@1 at most to pass@n.

Error bars treat the task as the independent unit: the samples of one task share its
difficulty, so they are correlated and counting episodes would understate the error.
A before/after comparison on the same tasks is paired per task, which cancels the
task-difficulty variance that both scores share.
"""

from __future__ import annotations

import math

import numpy as np

from agentic_rl.envs.env import SOLVED_REWARD

Z95 = 1.959964  # Two-sided 95% normal quantile.


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


def _per_task_means(name: str, solved_bk) -> np.ndarray:
  """Each task's mean over its samples, from a [num_tasks, samples] matrix."""
  solved_bk = np.asarray(solved_bk, np.float64)
  if solved_bk.ndim != 2 or solved_bk.shape[0] == 0 or solved_bk.shape[1] == 0:
    raise ValueError(f"{name} must be a non-empty [num_tasks, samples] matrix; "
                     f"got shape {solved_bk.shape}")
  return solved_bk.mean(axis=1)


def _stderr_of_mean(values_b: np.ndarray) -> float:
  """Standard error of the mean of independent values (ddof=1); 0.0 for one value."""
  if values_b.size < 2:
    return 0.0  # One task gives no spread to estimate; report no error bar, not NaN.
  return float(values_b.std(ddof=1) / math.sqrt(values_b.size))


def pass1_stderr(solved_bk) -> float:
  """Standard error of pass@1 (= solved_bk.mean()) over [num_tasks, samples] solves.

  Tasks, not episodes, are the independent unit: the samples of one task share its
  difficulty, so treating num_tasks * samples episodes as independent would shrink the
  error bar by up to sqrt(samples). This is the std over tasks of the per-task mean
  (ddof=1) over sqrt(num_tasks); 0.0 with one task.
  """
  return _stderr_of_mean(_per_task_means("solved_bk", solved_bk))


def paired_gain(before_bk, after_bk) -> dict:
  """Gain in pass@1 on the same held-out tasks scored before and after training.

  Row b of both matrices must be the same task; sample counts may differ. The stderr
  comes from the per-task differences of per-task means, so the variance in task
  difficulty that both scores share cancels (paired), and the 95% interval is
  gain +- 1.959964 stderr.
  """
  before_b = _per_task_means("before_bk", before_bk)
  after_b = _per_task_means("after_bk", after_bk)
  if before_b.size != after_b.size:
    raise ValueError(f"paired_gain needs the same held-out tasks before and after; got "
                     f"{before_b.size} tasks before and {after_b.size} after")
  diff_b = after_b - before_b
  # Equals after_bk.mean() - before_bk.mean(): each side has one sample count for all rows.
  gain = float(diff_b.mean())
  stderr = _stderr_of_mean(diff_b)
  return {"gain": gain, "stderr": stderr, "ci95_low": gain - Z95 * stderr,
          "ci95_high": gain + Z95 * stderr, "num_tasks": int(diff_b.size)}


def base_json_scores(scored: dict) -> dict:
  """A shipped base's base.json score fields from an Evaluator.score result
  (launch/export_base writes them, launch/rescore_base rewrites them)."""
  samples = scored["heldout/samples_per_task"]
  curve = scored["heldout/pass_at_k_curve"]
  return {"heldout_solve_rate_sft": curve["1"],
          "heldout_stderr_sft": scored["heldout/solve_stderr"],
          "heldout_pass_at_k_sft": curve[str(samples)],
          "heldout_pass_at_k_curve": curve,
          "heldout_episodes": scored["heldout/episodes"], "heldout_samples_per_task": samples,
          "heldout_mean_reward_sft": scored["heldout/mean_reward"]}
