"""One sink for run metrics: TensorBoard events, metrics.jsonl and a console line.

TensorBoard files come from tensorboardX (no TensorFlow needed). On resume,
lines of metrics.jsonl past the restored step are dropped, so a resumed run's
file reads as if it had never stopped.
"""

from __future__ import annotations

import json
import math
import os
from typing import Mapping

import numpy as np


def _to_float(value) -> float | None:
  try:
    v = float(np.asarray(value))
  except (TypeError, ValueError):
    return None
  return v


class MetricsLogger:

  def __init__(self, workdir: str, *, resume_step: int | None = None, enabled: bool = True,
               tensorboard: bool = True):
    self.enabled = enabled  # Only process 0 writes in multi-host runs.
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._writer = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._truncate_after(resume_step)
    self._file = open(self.path, "a", buffering=1)
    if tensorboard:
      from tensorboardX import SummaryWriter  # Imported here: optional for library users.
      self._writer = SummaryWriter(os.path.join(workdir, "tensorboard"), flush_secs=10)

  def _truncate_after(self, step):
    if not os.path.exists(self.path):
      return
    with open(self.path) as f:
      lines = f.readlines()
    keep = []
    for line in lines:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # A line cut by a kill -9 mid-write.
      if step is not None and record.get("step", -1) <= step:
        keep.append(json.dumps(record) + "\n")
    with open(self.path + ".tmp", "w") as f:
      f.writelines(keep)
    os.replace(self.path + ".tmp", self.path)

  def scalars(self, step: int, metrics: Mapping[str, object]) -> dict[str, float]:
    """Logs every scalar-convertible entry; returns what was logged."""
    clean = {}
    for key, value in metrics.items():
      v = _to_float(value)
      if v is not None:
        clean[key] = v if math.isfinite(v) else None
    if not self.enabled:
      return clean
    self._file.write(json.dumps({"step": int(step), **clean}) + "\n")
    if self._writer is not None:
      for key, v in clean.items():
        if v is not None:
          self._writer.add_scalar(key, v, step)
    return clean

  def text(self, step: int, tag: str, text: str):
    if self.enabled and self._writer is not None:
      # TensorBoard renders markdown; a code block keeps trajectories readable.
      self._writer.add_text(tag, "```\n" + text + "\n```", step)

  def flush(self):
    if self.enabled:
      self._file.flush()
      if self._writer is not None:
        self._writer.flush()

  def close(self):
    if self.enabled:
      self._file.close()
      if self._writer is not None:
        self._writer.close()
