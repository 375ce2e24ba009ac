"""The one held-out scorer: the run's periodic evaluation, launch.evaluate,
launch.export_base and launch.rescore_base all call `Evaluator.score`.

Scores are keyed `heldout/*`. Two scores compare only when their settings
(SETTING_KEYS: tasks, samples per task, temperature) agree.
"""

from __future__ import annotations

import time

import numpy as np

from agentic_rl.train import behaviour
from agentic_rl.train import distributed
from agentic_rl.train.evaluation import (heldout_scores, heldout_solved_matrix, pass1_stderr,
                                         pass_at_k_curve)

# What a held-out score depends on besides the params; scores agree only when these do.
SETTING_KEYS = ("heldout/num_tasks", "heldout/samples_per_task", "heldout/temperature")


class Evaluator:

  def __init__(self, train_spec, heldout_source, info: distributed.ProcessInfo):
    self.train_spec = train_spec
    self.heldout_source = heldout_source
    self.info = info

  def settings(self) -> dict:
    tc = self.train_spec
    return dict(zip(SETTING_KEYS, (int(tc.eval_tasks), int(tc.eval_samples),
                                   float(tc.eval_temperature))))

  def same_settings(self, scores: dict | None) -> bool:
    return all((scores or {}).get(k) == v for k, v in self.settings().items())

  def score(self, route, params) -> dict:
    """Held-out scores of `params` (on the run's mesh) with `route`'s eval engine: pass@1 and
    its stderr (tasks as the unit), any-of-k, the unbiased pass@k curve, the sharpening
    headroom pass@n - pass@1, and each task's solves (for paired gains)."""
    t0 = time.time()
    num_tasks = int(self.train_spec.eval_tasks)
    indices = list(distributed.shard_indices(num_tasks, self.info))
    route.eval_engine.set_params(route.sampler_params(params), 0)
    trajs = route.eval_engine.run([self.heldout_source[i] for i in indices],
                                  task_seeds=indices)
    rewards = np.asarray([t.reward for t in trajs], np.float32)
    solved_bk = heldout_solved_matrix([t.group_id for t in trajs], rewards, len(indices),
                                      route.eval_spec.group_size)
    samples = solved_bk.shape[1]
    # Rows come back in process order; each process holds every num_processes-th task.
    solved_bk = distributed.all_gather(self.info, solved_bk.reshape(-1)).reshape(-1, samples)
    rewards = distributed.all_gather(self.info, rewards)
    counts = distributed.all_gather(self.info, behaviour.count_vector(trajs))
    curve = pass_at_k_curve(solved_bk)
    return {**self.settings(),
            **heldout_scores(solved_bk),  # solve_rate, pass_at_k (any of k), samples
            "heldout/solve_stderr": pass1_stderr(solved_bk),
            "heldout/solves_per_task": solved_bk.sum(axis=1).round().astype(int).tolist(),
            "heldout/pass_at_k_curve": {str(k): v for k, v in curve.items()},
            "heldout/sharpening_headroom": curve[samples] - curve[1],
            "heldout/mean_reward": float(np.mean(rewards)),
            "heldout/episodes": int(rewards.size),
            # Edits, retries and how episodes ended (train/behaviour.py).
            **behaviour.behaviour_scores(counts.reshape(-1, len(behaviour.COUNTS)).sum(0)),
            "heldout/seconds": time.time() - t0}


def scalar_metrics(scores: dict, prefix: str = "heldout/") -> dict:
  """The numbers of a score, keys re-prefixed (what goes to TensorBoard)."""
  return {prefix + k.split("/", 1)[1]: v for k, v in scores.items()
          if not isinstance(v, (list, dict))}
