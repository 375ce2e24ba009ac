"""Where a run stands, host side: saved as every checkpoint's JSON extras.

One typed record instead of an untyped dict: a resumed run reads back exactly the fields
it wrote, and a checkpoint whose extras hold a field this code does not know is refused
by name rather than silently dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Fields older checkpoints wrote that nothing reads any more: accepted and dropped.
_RETIRED = ("tracker", "wall_seconds")
# Stored beside the run state, owned by train/fingerprint.py.
FINGERPRINT_KEY = "fingerprint"


@dataclasses.dataclass
class RunState:
  phase: str = "sft"  # "sft", then "rl" from the hand-over on.
  sft_step: int = 0
  rl_step: int = 0
  # Held-out scores (Evaluator.score's dict) of the params RL starts from, and the latest.
  heldout_sft: dict | None = None
  heldout_last: dict | None = None
  history: list[dict] = dataclasses.field(default_factory=list)  # curves.png's rows.
  rl_wall_seconds: float = 0.0
  mismatch_kl: list[float] = dataclasses.field(default_factory=list)  # One per RL step.
  pool: dict | None = None  # TaskPool.state_dict()
  sampler: dict | None = None  # DynamicSampler.state_dict()
  stream: dict | None = None  # TaskStream.position
  sft_plateau: dict | None = None  # PlateauStop.state_dict()
  sft_best_step: int | None = None
  init_checkpoint: dict | None = None  # Where the start params came from (provenance).

  def __post_init__(self):
    if self.phase not in ("sft", "rl"):
      raise ValueError(f"run state phase must be 'sft' or 'rl'; got {self.phase!r}")

  @property
  def global_step(self) -> int:
    """The step logs and checkpoints are numbered by: SFT steps, then RL steps."""
    return self.sft_step + self.rl_step

  @property
  def phase_step(self) -> int:
    return self.sft_step if self.phase == "sft" else self.rl_step

  def to_extras(self, fingerprint: dict) -> dict:
    return {**dataclasses.asdict(self), FINGERPRINT_KEY: fingerprint}

  @classmethod
  def from_extras(cls, extras: dict, source: str) -> tuple["RunState", dict | None]:
    """(run state, saved fingerprint or None) from a checkpoint's extras."""
    extras = {k: v for k, v in extras.items() if k not in _RETIRED}
    fingerprint = extras.pop(FINGERPRINT_KEY, None)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(extras) - known)
    if unknown:
      raise ValueError(f"{source}: the run state holds fields {unknown} this code does not "
                       f"know (known: {sorted(known)}).")
    return cls(**extras), fingerprint


def provenance(extras: dict[str, Any]) -> dict:
  """What saved params carry of their history (a checkpoint's extras, a params file's
  metadata): the fields a run started from them reports."""
  return {k: extras.get(k) for k in ("phase", "sft_step", "rl_step", "sft_best_step",
                                     "sft_plateau")}
