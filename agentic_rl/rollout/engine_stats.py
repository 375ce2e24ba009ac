"""The rollout engine's counters (`RolloutEngine.stats`): time buckets, slot use, tokens."""

from __future__ import annotations

import dataclasses

# The buckets that split the scheduler's wall time (RolloutStats fields).
TIME_BUCKETS = ("decode_s", "prefill_s", "fork_s", "env_wait_s", "host_s")


@dataclasses.dataclass
class RolloutStats:
  """Counters of one engine (all its runs); `as_dict` derives rates and shares.

  Time buckets split the scheduler's wall time: decode_s, prefill_s, fork_s,
  env_wait_s (nothing for the device to do until an environment answers) and host_s.
  slot_utilization = busy slot-seconds / (num_slots x wall), a slot being busy
  while it holds a trajectory whose next work is on the device (decoding,
  prefilling or queued for prefill); free slots and slots waiting for their
  environment are idle. decode_occupancy is stricter: the mean fraction of
  slots that fed a token in each decode step.
  """
  num_slots: int = 1
  wall_s: float = 0.0
  decode_s: float = 0.0
  prefill_s: float = 0.0  # Prompt and observation prefill calls.
  fork_s: float = 0.0  # Prompt copies into slots, each with its first draw.
  env_wait_s: float = 0.0  # Scheduler idle, waiting for the host environments.
  env_thread_s: float = 0.0  # Summed time of env resets and steps on the threads.
  host_s: float = 0.0  # Everything else in the scheduler loop.
  decode_calls: int = 0  # Device calls of up to decode_steps_per_call steps each.
  decode_steps: int = 0  # Steps the calls ran, summed.
  decode_rows: int = 0  # Slot rows that fed a token, summed over decode steps.
  prefill_calls: int = 0
  prefill_rows_used: int = 0  # Rows holding real tokens, summed over prefill calls.
  prefilled_tokens: int = 0
  prefill_shape_tokens: int = 0  # Rows x chunk of the prefill calls: what they computed.
  prompts_prefilled: int = 0  # One per task group, whatever the group size.
  forks: int = 0  # Prompt copies into slots: one per trajectory.
  env_steps: int = 0
  env_resets: int = 0
  generated_tokens: int = 0
  trajectories: int = 0
  busy_slot_s: float = 0.0  # Slot-seconds with device work in progress or queued.
  slot_s: float = 0.0  # Slot-seconds in total (num_slots x time).
  # The same, only in the steady state: after every slot first held a trajectory and
  # before the task stream ran out (no ramp-up, no drain).
  steady_busy_slot_s: float = 0.0
  steady_slot_s: float = 0.0
  peak_kv_bytes: int = 0  # Largest live KV footprint (slots + prompt store).
  allocated_kv_bytes: int = 0
  # Expert assignments the expert-parallel dispatch dropped over its capacity, of those
  # routed (prefill and decode; 0 of 0 without a capacity): the sampler's overflow.
  dropped_assignments: int = 0
  routed_assignments: int = 0

  def add_overflow(self, dropped_routed) -> None:
    self.dropped_assignments += int(dropped_routed[0])
    self.routed_assignments += int(dropped_routed[1])

  def add_time(self, bucket: str, dt: float, busy: int, steady: bool) -> None:
    """`dt` seconds of the scheduler in `bucket`, with `busy` slots holding device work."""
    setattr(self, bucket, getattr(self, bucket) + dt)
    self.busy_slot_s += busy * dt
    self.slot_s += self.num_slots * dt
    if steady:
      self.steady_busy_slot_s += busy * dt
      self.steady_slot_s += self.num_slots * dt

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    wall = max(self.wall_s, 1e-9)
    d["tokens_per_s"] = self.generated_tokens / wall
    d["trajectories_per_s"] = self.trajectories / wall
    d["slot_utilization"] = self.busy_slot_s / self.slot_s if self.slot_s else 0.0
    d["steady_slot_utilization"] = (self.steady_busy_slot_s / self.steady_slot_s
                                    if self.steady_slot_s else None)
    d["overflow_frac"] = (self.dropped_assignments / self.routed_assignments
                          if self.routed_assignments else 0.0)
    d["prefill_fill"] = (self.prefilled_tokens / self.prefill_shape_tokens
                         if self.prefill_shape_tokens else 0.0)
    d["decode_occupancy"] = (self.decode_rows / (self.decode_steps * self.num_slots)
                             if self.decode_steps else 0.0)
    return d
