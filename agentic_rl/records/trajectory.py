"""The trajectory record: everything the learner needs to score exactly what was sampled.

A trajectory is one token sequence, left to right: the prompt, then each model
turn followed by its tool turn. Arrays of length L index that sequence. L is 0 when
the group never started (its env reset or prompt failed: end_reason is an error).

Target-aligned arrays (entry t is about tokens[t], drawn from the logits at t - 1):
  loss_mask        float32 [L]     1 on model-generated tokens, 0 on prompt, tool output,
                                   turn headers and tokens the engine inserted.
  sampler_logp     float32 [L]     log-prob of each generated token under the distribution
                                   it was drawn from (0 elsewhere).
  sampling_mask    uint8 [L, W]    packed support of that distribution (0 elsewhere).
  policy_version   int32 [L]       params version that drew each generated token (-1 elsewhere).
Input-aligned replay (entry t is what the forward chose while processing tokens[t]):
  replay           tuple, one dict per layer: 'experts' int32 [L, k] (MoE layers),
                   'blocks' int32 [K, L, n] (sparse layers, -1 = unused slot).
Per token:
  turn_index       int32 [L]       0 for the prompt; model turn i and the tool turn that
                                   answers it are turn i (the header opening turn i+1
                                   belongs to turn i+1).
Per model turn i:
  turn_spans[i]        (start, end): tokens[start:end] are the turn's generated tokens.
  turn_end_reasons[i]  config.TURN_STOP | TURN_MAX_NEW_TOKENS | TURN_BUDGET_CUT.
  process_signals[i]   the environment's info['process_signal'] for the turn's action
                       (0 when the action was never stepped).
  tool_infos[i]        the environment's info dict for that step (None if not stepped).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from agentic_rl.records import batch as batch_lib
from agentic_rl.records import sampling_mask as sampling_mask_lib


@dataclasses.dataclass
class Trajectory:
  trajectory_id: int
  group_id: int
  member: int  # Index within its group.
  seed: int
  task: Any
  tokens: np.ndarray
  loss_mask: np.ndarray
  sampler_logp: np.ndarray
  sampling_mask: np.ndarray
  policy_version: np.ndarray
  turn_index: np.ndarray
  replay: tuple[dict[str, np.ndarray], ...]
  turn_spans: list[tuple[int, int]]
  turn_end_reasons: list[str]
  process_signals: list[float]
  tool_infos: list[dict | None]
  reward: float
  end_reason: str
  temperature: float
  prompt_length: int
  # When end_reason is an error (config.END_ENV_ERROR, END_RENDER_ERROR): the exception.
  error: str = ""

  @property
  def length(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def num_generated(self) -> int:
    return int(self.loss_mask.sum())

  @property
  def num_turns(self) -> int:
    return len(self.turn_spans)

  def process_reward(self) -> np.ndarray:
    """float32 [L]: each turn's process signal at the turn's last generated token."""
    out = np.zeros(self.length, np.float32)
    for (start, end), signal in zip(self.turn_spans, self.process_signals):
      if end > start:
        out[end - 1] += signal
    return out


class TrajectoryBuilder:
  """Appends tokens and replay chunks as the engine produces them; `finish` freezes it."""

  def __init__(self, *, vocab_size: int, layer_replay_keys: Sequence[tuple[str, ...]]):
    self.vocab_size = vocab_size
    self.mask_width = sampling_mask_lib.packed_width(vocab_size)
    self.tokens: list[int] = []
    self.loss_mask: list[float] = []
    self.logp: list[float] = []
    self.versions: list[int] = []
    self.turn_index: list[int] = []
    self.mask_rows: dict[int, np.ndarray] = {}  # token index -> packed mask row
    self.replay_chunks = [{key: [] for key in keys} for keys in layer_replay_keys]
    self.replayed = 0  # Tokens whose replay data has been recorded.
    self.turn = 0
    self.turn_spans: list[tuple[int, int]] = []
    self.turn_end_reasons: list[str] = []
    self.process_signals: list[float] = []
    self.tool_infos: list[dict | None] = []
    self._turn_start: int | None = None

  def copy(self) -> "TrajectoryBuilder":
    """An independent builder with the same content (a group member's shared prompt)."""
    other = TrajectoryBuilder.__new__(TrajectoryBuilder)
    other.__dict__ = {k: v for k, v in self.__dict__.items()}
    for name in ("tokens", "loss_mask", "logp", "versions", "turn_index", "turn_spans",
                 "turn_end_reasons", "process_signals", "tool_infos"):
      setattr(other, name, list(getattr(self, name)))
    other.mask_rows = dict(self.mask_rows)
    other.replay_chunks = [{k: list(v) for k, v in layer.items()}
                           for layer in self.replay_chunks]
    return other

  @property
  def length(self) -> int:
    return len(self.tokens)

  def add_context(self, token_ids: Sequence[int], *, new_turn: bool = False) -> None:
    """Prompt, tool-turn or engine-inserted tokens: not the model's, loss mask 0.

    new_turn: these tokens open the next turn (the header before a model turn).
    """
    if self._turn_start is not None:
      raise RuntimeError("add_context inside an open model turn; call end_turn first.")
    if new_turn:
      self.turn += 1
    for t in token_ids:
      self.tokens.append(int(t))
      self.loss_mask.append(0.0)
      self.logp.append(0.0)
      self.versions.append(-1)
      self.turn_index.append(self.turn)

  def begin_turn(self) -> None:
    """The next token is the first the model generates in a new turn."""
    if self._turn_start is not None:
      raise RuntimeError("begin_turn called inside an open turn.")
    self._turn_start = len(self.tokens)

  def add_generated(self, token: int, logp: float, mask_w: np.ndarray, version: int) -> None:
    if self._turn_start is None:
      raise RuntimeError("add_generated outside a turn; call begin_turn first.")
    self.mask_rows[len(self.tokens)] = np.asarray(mask_w, np.uint8)
    self.tokens.append(int(token))
    self.loss_mask.append(1.0)
    self.logp.append(float(logp))
    self.versions.append(int(version))
    self.turn_index.append(self.turn)

  @property
  def num_turns(self) -> int:
    return len(self.turn_spans)

  @property
  def turn_generated(self) -> int:
    return 0 if self._turn_start is None else len(self.tokens) - self._turn_start

  def end_turn(self, reason: str) -> None:
    self.turn_spans.append((self._turn_start, len(self.tokens)))
    self.turn_end_reasons.append(reason)
    self.process_signals.append(0.0)
    self.tool_infos.append(None)
    self._turn_start = None

  def record_step(self, process_signal: float, info: dict) -> None:
    """The environment's answer to the last closed turn's action."""
    self.process_signals[-1] = float(process_signal)
    self.tool_infos[-1] = info

  def add_replay(self, replay_layers, rows: int | slice, num_tokens: int) -> None:
    """Records `num_tokens` positions of one call's replay (numpy, row `rows`).

    replay_layers: per layer {'experts': [B, T, P], 'blocks': [B, K, T, J]}.
    """
    for chunks, layer in zip(self.replay_chunks, replay_layers):
      for key in chunks:
        x = layer[key][rows]
        chunks[key].append(x[:num_tokens] if key == "experts" else x[:, :num_tokens])
    self.replayed += num_tokens

  def finish(self, *, trajectory_id: int, group_id: int, member: int, seed: int, task: Any,
             reward: float, end_reason: str, temperature: float,
             prompt_length: int, error: str = "") -> Trajectory:
    if self._turn_start is not None:
      raise RuntimeError("finish called inside an open turn.")
    length = len(self.tokens)
    if self.replayed != length:
      raise RuntimeError(f"replay covers {self.replayed} of {length} tokens; every token "
                         "must pass through the forward before the trajectory is finished.")
    mask = np.zeros((length, self.mask_width), np.uint8)
    for i, row in self.mask_rows.items():
      mask[i] = row
    replay = tuple(
        {key: np.concatenate(parts, axis=0 if key == "experts" else 1).astype(np.int32)
         for key, parts in chunks.items()}
        for chunks in self.replay_chunks)
    return Trajectory(
        trajectory_id=trajectory_id, group_id=group_id, member=member, seed=seed, task=task,
        tokens=np.asarray(self.tokens, np.int32),
        loss_mask=np.asarray(self.loss_mask, np.float32),
        sampler_logp=np.asarray(self.logp, np.float32), sampling_mask=mask,
        policy_version=np.asarray(self.versions, np.int32),
        turn_index=np.asarray(self.turn_index, np.int32), replay=replay,
        turn_spans=list(self.turn_spans), turn_end_reasons=list(self.turn_end_reasons),
        process_signals=list(self.process_signals), tool_infos=list(self.tool_infos),
        reward=float(reward), end_reason=end_reason, temperature=float(temperature),
        prompt_length=prompt_length, error=error)


def to_batch(trajectories: Sequence[Trajectory], *, length: int | None = None,
             include_replay: bool = True, include_sampling_mask: bool = True
             ) -> batch_lib.Batch:
  """Pads trajectories into the learner's `rl.batch.Batch`.

  length: padded length T (default: the longest trajectory). Padding has
  position -1, loss mask 0, expert id 0 (a valid id: an out-of-range one would
  give NaN) and block -1 (skipped).
  """
  if not trajectories:
    raise ValueError("to_batch needs at least one trajectory.")
  longest = max(t.length for t in trajectories)
  t_len = longest if length is None else length
  if t_len < longest:
    raise ValueError(f"to_batch length={length} is shorter than the longest trajectory "
                     f"({longest} tokens).")
  b = len(trajectories)
  width = trajectories[0].sampling_mask.shape[1]
  tokens = np.zeros((b, t_len), np.int32)
  positions = np.full((b, t_len), -1, np.int32)
  loss_mask = np.zeros((b, t_len), np.float32)
  logp = np.zeros((b, t_len), np.float32)
  turns = np.zeros((b, t_len), np.int32)
  process = np.zeros((b, t_len), np.float32)
  masks = np.zeros((b, t_len, width), np.uint8)
  temperatures = np.asarray([t.temperature for t in trajectories], np.float32)
  for i, traj in enumerate(trajectories):
    n = traj.length
    tokens[i, :n] = traj.tokens
    positions[i, :n] = np.arange(n)
    loss_mask[i, :n] = traj.loss_mask
    logp[i, :n] = traj.sampler_logp
    turns[i, :n] = traj.turn_index
    process[i, :n] = traj.process_reward()
    masks[i, :n] = traj.sampling_mask
  replay = None
  if include_replay:
    layers = []
    for li, layer in enumerate(trajectories[0].replay):
      out = {}
      if "experts" in layer:
        k = layer["experts"].shape[-1]
        e = np.zeros((b, t_len, k), np.int32)
        for i, traj in enumerate(trajectories):
          e[i, :traj.length] = traj.replay[li]["experts"]
        out["experts"] = e
      if "blocks" in layer:
        kv, _, n_sel = layer["blocks"].shape
        bl = np.full((b, kv, t_len, n_sel), -1, np.int32)
        for i, traj in enumerate(trajectories):
          bl[i, :, :traj.length] = traj.replay[li]["blocks"]
        out["blocks"] = bl
      layers.append(out)
    replay = tuple(layers)
  return batch_lib.make_batch(
      tokens, positions, loss_mask, logp,
      rewards_b=np.asarray([t.reward for t in trajectories], np.float32),
      group_id_b=np.asarray([t.group_id for t in trajectories], np.int32),
      turn_index_bt=turns, process_reward_bt=process, temperature=temperatures,
      replay=replay, sampling_mask_btw=masks if include_sampling_mask else None)
