"""What happens to one trajectory between device calls: its turns, env steps and ending.

A drawn token is recorded and either continues the turn or ends it; an ended turn steps
the environment on a host thread, and its observation is queued for prefill into the same
slot (or the trajectory finishes: submit, eos, a budget). A finished trajectory that still
has its last token outside the cache feeds it in one more decode step (FLUSH), then
becomes a `Trajectory`.

Failures of one trajectory end only that trajectory: an exception (not
KeyboardInterrupt or SystemExit) from env_factory, env.reset or env.step, or a
malformed StepResult, ends it with config.END_ENV_ERROR, one from the tokenizer on
its prompt, observation or teacher action with END_RENDER_ERROR; `Trajectory.error`
holds the exception, the reward is what the env paid so far, and the other slots go
on. A failed reset or prompt ends the whole group (its members share that prompt)
with trajectories of no tokens and reward 0.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from typing import Any

from agentic_rl.model import transformer
from agentic_rl.records.trajectory import Trajectory
from agentic_rl.rollout import config as config_lib
from agentic_rl.rollout import episodes
from agentic_rl.rollout.engine_stats import RolloutStats
from agentic_rl.rollout.env_threads import timed
from agentic_rl.rollout.episodes import Active, Group, SlotState
from agentic_rl.rollout.valid_text import valid_text

log = logging.getLogger("agentic_rl.rollout.engine")  # The engine's log, as before the split.


class TrajectoryTurns:
  """The per-trajectory half of `RolloutEngine` (its base class), over the engine's state."""

  model: transformer.Model
  spec: config_lib.RolloutSpec
  tokenizer: Any
  stats: RolloutStats
  _pool: concurrent.futures.ThreadPoolExecutor
  _stop_ids: frozenset[int]
  _empty_replay: tuple[dict, ...]
  _slots: list[Active | None]
  _groups: collections.deque[Group]
  _free_store_rows: list[int]
  _prefill_queue: collections.deque  # Active or Group
  _finished: list[Trajectory]

  def _queue_teacher_turn(self, active: Active, observation: str) -> bool:
    """Queues the teacher's next action as forced tokens; False when its text did not
    tokenize (the trajectory then ends with END_RENDER_ERROR)."""
    text = valid_text(active.member.teacher.act(observation))
    try:
      ids = self.tokenizer.encode(text, parse_special=True)
    except Exception as e:
      self._fail(active, config_lib.END_RENDER_ERROR, e)
      return False
    active.forced.extend(ids)
    active.forced.append(self.tokenizer.end_turn_id)
    return True

  def _on_token(self, active: Active, token, logp, mask_w, version: int) -> None:
    """A token drawn for `active` (not yet in its cache): record it and decide what next."""
    b = active.builder
    token = int(token)
    b.add_generated(token, float(logp), mask_w, version)
    self.stats.generated_tokens += 1
    if token in self._stop_ids:
      # An eos that is also the end of turn (Qwen3's <|im_end|>) ends only the turn.
      active.eos = token == self.tokenizer.eos_id != self.tokenizer.end_turn_id
      b.end_turn(config_lib.TURN_STOP)
      self._step_env(active)
    elif b.turn_generated >= self.spec.max_new_tokens_per_turn:
      b.end_turn(config_lib.TURN_MAX_NEW_TOKENS)
      active.truncated_turn = True
      self._step_env(active)
    elif b.length >= self.spec.token_limit:
      b.end_turn(config_lib.TURN_BUDGET_CUT)
      self._finish(active, self.spec.token_limit_reason)
    else:
      active.state = SlotState.DECODE

  def _step_env(self, active: Active) -> None:
    ids = active.builder.tokens[active.builder.turn_spans[-1][0]:]
    if ids and ids[-1] in self._stop_ids:
      ids = ids[:-1]
    try:  # A byte-level decode may hold surrogates; the env gets valid text.
      action = valid_text(self.tokenizer.decode(ids))
    except Exception as e:
      self._fail(active, config_lib.END_RENDER_ERROR, e)
      return
    active.forced.clear()
    active.state = SlotState.ENV
    active.future = self._pool.submit(timed, active.member.env.step, action)

  def _on_env_result(self, active: Active, result) -> None:
    b = active.builder
    try:  # A malformed StepResult is the environment's failure too.
      info = dict(result.info or {})
      active.reward += float(result.reward)
      b.record_step(info.get("process_signal", 0.0), info)
    except Exception as e:
      self._fail(active, config_lib.END_ENV_ERROR, e)
      return
    if result.done:
      self._finish(active, info.get("end_reason") or config_lib.END_SUBMIT)
      return
    if active.eos:
      self._finish(active, config_lib.END_EOS)
      return
    if b.num_turns >= self.spec.max_turns:
      self._finish(active, config_lib.END_TURN_BUDGET)
      return
    try:
      observation = valid_text(result.observation)
      tool_ids = ([self.tokenizer.end_turn_id] if active.truncated_turn else []) + \
          self.tokenizer.observation_turn(observation)
    except Exception as e:
      self._fail(active, config_lib.END_RENDER_ERROR, e)
      return
    header = self.tokenizer.generation_prompt()
    if b.length + len(tool_ids) + len(header) + 1 > self.spec.token_limit:
      self._finish(active, self.spec.token_limit_reason)
      return
    # Before the context is added: a trajectory that ends here has nothing left to prefill.
    if active.member.teacher is not None and not self._queue_teacher_turn(active, observation):
      return
    active.truncated_turn = False
    b.add_context(tool_ids)
    b.add_context(header, new_turn=True)
    active.state = SlotState.PREFILL
    self._prefill_queue.append(active)

  def _fail(self, active: Active, reason: str, error: Exception) -> None:
    """Ends one trajectory on an exception of its env or its text; the others go on."""
    active.error = episodes.error_text(error)
    log.warning("trajectory %d ends with %s: %s", active.member.trajectory_id, reason,
                active.error)
    self._finish(active, reason)

  def _fail_group(self, group: Group, reason: str, error: Exception) -> None:
    """Ends every member of a group that cannot start (no prompt): no tokens, reward 0."""
    text = episodes.error_text(error)
    log.warning("task %d: its group ends with %s: %s", group.group_id, reason, text)
    for m in group.members:
      if m.env is not None:
        self._pool.submit(m.env.close)
        m.env = None
      self._finished.append(episodes.unstarted_trajectory(
          group, m, reason, text, self._empty_replay, self.model.spec.vocab_size,
          self.spec.recorded_temperature))
    self._groups.remove(group)
    self._free_store_rows.append(group.store_row)

  def _finish(self, active: Active, reason: str) -> None:
    active.end_reason = reason
    if active.cache_len < active.builder.length:
      active.state = SlotState.FLUSH
    else:
      self._finalize(active)

  def _finalize(self, active: Active) -> None:
    m = active.member
    self._finished.append(
        episodes.finished_trajectory(active, self.spec.recorded_temperature))
    self._pool.submit(m.env.close)
    m.env = None
    self._slots[active.slot] = None
