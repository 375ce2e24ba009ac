"""The RL phase's train tasks: a seeded stream per tier, their lookup, families and numbers.

Task ids are "tier/index" strings. New ids come per tier in grain's seeded shuffle of that
tier's train split, read by position: every process sees the same order, and a checkpoint
holds just the positions. The task pool (rl/task_selection.TaskPool) draws from it and asks it
each task's family; the loop reads tasks and their numbers (one integer per id, what seeds use
and processes gather) from it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import grain

# Indices per tier in a task number: a tier's train split must hold fewer tasks.
TIER_STRIDE = 10_000_000
_CACHE_SIZE = 4096  # Tasks kept built: the pool revisits a few hundred at a time.


class TaskStream:

  def __init__(self, env_family, env_spec, tiers: tuple[str, ...], seed: int):
    """`tiers`: the tiers RL draws from (the default tier and the curriculum's)."""
    self._sources = {t: env_family.task_source(env_spec, "train", t) for t in tiers}
    too_big = {t: len(s) for t, s in self._sources.items() if len(s) >= TIER_STRIDE}
    if too_big:
      raise ValueError(f"train splits {too_big} hold more than {TIER_STRIDE} tasks: task "
                       "numbers would collide.")
    self._tiers = tuple(env_spec.tiers)  # Numbers rank tiers as the env lists them.
    self._orders = {tier: grain.MapDataset.range(len(src)).shuffle(seed=seed + rank)
                    for rank, (tier, src) in enumerate(self._sources.items())}
    self.position = {tier: 0 for tier in tiers}
    self._task_family = env_family.task_family
    self._cache: dict[str, Any] = {}

  def next_task(self, tier: str) -> str:
    order = self._orders[tier]
    index = int(order[self.position[tier] % len(order)])
    self.position[tier] += 1
    return f"{tier}/{index}"

  def task(self, task_id: str) -> Any:
    """The task behind an id (built once while the pool revisits it)."""
    task = self._cache.get(task_id)
    if task is None:
      tier, index = task_id.split("/")
      task = self._sources[tier][int(index)]
      if len(self._cache) >= _CACHE_SIZE:
        self._cache.clear()
      self._cache[task_id] = task
    return task

  def family(self, task_id: str) -> Hashable:
    """(tier, the env's family of the task): what the pool pools pass rates over."""
    return task_id.split("/")[0], self._task_family(self.task(task_id))

  def number(self, task_id: str) -> int:
    tier, index = task_id.split("/")
    return self._tiers.index(tier) * TIER_STRIDE + int(index)

  def task_id(self, number: int) -> str:
    return f"{self._tiers[int(number) // TIER_STRIDE]}/{int(number) % TIER_STRIDE}"
