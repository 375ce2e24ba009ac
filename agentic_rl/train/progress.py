"""A phase's time left, from its own pace since it (re)started: for progress lines."""

from __future__ import annotations

import time


class Progress:
  """Steps `start_step` -> `total`; `eta(step)` is the seconds left at the mean wall time
  per step so far (checkpoints and evaluations inside the phase included)."""

  def __init__(self, start_step: int, total: int, clock=time.time):
    self.start_step, self.total, self.clock = start_step, total, clock
    self.started = clock()

  def eta(self, step: int) -> float:
    done = step - self.start_step
    if done <= 0:
      return float("nan")
    return (self.clock() - self.started) / done * max(self.total - step, 0)
