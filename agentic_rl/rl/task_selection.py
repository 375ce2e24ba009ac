"""Which tasks are worth training: pass rates, priorities, a held-out split and its evaluation.

A task that always passes or always fails gives every sample of its group the
same reward, so a group baseline gives it zero advantage: its sampling budget
teaches nothing. The pieces here (host-side, numpy):

  PassRateTracker   per-task pass rate over the last `window` outcomes, shrunk
                    toward a prior for tasks seen few times.
  task_weights      sampling weights from pass rates: 'uniform', 'middling'
                    (4 p (1 - p), highest at p = 0.5, the Bernoulli variance) or
                    'band' (1 inside [band_low, band_high]); never below `floor`.
  split_heldout     a deterministic train / held-out split by hashing task ids.
  TaskSelector      draws training tasks by weight, records outcomes.
  evaluate_heldout  pass rate and mean reward on the held-out tasks, which never
                    feed the tracker.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

from agentic_rl.rl.config import PRIORITIES, RLSpec


class PassRateTracker:
  """Per-task pass rates: (passes + prior * weight) / (attempts + weight), last `window` only."""

  def __init__(self, *, window: int = 64, pass_threshold: float = 1.0,
               prior_pass_rate: float = 0.5, prior_weight: float = 1.0):
    if window <= 0:
      raise ValueError(f"window={window}: expected a positive integer.")
    if not 0.0 <= prior_pass_rate <= 1.0:
      raise ValueError(f"prior_pass_rate={prior_pass_rate}: expected a number in [0, 1].")
    if prior_weight < 0:
      raise ValueError(f"prior_weight={prior_weight}: expected a number >= 0.")
    self.window = window
    self.pass_threshold = pass_threshold
    self.prior_pass_rate = prior_pass_rate
    self.prior_weight = prior_weight
    self._outcomes: dict[Hashable, collections.deque] = {}

  @classmethod
  def from_spec(cls, spec: RLSpec) -> "PassRateTracker":
    return cls(window=spec.window, pass_threshold=spec.pass_threshold,
               prior_pass_rate=spec.prior_pass_rate, prior_weight=spec.prior_weight)

  def update(self, task_ids: Iterable[Hashable], rewards: Iterable[float]) -> None:
    """Records one outcome per (task id, reward) pair."""
    task_ids, rewards = list(task_ids), [float(r) for r in rewards]
    if len(task_ids) != len(rewards):
      raise ValueError(f"update got {len(task_ids)} task ids and {len(rewards)} rewards.")
    for task, reward in zip(task_ids, rewards):
      if not np.isfinite(reward):
        raise ValueError(f"task {task!r}: reward {reward} is not finite.")
      queue = self._outcomes.setdefault(task, collections.deque(maxlen=self.window))
      queue.append(reward >= self.pass_threshold)

  def attempts(self, task: Hashable) -> int:
    return len(self._outcomes.get(task, ()))

  def pass_rate(self, task: Hashable) -> float:
    outcomes = self._outcomes.get(task, ())
    n = len(outcomes)
    den = n + self.prior_weight
    if den == 0:
      return self.prior_pass_rate
    return (sum(outcomes) + self.prior_pass_rate * self.prior_weight) / den

  def pass_rates(self, tasks: Sequence[Hashable]) -> np.ndarray:
    return np.array([self.pass_rate(t) for t in tasks], np.float64)

  def state_dict(self) -> dict:
    """Plain data for checkpointing: task -> list of pass/fail, oldest first."""
    return {"outcomes": {t: [bool(x) for x in q] for t, q in self._outcomes.items()}}

  def load_state_dict(self, state: dict) -> None:
    self._outcomes = {t: collections.deque(v, maxlen=self.window)
                      for t, v in state["outcomes"].items()}


def task_weights(pass_rates: np.ndarray, mode: str = "middling", *, band_low: float = 0.2,
                 band_high: float = 0.8, floor: float = 0.02) -> np.ndarray:
  """Unnormalised sampling weight per task (see module doc)."""
  p = np.asarray(pass_rates, np.float64)
  if mode == "uniform":
    w = np.ones_like(p)
  elif mode == "middling":
    w = 4.0 * p * (1.0 - p)
  elif mode == "band":
    w = ((p >= band_low) & (p <= band_high)).astype(np.float64)
  else:
    raise ValueError(f"priority mode {mode!r}: expected one of {PRIORITIES}.")
  return np.maximum(w, floor)


def _unit_hash(task: Hashable, seed: int) -> float:
  digest = hashlib.blake2b(f"{seed}:{task!r}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0 ** 64


def split_heldout(task_ids: Sequence[Hashable], fraction: float, seed: int = 0
                  ) -> tuple[list, list]:
  """(train, heldout): each task is held out iff hash(seed, task) < fraction.

  Deterministic per task, so adding tasks never moves an existing one across the split.
  """
  if not 0.0 <= fraction < 1.0:
    raise ValueError(f"heldout fraction={fraction}: expected a number in [0, 1).")
  if len(set(task_ids)) != len(task_ids):
    raise ValueError("split_heldout: task ids must be unique.")
  train, heldout = [], []
  for task in task_ids:
    (heldout if _unit_hash(task, seed) < fraction else train).append(task)
  return train, heldout


class TaskSelector:
  """Draws training tasks by priority and learns their pass rates from outcomes."""

  def __init__(self, task_ids: Sequence[Hashable], spec: RLSpec, *, seed: int = 0):
    self.spec = spec
    self.train_tasks, self.heldout_tasks = split_heldout(list(task_ids), spec.heldout_fraction,
                                                         spec.heldout_seed)
    if not self.train_tasks:
      raise ValueError(f"no training task left after holding out "
                       f"{spec.heldout_fraction:.0%} of {len(task_ids)} tasks.")
    self._heldout = set(self.heldout_tasks)
    self.tracker = PassRateTracker.from_spec(spec)
    self._rng = np.random.default_rng(seed)

  def weights(self) -> np.ndarray:
    s = self.spec
    return task_weights(self.tracker.pass_rates(self.train_tasks), s.priority,
                        band_low=s.band_low, band_high=s.band_high, floor=s.priority_floor)

  def sample(self, n: int) -> list:
    """n training tasks drawn by weight, without replacement while tasks last."""
    w = self.weights()
    if w.sum() <= 0:  # priority_floor = 0 and no task in the band: fall back to uniform
      w = np.ones_like(w)
    probs = w / w.sum()
    picks = []
    while len(picks) < n:
      k = min(n - len(picks), int(np.count_nonzero(probs)))
      idx = self._rng.choice(len(self.train_tasks), size=k, replace=False, p=probs)
      picks.extend(self.train_tasks[i] for i in idx)
    return picks

  def record(self, task_ids: Iterable[Hashable], rewards: Iterable[float]) -> None:
    task_ids, rewards = list(task_ids), list(rewards)
    leaked = [t for t in task_ids if t in self._heldout]
    if leaked:
      raise ValueError(f"held-out tasks {leaked[:3]} must not be trained on or tracked.")
    self.tracker.update(task_ids, rewards)


def evaluate_heldout(run_task: Callable[[Hashable, int], Sequence[float]],
                     heldout_tasks: Sequence[Hashable], *, samples_per_task: int,
                     pass_threshold: float) -> dict:
  """Runs `run_task(task, n) -> n rewards` on every held-out task.

  Returns mean_reward, pass_rate (fraction of samples passing), solved_frac
  (tasks with at least one pass, pass@n), num_tasks and per-task pass rates.
  """
  if not heldout_tasks:
    raise ValueError("evaluate_heldout: no held-out task (task_selection.heldout_fraction=0?).")
  per_task, all_rewards, solved = {}, [], 0
  for task in heldout_tasks:
    rewards = np.asarray(run_task(task, samples_per_task), np.float64)
    if rewards.shape != (samples_per_task,):
      raise ValueError(f"run_task({task!r}, {samples_per_task}) returned shape "
                       f"{rewards.shape}; expected ({samples_per_task},).")
    passed = rewards >= pass_threshold
    per_task[task] = float(passed.mean())
    solved += bool(passed.any())
    all_rewards.append(rewards)
  rewards = np.concatenate(all_rewards)
  return {"mean_reward": float(rewards.mean()),
          "pass_rate": float((rewards >= pass_threshold).mean()),
          "solved_frac": solved / len(heldout_tasks), "num_tasks": len(heldout_tasks),
          "per_task_pass_rate": per_task}
