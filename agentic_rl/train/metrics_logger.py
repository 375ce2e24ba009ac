"""One sink for run metrics: TensorBoard events, metrics.jsonl, episodes.jsonl (one shape
per sampled RL episode, records/episode_shape.py) and a console line.

TensorBoard files come from tensorboardX (no TensorFlow needed). On resume, lines of
metrics.jsonl and episodes.jsonl past the restored step are dropped, so a resumed run's
files read as if it had never stopped.
"""

from __future__ import annotations

import json
import math
import os
from typing import Mapping

import numpy as np


def _entries(key: str, value) -> list[tuple[str, float]]:
  """(key, float) pairs of a metric: a number as itself, an array (the mismatch's per-turn,
  per-position and per-layer breakdowns) as one scalar per entry, `key/i` (`key/i/j`...),
  so nothing computed is dropped. Non-numeric values (None, text) give nothing."""
  if value is None:
    return []
  try:
    a = np.asarray(value)
  except (TypeError, ValueError):
    return []
  if a.dtype.kind not in "biuf":
    try:  # bfloat16 and the other ml_dtypes floats report kind 'V'.
      a = a.astype(np.float64)
    except (TypeError, ValueError):
      return []
  if a.ndim == 0:
    return [(key, float(a))]
  return [(key + "".join(f"/{i}" for i in index), float(a[index]))
          for index in np.ndindex(a.shape)]


def _truncate_after(path: str, step: int | None) -> None:
  """Keeps the records of `path` (JSON lines with a "step") at or before `step`; all of
  them are dropped when `step` is None (a fresh run)."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.readlines()
  keep = []
  for line in lines:
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue  # A line cut by a kill -9 mid-write.
    if step is not None and record.get("step", -1) <= step:
      keep.append(json.dumps(record) + "\n")
  with open(path + ".tmp", "w") as f:
    f.writelines(keep)
  os.replace(path + ".tmp", path)


class MetricsLogger:

  def __init__(self, workdir: str, *, resume_step: int | None = None, enabled: bool = True,
               tensorboard: bool = True):
    self.enabled = enabled  # Only process 0 writes in multi-host runs.
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.episodes_path = os.path.join(workdir, "episodes.jsonl")
    self._writer = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    for path in (self.path, self.episodes_path):
      _truncate_after(path, resume_step)
    self._file = open(self.path, "a", buffering=1)
    self._episodes = open(self.episodes_path, "a", buffering=1)
    if tensorboard:
      from tensorboardX import SummaryWriter  # Imported here: optional for library users.
      self._writer = SummaryWriter(os.path.join(workdir, "tensorboard"), flush_secs=10)

  def scalars(self, step: int, metrics: Mapping[str, object]) -> dict[str, float]:
    """Logs every number, and every entry of a numeric array as `key/i`; non-finite
    values as None. Returns what was logged."""
    clean = {}
    for key, value in metrics.items():
      for k, v in _entries(key, value):
        clean[k] = v if math.isfinite(v) else None
    if not self.enabled:
      return clean
    self._file.write(json.dumps({"step": int(step), **clean}) + "\n")
    if self._writer is not None:
      for key, v in clean.items():
        if v is not None:
          self._writer.add_scalar(key, v, step)
    return clean

  def episodes(self, step: int, shapes: list[dict]) -> None:
    """One episodes.jsonl line per episode shape, tagged with the step."""
    if self.enabled:
      self._episodes.writelines(json.dumps({"step": int(step), **s}) + "\n" for s in shapes)

  def text(self, step: int, tag: str, text: str):
    if self.enabled and self._writer is not None:
      # TensorBoard renders markdown; a code block keeps trajectories readable.
      self._writer.add_text(tag, "```\n" + text + "\n```", step)

  def flush(self):
    if self.enabled:
      self._file.flush()
      self._episodes.flush()
      if self._writer is not None:
        self._writer.flush()

  def close(self):
    if self.enabled:
      self._file.close()
      self._episodes.close()
      if self._writer is not None:
        self._writer.close()
