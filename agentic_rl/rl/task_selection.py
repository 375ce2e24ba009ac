"""Which tasks are worth training: pass rates, priorities and the revisited task pool.

A task that always passes or always fails gives every sample of its group the
same reward, so a group baseline gives it zero advantage: its sampling budget
teaches nothing. The pieces here (host-side, numpy); the held-out split is the env's
(separate seeds), and a sample passes when it solves its task (envs.env.SOLVED_REWARD):

  PassRateTracker   per-task pass rate over the last `window` outcomes, shrunk
                    toward a prior for tasks seen few times.
  task_weights      sampling weights from pass rates: 'uniform', 'middling'
                    (4 p (1 - p), highest at p = 0.5, the Bernoulli variance) or
                    'band' (1 inside [band_low, band_high]); never below `floor`.
  FamilyPassRates   pass rate per task family (e.g. (tier, bug family)), pooled over
                    its tasks: the prior of a task seen few times.
  TaskPool          the training loop's selector over an endless task stream: a pool
                    of tasks revisited by priority until they retire, so pass rates
                    recur and priorities change what is sampled; optional curriculum
                    over tiers.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable, Sequence
from typing import Protocol

import numpy as np

from agentic_rl.envs.env import SOLVED_REWARD
from agentic_rl.rl.config import PRIORITIES, RLSpec


class PassRateTracker:
  """Per-task pass rates: (passes + prior * weight) / (attempts + weight), last `window` only."""

  def __init__(self, *, window: int = 64, prior_pass_rate: float = 0.5,
               prior_weight: float = 1.0):
    if window <= 0:
      raise ValueError(f"window={window}: expected a positive integer.")
    if not 0.0 <= prior_pass_rate <= 1.0:
      raise ValueError(f"prior_pass_rate={prior_pass_rate}: expected a number in [0, 1].")
    if prior_weight < 0:
      raise ValueError(f"prior_weight={prior_weight}: expected a number >= 0.")
    self.window = window
    self.prior_pass_rate = prior_pass_rate
    self.prior_weight = prior_weight
    self._outcomes: dict[Hashable, collections.deque] = {}

  @classmethod
  def from_spec(cls, spec: RLSpec) -> "PassRateTracker":
    ts = spec.task_selection
    return cls(window=ts.window, prior_pass_rate=ts.prior_pass_rate,
               prior_weight=ts.prior_weight)

  def update(self, task_ids: Iterable[Hashable], rewards: Iterable[float]) -> None:
    """Records one outcome per (task id, reward) pair."""
    task_ids, rewards = list(task_ids), [float(r) for r in rewards]
    if len(task_ids) != len(rewards):
      raise ValueError(f"update got {len(task_ids)} task ids and {len(rewards)} rewards.")
    for task, reward in zip(task_ids, rewards):
      if not np.isfinite(reward):
        raise ValueError(f"task {task!r}: reward {reward} is not finite.")
      queue = self._outcomes.setdefault(task, collections.deque(maxlen=self.window))
      queue.append(reward >= SOLVED_REWARD)

  def attempts(self, task: Hashable) -> int:
    return len(self._outcomes.get(task, ()))

  def outcomes(self, task: Hashable) -> tuple[bool, ...]:
    """The task's pass/fail outcomes in the window, oldest first."""
    return tuple(self._outcomes.get(task, ()))

  def forget(self, tasks: Iterable[Hashable]) -> None:
    """Drops tasks' outcomes (a retired task's statistics are not needed again)."""
    for task in tasks:
      self._outcomes.pop(task, None)

  def pass_rate(self, task: Hashable, prior: float | None = None) -> float:
    """`prior` replaces prior_pass_rate for this task (TaskPool gives its family's rate)."""
    prior = self.prior_pass_rate if prior is None else prior
    outcomes = self._outcomes.get(task, ())
    n = len(outcomes)
    den = n + self.prior_weight
    if den == 0:
      return prior
    return (sum(outcomes) + prior * self.prior_weight) / den

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


class FamilyPassRates:
  """Pass rate per task family, pooled over the outcomes of all the family's tasks.

  A family is whatever hashable the stream's `family(task)` gives, e.g. (tier, bug family).
  Its rate over the family's last `window` outcomes is shrunk toward
  `prior_pass_rate` as if the family had `prior_weight` more outcomes; it is the
  prior of the family's tasks, so a never-seen task starts from what its
  siblings did rather than from the global guess.
  """

  def __init__(self, *, window: int, prior_pass_rate: float, prior_weight: float):
    self._tracker = PassRateTracker(window=window, prior_pass_rate=prior_pass_rate,
                                    prior_weight=prior_weight)

  @staticmethod
  def key(family: Hashable) -> str:
    # Families may be tuples; checkpoints are JSON, whose keys must be strings.
    return repr(family)

  def update(self, families: Iterable[Hashable], rewards: Iterable[float]) -> None:
    self._tracker.update([self.key(f) for f in families], rewards)

  def attempts(self, family: Hashable) -> int:
    return self._tracker.attempts(self.key(family))

  def pass_rate(self, family: Hashable) -> float:
    return self._tracker.pass_rate(self.key(family))

  def state_dict(self) -> dict:
    return self._tracker.state_dict()

  def load_state_dict(self, state: dict) -> None:
    self._tracker.load_state_dict(state)


class TaskStream(Protocol):
  """Where the pool's tasks come from (agentic_rl/train/task_stream.py in the run)."""

  def next_task(self, tier: str | None) -> str:
    """A new task id of `tier`."""

  def family(self, task_id: str) -> Hashable:
    """The task's family: pass rates are pooled over it."""
_MAX_DUPLICATE_DRAWS = 10_000  # stream draws that may repeat pooled tasks before giving up


def _draw_without_replacement(rng: np.random.Generator, weights: np.ndarray, n: int
                              ) -> np.ndarray:
  """n distinct indices, probability proportional to weight; zero weights only when the
  positive ones run out (band priority with priority_floor = 0)."""
  positive = np.flatnonzero(weights > 0)
  if len(positive) >= n:
    p = weights[positive] / weights[positive].sum()
    return positive[rng.choice(len(positive), size=n, replace=False, p=p)]
  zero = np.flatnonzero(weights <= 0)
  return np.concatenate([rng.permutation(positive),
                         rng.choice(zero, size=n - len(positive), replace=False)])


class TaskPool:
  """A revisited pool of training tasks: the selector `DynamicSampler` drives.

  The pool holds `task_selection.pool_size` task ids drawn from `stream.next_task(tier)`,
  and pools pass rates over `stream.family(task)`. Entries i::count are process `index`'s
  share for `shard=(index, count)`. `sample(n)` draws n distinct tasks of the
  share, not yet picked this step, without replacement with probability
  proportional to `task_weights` of their pass rates; when fewer than n are
  left it first tops the pool up with count * (missing) stream tasks, one block
  of `count` per missing task, so every process's share grows alike.
  `pool_size = 0` means no pool: every pick is then a fresh task from the stream
  (the old behaviour).

  Pass rates: a task's own last `spec.task_selection.window` outcomes, shrunk (`prior_weight`)
  toward its family's pass rate (`FamilyPassRates`, shrunk by
  `family_prior_weight` toward `prior_pass_rate`). Statistics recur twice over:
  tasks are revisited, and families pool outcomes across tasks.

  One step, on every process:
    sample(n) / record(...)  any number of times (record only buffers `outcomes`);
    apply(ids, rewards)      with every process's outcomes, gathered: all pools then
                             hold the same statistics. Tasks other processes topped
                             up are drawn here too: every process must see the same
                             stream, so all pools stay identical;
    end_step()               retires tasks and refills the pool from the stream.

  Retirement (at end_step): a task leaves the pool once it has been attempted in
  `spec.task_selection.max_visits` groups (visits = outcomes // group_size), or once it is
  settled: at least 2 groups seen and every outcome in its window the same (all
  pass or all fail: it has nothing left to teach, whatever its prior said). Its
  statistics are dropped; top-ups beyond `pool_size` leave too, the oldest stay.

  Curriculum (`spec.task_selection.curriculum`, tier names easiest first; empty = off, new tasks
  always come from `default_tier`): new tasks come from the current tier; once the
  current tier's last `spec.task_selection.curriculum_window` episodes pass at
  `spec.task_selection.promote_pass_rate` or more, from the next one. Tasks already pooled stay
  until they retire.
  """

  def __init__(self, spec: RLSpec, stream: TaskStream, *, shard: tuple[int, int] = (0, 1),
               rng: np.random.Generator | None = None, default_tier: str | None = None):
    index, count = shard
    if not (count >= 1 and 0 <= index < count):
      raise ValueError(f"shard={shard}: expected (index, count) with 0 <= index < count.")
    self._stream = stream
    self.spec = spec
    self.shard = (index, count)
    self.rng = rng if rng is not None else np.random.default_rng(0)  # the loop may reseed
    self.default_tier = default_tier
    self.tracker = PassRateTracker.from_spec(spec)
    self.ts = ts = spec.task_selection
    self.families = FamilyPassRates(window=ts.window, prior_pass_rate=ts.prior_pass_rate,
                                    prior_weight=ts.family_prior_weight)
    self.outcomes: list[tuple[str, float]] = []  # recorded here, applied by apply()
    self._pool: list[str] = []  # filled lazily: a pool about to be restored draws nothing
    self._tier_of: dict[str, str | None] = {}  # pooled task -> the tier it was drawn for
    self._family: dict[str, Hashable] = {}  # pooled task -> family (stream.family may be slow)
    self._outcome_count: dict[str, int] = {}  # pooled task -> outcomes applied, all time
    self._tier_index = 0
    self._tier_window: collections.deque = collections.deque(maxlen=ts.curriculum_window)
    self._retired = 0
    self._picked: set[str] = set()  # this process, this step: no task twice in a step
    self._stats = collections.Counter()
    self._stats_stale = False

  # -- views ---------------------------------------------------------------------------

  @property
  def current_tier(self) -> str | None:
    """The tier new tasks come from."""
    return self.ts.curriculum[self._tier_index] if self.ts.curriculum else self.default_tier

  @property
  def tasks(self) -> tuple[str, ...]:
    return tuple(self._pool)

  def visits(self, task: str) -> int:
    """Groups the task has been attempted in."""
    return self._outcome_count.get(task, 0) // self.spec.group_size

  def pass_rate(self, task: str) -> float:
    """The task's pass rate, shrunk toward its family's."""
    family = self._family[task] if task in self._family else self._stream.family(task)
    return self.tracker.pass_rate(task, prior=self.families.pass_rate(family))

  def priorities(self, tasks: Sequence[str]) -> np.ndarray:
    """Sampling weight per task, in [0, 1]: weight / the largest weight any task can get."""
    s = self.ts
    rates = np.array([self.pass_rate(t) for t in tasks], np.float64)
    w = task_weights(rates, s.priority, band_low=s.band_low, band_high=s.band_high,
                     floor=s.priority_floor)
    return w / max(1.0, s.priority_floor)

  # -- selector interface (DynamicSampler) ---------------------------------------------

  def sample(self, n: int) -> list[str]:
    """n distinct tasks of this process's share, drawn by priority (see class doc)."""
    if self._stats_stale:  # first draw of a new step
      self._stats.clear()
      self._stats_stale = False
    self._fill()
    if n <= 0:
      return []
    share = self._share()
    if len(share) < n:
      self._draw(self.shard[1] * (n - len(share)))
      self._stats["topped_up"] += self.shard[1] * (n - len(share))
      share = self._share()
    priority = self.priorities(share)
    chosen = [share[i] for i in _draw_without_replacement(self.rng, priority, n)]
    self._picked.update(chosen)
    picked_priority = self.priorities(chosen)
    st = self._stats
    st["picks"] += n
    st["picked_priority"] += float(picked_priority.sum())
    st["picked_pass_rate"] += sum(self.pass_rate(t) for t in chosen)
    st["picked_unseen"] += sum(self._outcome_count[t] == 0 for t in chosen)
    # What a uniform draw of n from the same share would have averaged.
    st["pool_priority"] += n * float(priority.mean())
    st["pool_pass_rate"] += n * float(np.mean([self.pass_rate(t) for t in share]))
    return chosen

  def record(self, task_ids: Iterable[str], rewards: Iterable[float]) -> None:
    """Buffers outcomes in `outcomes`; nothing changes until apply()."""
    self.outcomes.extend(zip(task_ids, (float(r) for r in rewards)))

  # -- step boundary -------------------------------------------------------------------

  def apply(self, task_ids: Sequence[str], rewards: Sequence[float]) -> None:
    """Applies this step's outcomes of every process (the same lists on every process)."""
    task_ids, rewards = list(task_ids), [float(r) for r in rewards]
    if len(task_ids) != len(rewards):
      raise ValueError(f"apply got {len(task_ids)} task ids and {len(rewards)} rewards.")
    self._fill()  # a process that sampled nothing this step has not filled its pool yet
    self._draw_others_top_ups(task_ids)
    self.tracker.update(task_ids, rewards)
    self.families.update([self._family[t] for t in task_ids], rewards)
    for task in task_ids:
      self._outcome_count[task] += 1
    self._advance_curriculum(task_ids, rewards)
    self.outcomes.clear()

  def end_step(self) -> None:
    """Retires tasks (see class doc), refills the pool to pool_size from the stream."""
    if self.outcomes:
      raise RuntimeError(f"end_step: {len(self.outcomes)} recorded outcomes were never "
                         "applied; call apply() with every process's outcomes first.")
    kept = []
    for task in self._pool:
      if self._settled_or_spent(task):
        self._retired += 1
        self._forget(task)
      else:
        kept.append(task)
    for task in kept[self.ts.pool_size:]:
      self._forget(task)
    self._pool = kept[:self.ts.pool_size]
    self._fill()
    self._picked.clear()
    self._stats_stale = True

  def selection_stats(self) -> dict[str, float]:
    """This step's selection, for logging (means are NaN before the step's first pick).

    picked_*: over the tasks picked; pool_*: what uniform picks from the same shares
    would have averaged. Priority is the normalised weight in [0, 1] (`priorities`).
    """
    st, picks = self._stats, self._stats["picks"]

    def mean(key):
      return st[key] / picks if picks else float("nan")

    return {"selection/picked_priority_mean": mean("picked_priority"),
            "selection/pool_priority_mean": mean("pool_priority"),
            "selection/picked_pass_rate_mean": mean("picked_pass_rate"),
            "selection/pool_pass_rate_mean": mean("pool_pass_rate"),
            "selection/picked_unseen_frac": mean("picked_unseen"),
            "selection/picks": float(picks),
            "selection/topped_up": float(st["topped_up"]),
            "selection/pool_size": float(len(self._pool)),
            "selection/retired": float(self._retired),
            "selection/tier_index": float(self._tier_index),
            "selection/tier_window_pass_rate": (float(np.mean(self._tier_window))
                                                if self._tier_window else float("nan"))}

  # -- checkpointing -------------------------------------------------------------------

  def state_dict(self) -> dict:
    """Plain JSON-able data (string keys); take it between steps, after end_step."""
    if self.outcomes or self._picked:
      raise RuntimeError("TaskPool.state_dict mid-step: call it after end_step().")
    return {"pool": [[task, self._tier_of[task]] for task in self._pool],
            "outcome_counts": {t: self._outcome_count[t] for t in self._pool},
            "tasks": self.tracker.state_dict(), "families": self.families.state_dict(),
            "tier_index": self._tier_index, "tier_window": list(self._tier_window),
            "retired": self._retired}

  def load_state_dict(self, state: dict) -> None:
    tier_index = int(state["tier_index"])
    if tier_index >= max(1, len(self.ts.curriculum)):
      raise ValueError(f"tier_index={tier_index} is past the curriculum "
                       f"{self.ts.curriculum}.")
    self._pool = [task for task, _ in state["pool"]]
    self._tier_of = {task: tier for task, tier in state["pool"]}
    self._family = {task: self._stream.family(task) for task in self._pool}
    self._outcome_count = {t: int(state["outcome_counts"].get(t, 0)) for t in self._pool}
    self.tracker.load_state_dict(state["tasks"])
    self.families.load_state_dict(state["families"])
    self._tier_index = tier_index
    self._tier_window = collections.deque((bool(x) for x in state["tier_window"]),
                                          maxlen=self.ts.curriculum_window)
    self._retired = int(state["retired"])
    self.outcomes, self._picked = [], set()
    self._stats, self._stats_stale = collections.Counter(), False

  # -- internals -----------------------------------------------------------------------

  def _share(self) -> list[str]:
    index, count = self.shard
    return [t for i, t in enumerate(self._pool) if i % count == index and t not in self._picked]

  def _fill(self) -> None:
    self._draw(self.ts.pool_size - len(self._pool))

  def _draw(self, k: int) -> None:
    """Appends k new stream tasks of the current tier, skipping ones already pooled."""
    tier = self.current_tier
    for _ in range(k):
      for _ in range(_MAX_DUPLICATE_DRAWS):
        task = self._stream.next_task(tier)
        if not isinstance(task, str):
          raise TypeError(f"the task stream gave {task!r}: task ids must be str.")
        if task not in self._tier_of:
          break
      else:
        raise RuntimeError(f"tier {tier!r}: {_MAX_DUPLICATE_DRAWS} stream draws gave only "
                           f"tasks already pooled; does it have more than "
                           f"{len(self._pool)} tasks?")
      self._pool.append(task)
      self._tier_of[task] = tier
      self._family[task] = self._stream.family(task)
      self._outcome_count[task] = 0

  def _draw_others_top_ups(self, task_ids: Sequence[str]) -> None:
    # Every process tops up whole blocks of `count` from the same stream, and the last
    # block any process drew holds one of its picks; so drawing blocks until every
    # attempted task is pooled leaves each pool as long as the longest, all identical.
    count = self.shard[1]
    missing = {t for t in task_ids if t not in self._tier_of}
    for _ in range(len(task_ids)):  # no process drew more blocks than it has outcomes
      if not missing:
        return
      self._draw(count)
      missing -= set(self._pool[-count:])
    if missing:
      raise ValueError(f"apply: tasks {sorted(missing)[:3]} are neither pooled nor next in "
                       "the stream; every process needs the same stream and pool state.")

  def _settled_or_spent(self, task: str) -> bool:
    visits = self.visits(task)
    outcomes = self.tracker.outcomes(task)
    return visits >= self.ts.max_visits or (visits >= 2 and len(set(outcomes)) == 1)

  def _advance_curriculum(self, task_ids: Sequence[str], rewards: Sequence[float]) -> None:
    tiers = self.ts.curriculum
    if not tiers:
      return
    tier = self.current_tier
    for task, reward in zip(task_ids, rewards):
      if self._tier_of[task] == tier:
        self._tier_window.append(reward >= SOLVED_REWARD)
    window = self._tier_window
    if (self._tier_index + 1 < len(tiers) and len(window) == window.maxlen
        and np.mean(window) >= self.ts.promote_pass_rate):
      self._tier_index += 1
      window.clear()

  def _forget(self, task: str) -> None:
    for table in (self._tier_of, self._family, self._outcome_count):
      table.pop(task, None)
    self.tracker.forget([task])

