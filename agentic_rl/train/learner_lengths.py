"""The RL learner's batch lengths: a fixed set, each compiled before the RL clock starts.

A rollout batch pads to the smallest length of the set at or above its longest trajectory,
so the learner compiles once per length, ahead of time, and never inside an RL step.
`config.train.learner_lengths` names the set; () takes quarters of config.rollout.max_len,
each rounded up to a multiple of 128.
"""

from __future__ import annotations

MULTIPLE = 128
DEFAULT_PARTS = 4


def learner_lengths(configured: tuple[int, ...], max_len: int) -> tuple[int, ...]:
  """The sorted set of learner lengths for rollouts of at most `max_len` tokens."""
  if max_len <= 0:
    raise ValueError(f"config.rollout.max_len={max_len}: expected a positive integer.")
  if not configured:
    parts = (-(-max_len * i // DEFAULT_PARTS) for i in range(1, DEFAULT_PARTS + 1))
    return tuple(sorted({min(max_len, -(-n // MULTIPLE) * MULTIPLE) for n in parts}))
  lengths = tuple(sorted(set(int(n) for n in configured)))
  if lengths[0] <= 0:
    raise ValueError(f"config.train.learner_lengths={tuple(configured)}: every length must "
                     "be a positive integer.")
  if lengths[-1] < max_len:
    raise ValueError(f"config.train.learner_lengths={tuple(configured)}: the largest must be "
                     f"at least config.rollout.max_len={max_len}, the longest a trajectory "
                     "can be.")
  return lengths


def bucket(longest: int, lengths: tuple[int, ...]) -> int:
  """The smallest of `lengths` that holds `longest` tokens."""
  for n in lengths:
    if n >= longest:
      return n
  raise ValueError(f"a trajectory of {longest} tokens is longer than every learner length "
                   f"{lengths}.")
