"""Train and held-out SWE task splits as grain MapDataset sources.

A split is a contiguous seed range (config.splits); the two ranges are
disjoint (validated). Index i of a split is the task of seed start + i in
tier tiers[i % len(tiers)], generated on access, so a source is cheap to
create, random-access, picklable and identical in every process.
"""

from __future__ import annotations

import grain

from agentic_rl.envs.config import EnvSpec, validate_env_config
from agentic_rl.envs.swe_tasks import SweTask, generate_task

SPLITS = ("train", "heldout")


class SweTaskSource(grain.sources.RandomAccessDataSource):
  """Random access to the tasks of one split."""

  def __init__(self, split: str = "train", tiers: tuple[str, ...] | None = None,
               config: EnvSpec | None = None):
    self.config = validate_env_config(config)
    if split not in SPLITS:
      raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    tiers = (self.config.default_tier,) if tiers is None else tuple(tiers)
    unknown = [t for t in tiers if t not in self.config.tiers]
    if not tiers or unknown:
      raise ValueError(f"tiers must be a non-empty tuple of {sorted(self.config.tiers.keys())}, "
                       f"got {tiers!r}")
    self.split, self.tiers = split, tiers
    sp = self.config.splits
    self.seed_start = sp.train_seed_start if split == "train" else sp.heldout_seed_start
    self._len = sp.train_size if split == "train" else sp.heldout_size

  def __len__(self) -> int:
    return self._len

  def seed_of(self, index: int) -> int:
    return self.seed_start + index

  def __getitem__(self, index: int) -> SweTask:
    if isinstance(index, bool) or not isinstance(index, int):
      raise TypeError(f"index must be an int, got {type(index).__name__}")
    if index < 0:
      index += self._len
    if not 0 <= index < self._len:
      raise IndexError(f"index {index} out of range for the {self.split} split of {self._len}")
    tier = self.tiers[index % len(self.tiers)]
    return generate_task(self.seed_of(index), tier, self.split, self.config)

  def __repr__(self) -> str:
    return (f"SweTaskSource(split={self.split!r}, tiers={self.tiers!r}, "
            f"seeds=[{self.seed_start}, {self.seed_start + self._len}))")


def swe_task_dataset(split: str = "train", tiers: tuple[str, ...] | None = None,
                     config: EnvSpec | None = None) -> grain.MapDataset:
  """A grain MapDataset of SweTask records (shuffle, repeat, batch with grain as usual)."""
  return grain.MapDataset.source(SweTaskSource(split, tiers, config))
