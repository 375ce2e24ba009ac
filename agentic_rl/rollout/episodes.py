"""The engine's host records of its episodes, and the trajectories built from them.

A task group (`Group`) holds G members (`Member`: one environment and seed each) that
share one prompt, prefilled once into a prompt-store row; each member then runs as an
`Active` trajectory in a slot. A trajectory that ends becomes a `Trajectory` record:
`finished_trajectory` for one that ran, `unstarted_trajectory` for the members of a group
whose reset or prompt failed (no tokens, reward 0).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
from typing import Any

import jax
import numpy as np

from agentic_rl.records import sampling_mask as sampling_mask_lib
from agentic_rl.records.trajectory import Trajectory, TrajectoryBuilder
from agentic_rl.rollout.valid_text import valid_text


class SlotState(enum.Enum):
  FREE = "free"
  DECODE = "decode"  # Has a pending token; joins every decode step.
  PREFILL = "prefill"  # Waiting for (or in) chunked prefill of new context.
  ENV = "env"  # Its environment is stepping on a host thread.
  FLUSH = "flush"  # Finished; feeds its last token in one more decode step.


DEVICE_READY = (SlotState.DECODE, SlotState.PREFILL, SlotState.FLUSH)


@dataclasses.dataclass
class Member:
  trajectory_id: int
  member: int
  seed: int
  env: Any = None
  observation: str | None = None
  teacher: Any = None


@dataclasses.dataclass
class Group:
  group_id: int
  task: Any
  task_seed: int
  members: list[Member]
  store_row: int
  reset_futures: list[concurrent.futures.Future]
  builder: TrajectoryBuilder | None = None  # The shared prompt, with its replay.
  cache_len: int = 0
  last_logits_v: jax.Array | None = None
  next_member: int = 0
  ready: bool = False


@dataclasses.dataclass
class Active:
  """A trajectory in a slot."""
  slot: int
  group: Group
  member: Member
  builder: TrajectoryBuilder
  cache_len: int
  state: SlotState = SlotState.DECODE
  forced: collections.deque = dataclasses.field(default_factory=collections.deque)
  future: concurrent.futures.Future | None = None
  reward: float = 0.0
  eos: bool = False
  truncated_turn: bool = False
  end_reason: str | None = None
  error: str = ""  # The exception that ended it (END_ENV_ERROR, END_RENDER_ERROR).


def member_seed(base_seed: int, task_seed: int, member: int) -> int:
  return int(np.random.SeedSequence([base_seed, task_seed, member]).generate_state(1)[0])


def error_text(error: Exception, limit: int = 2000) -> str:
  text = valid_text(f"{type(error).__name__}: {error}")
  return text if len(text) <= limit else text[:limit] + f" [{len(text) - limit} more chars]"


def check_shared_prompt(group: Group) -> None:
  """Every member's reset observation must be the first one's: they share one prompt."""
  first = group.members[0]
  for member in group.members[1:]:
    if member.observation != first.observation:
      raise ValueError(f"task {group.group_id}: group members got different reset "
                       "observations; a group shares one prompt, so env.reset(task) "
                       "must be deterministic in the task.")


def empty_replay(model_spec) -> tuple[dict[str, np.ndarray], ...]:
  """The replay of a trajectory with no tokens (a group that never started)."""
  ms = model_spec
  empty = {"experts": np.zeros((0, ms.moe.num_experts_per_token), np.int32),
           "blocks": np.zeros((ms.num_kv_heads, 0, ms.num_selected_blocks), np.int32)}
  return tuple({k: empty[k] for k in ms.replay_keys(i)} for i in range(ms.num_layers))


def finished_trajectory(active: Active, temperature: float) -> Trajectory:
  g, m = active.group, active.member
  return active.builder.finish(
      trajectory_id=m.trajectory_id, group_id=g.group_id, member=m.member, seed=m.seed,
      task=g.task, reward=active.reward, end_reason=active.end_reason,
      temperature=temperature, prompt_length=g.cache_len, error=active.error)


def placeholder_trajectory(model_spec, temperature: float, length: int) -> Trajectory:
  """A trajectory of `length` padding-like tokens (id 0, no loss) with every record the
  sampler keeps, shaped as the engine's: batches of it compile the learner ahead of time."""
  ms = model_spec
  width = sampling_mask_lib.packed_width(ms.vocab_size)
  zeros_i, zeros_f = np.zeros(length, np.int32), np.zeros(length, np.float32)
  shapes = {"experts": (length, ms.moe.num_experts_per_token),
            "blocks": (ms.num_kv_heads, length, ms.num_selected_blocks)}
  replay = tuple({k: np.zeros(shapes[k], np.int32) for k in ms.replay_keys(i)}
                 for i in range(ms.num_layers))
  return Trajectory(
      trajectory_id=0, group_id=0, member=0, seed=0, task=None, tokens=zeros_i,
      loss_mask=zeros_f, sampler_logp=zeros_f.copy(),
      sampling_mask=np.zeros((length, width), np.uint8), policy_version=zeros_i.copy(),
      turn_index=zeros_i.copy(), replay=replay, turn_spans=[], turn_end_reasons=[],
      process_signals=[], tool_infos=[], reward=0.0, end_reason="placeholder",
      temperature=temperature, prompt_length=0)


def unstarted_trajectory(group: Group, m: Member, reason: str, error: str, replay,
                         vocab_size: int, temperature: float) -> Trajectory:
  """A member of a group that could not start: no tokens, reward 0, `replay` copied."""
  width = sampling_mask_lib.packed_width(vocab_size)
  none_i, none_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
  return Trajectory(
      trajectory_id=m.trajectory_id, group_id=group.group_id, member=m.member,
      seed=m.seed, task=group.task, tokens=none_i, loss_mask=none_f,
      sampler_logp=none_f.copy(), sampling_mask=np.zeros((0, width), np.uint8),
      policy_version=none_i.copy(), turn_index=none_i.copy(),
      replay=tuple({k: v.copy() for k, v in layer.items()} for layer in replay),
      turn_spans=[], turn_end_reasons=[], process_signals=[], tool_infos=[], reward=0.0,
      end_reason=reason, temperature=temperature, prompt_length=0, error=error)
