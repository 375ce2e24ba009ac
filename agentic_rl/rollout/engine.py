"""Multi-turn continuous batching over a fixed number of slots.

    engine = RolloutEngine(model, params, rollout_spec, tokenizer, env_factory)
    for trajectory in engine.generate(tasks):   # as each one finishes
      ...
    engine.close()

Device side (see device_steps.py): one KV cache of `num_slots` rows, each row
holding one trajectory, and a prompt store of `prompt_store_rows` rows.
Host side: this scheduler loop. Each iteration it

  1. harvests finished environment work (resets, tool steps) from the thread pool;
  2. starts new task groups while a prompt-store row is free (G environments
     are reset on the pool; their shared prompt is prefilled once, into the store);
  3. fills every free slot from a ready prompt: the store row is copied into the
     slot and the slot draws its first token (the G members of a group share
     one prefill, and start as slots free up, without waiting for each other);
  4. runs one prefill call (up to `prefill_rows` rows, one chunk each);
  5. runs one decode step over every slot that has a token to feed.

A slot whose turn ends (stop id or max_new_tokens_per_turn) pauses while its
environment steps on a host thread; the other slots keep decoding. The
observation comes back as a tool turn plus the next assistant header, and is
chunk-prefilled into the same slot after the tokens already there: the
prefix is never prefilled again. A finished trajectory frees its slot at
once for the next ready prompt.

Token bookkeeping: the last token a slot drew is not yet in its cache; it is
fed by the next decode step or as the first token of the next prefill. A
finishing trajectory feeds it in one last decode step ("flush"), so every
token of the record has its routing and block selection recorded.

Environment protocol: `env_factory() -> env`; `env.reset(task) -> str`;
`env.step(action_text) -> StepResult(observation, reward, done, info)` with
info['process_signal'] and, when done, info['end_reason']; `env.close()`;
an optional `env.system_prompt` str. Rewards are summed over steps.

Text boundary: every observation and every action (decoded from the model, or a
teacher's) passes through `valid_text` before a tokenizer or an environment sees it,
so a lone surrogate becomes U+FFFD instead of an error.

Failures of one trajectory end only that trajectory: an exception (not
KeyboardInterrupt or SystemExit) from env_factory, env.reset or env.step, or a
malformed StepResult, ends it with config.END_ENV_ERROR, one from the tokenizer on
its prompt, observation or teacher action with END_RENDER_ERROR; `Trajectory.error`
holds the exception, the reward is what the env paid so far, and the other slots go
on. A failed reset or prompt ends the whole group (its members share that prompt)
with trajectories of no tokens and reward 0.

Teacher forcing (optional): `teacher_factory(task) -> teacher` with
`teacher.act(observation) -> str`; each model turn then feeds the teacher's
text (+ end_turn) instead of drawing, recording the model's log-prob of it.
Used to benchmark with real trajectory lengths and to record demonstrations.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import logging
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model import cache as cache_lib
from agentic_rl.model import transformer
from agentic_rl.records import sampling_mask as sampling_mask_lib
from agentic_rl.rollout import config as config_lib
from agentic_rl.rollout import sampling
from agentic_rl.rollout.device_steps import DeviceSteps
from agentic_rl.records.trajectory import Trajectory, TrajectoryBuilder
from agentic_rl.rollout.valid_text import valid_text

log = logging.getLogger(__name__)


class SlotState(enum.Enum):
  FREE = "free"
  DECODE = "decode"  # Has a pending token; joins every decode step.
  PREFILL = "prefill"  # Waiting for (or in) chunked prefill of new context.
  ENV = "env"  # Its environment is stepping on a host thread.
  FLUSH = "flush"  # Finished; feeds its last token in one more decode step.


DEVICE_READY = (SlotState.DECODE, SlotState.PREFILL, SlotState.FLUSH)


@dataclasses.dataclass
class RolloutStats:
  """Counters of one engine (all its runs); `as_dict` derives rates and shares.

  Time buckets split the scheduler's wall time: decode_s, prefill_s, env_wait_s
  (nothing for the device to do until an environment answers) and host_s.
  slot_utilization = busy slot-seconds / (num_slots x wall), a slot being busy
  while it holds a trajectory whose next work is on the device (decoding,
  prefilling or queued for prefill); free slots and slots waiting for their
  environment are idle. decode_occupancy is stricter: the mean fraction of
  slots that fed a token in each decode step.
  """
  num_slots: int = 1
  wall_s: float = 0.0
  decode_s: float = 0.0
  prefill_s: float = 0.0  # Prompt and observation prefill, and prompt copies into slots.
  env_wait_s: float = 0.0  # Scheduler idle, waiting for the host environments.
  env_thread_s: float = 0.0  # Summed time of env resets and steps on the threads.
  host_s: float = 0.0  # Everything else in the scheduler loop.
  decode_steps: int = 0
  decode_rows: int = 0  # Slot rows that fed a token, summed over decode steps.
  prefill_calls: int = 0
  prefill_rows_used: int = 0  # Rows holding real tokens, summed over prefill calls.
  prefilled_tokens: int = 0
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

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    wall = max(self.wall_s, 1e-9)
    d["tokens_per_s"] = self.generated_tokens / wall
    d["trajectories_per_s"] = self.trajectories / wall
    d["slot_utilization"] = self.busy_slot_s / self.slot_s if self.slot_s else 0.0
    d["steady_slot_utilization"] = (self.steady_busy_slot_s / self.steady_slot_s
                                    if self.steady_slot_s else None)
    d["decode_occupancy"] = (self.decode_rows / (self.decode_steps * self.num_slots)
                             if self.decode_steps else 0.0)
    return d


@dataclasses.dataclass
class _Member:
  trajectory_id: int
  member: int
  seed: int
  env: Any = None
  observation: str | None = None
  teacher: Any = None


@dataclasses.dataclass
class _Group:
  group_id: int
  task: Any
  task_seed: int
  members: list[_Member]
  store_row: int
  reset_futures: list[concurrent.futures.Future]
  builder: TrajectoryBuilder | None = None  # The shared prompt, with its replay.
  cache_len: int = 0
  last_logits_v: jax.Array | None = None
  next_member: int = 0
  ready: bool = False


@dataclasses.dataclass
class _Active:
  """A trajectory in a slot."""
  slot: int
  group: _Group
  member: _Member
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


def _timed(fn, *args):
  start = time.perf_counter()
  result = fn(*args)
  return result, time.perf_counter() - start


def _error_text(error: Exception, limit: int = 2000) -> str:
  text = valid_text(f"{type(error).__name__}: {error}")
  return text if len(text) <= limit else text[:limit] + f" [{len(text) - limit} more chars]"


def _member_seed(base_seed: int, task_seed: int, member: int) -> int:
  return int(np.random.SeedSequence([base_seed, task_seed, member]).generate_state(1)[0])


class RolloutEngine:
  """Continuous batching of multi-turn tool-use trajectories; see the module docstring."""

  def __init__(self, model: transformer.Model, params, spec: config_lib.RolloutSpec,
               tokenizer, env_factory: Callable[[], Any], *, policy_version: int = 0,
               teacher_factory: Callable[[Any], Any] | None = None,
               steps: DeviceSteps | None = None):
    """steps: compiled device steps to share with other engines of the same model,
    sampling setting and chunk size (default: new ones)."""
    if tokenizer.vocab_size > model.spec.vocab_size:
      raise ValueError(f"the tokenizer uses {tokenizer.vocab_size} ids but the model's "
                       f"vocab_size is {model.spec.vocab_size}.")
    self.model = model
    self.spec = spec
    self.tokenizer = tokenizer
    self.env_factory = env_factory
    self.teacher_factory = teacher_factory
    self._params_lock = threading.Lock()
    self._params, self._version = params, int(policy_version)
    sampling_params = sampling.SamplingParams(spec.temperature, spec.top_k, spec.top_p)
    if steps is None:
      steps = DeviceSteps(model, sampling_params, spec.prefill_chunk)
    elif (steps.model.spec != model.spec or steps.sampling_params != sampling_params
          or steps.chunk != spec.prefill_chunk):
      raise ValueError("the shared DeviceSteps were built for another model spec, sampling "
                       f"setting ({steps.sampling_params}) or chunk ({steps.chunk}); this "
                       f"engine needs {sampling_params} and chunk {spec.prefill_chunk}.")
    self.steps = steps
    self.cache = model.init_cache(spec.num_slots, spec.max_len)
    self.store = model.init_cache(spec.prompt_store_rows, spec.max_len)
    # Host records of each row's cache length, kept apart from the trajectories' own
    # counts, so each device step checks its positions without reading the device.
    self._cache_lengths = np.zeros(spec.num_slots, np.int64)
    self._store_lengths = np.zeros(spec.prompt_store_rows, np.int64)
    self._layer_replay_keys = tuple(model.spec.replay_keys(i)
                                    for i in range(model.spec.num_layers))
    ms = model.spec
    empty = {"experts": np.zeros((0, ms.moe.num_experts_per_token), np.int32),
             "blocks": np.zeros((ms.num_kv_heads, 0, ms.num_selected_blocks), np.int32)}
    # The replay of a trajectory with no tokens (a group that never started).
    self._empty_replay = tuple({k: empty[k] for k in keys} for keys in self._layer_replay_keys)
    self._stop_ids = frozenset(tokenizer.stop_ids)
    self._pool = concurrent.futures.ThreadPoolExecutor(spec.env_threads,
                                                       thread_name_prefix="rollout-env")
    self.stats = RolloutStats(num_slots=spec.num_slots)
    self.stats.allocated_kv_bytes = int(sum(
        x.nbytes for x in jax.tree.leaves((self.cache, self.store))))

  # -- public -------------------------------------------------------------------------------

  def set_params(self, params, policy_version: int) -> None:
    """New weights for the following steps (thread-safe); tokens record the version."""
    with self._params_lock:
      self._params, self._version = params, int(policy_version)

  def run(self, tasks: Iterable[Any], task_seeds: Sequence[int] | None = None
          ) -> list[Trajectory]:
    """All trajectories of `tasks`, ordered by trajectory id (task index * G + member)."""
    return sorted(self.generate(tasks, task_seeds), key=lambda t: t.trajectory_id)

  def generate(self, tasks: Iterable[Any], task_seeds: Sequence[int] | None = None
               ) -> Iterator[Trajectory]:
    """Yields each trajectory as it finishes; `group_size` per task.

    task_seeds: one per task (default: the task's index). A trajectory's
    tokens depend only on (config seed, task seed, member index) and the
    params, not on slot assignment or on what else runs.
    """
    if getattr(self, "_running", False):
      raise RuntimeError("this engine is already generating; one generate() at a time "
                         "(its slots and caches belong to that run).")
    self._running = True
    spec = self.spec
    task_iter = iter(enumerate(tasks))
    seeds = None if task_seeds is None else list(task_seeds)
    self._slots: list[_Active | None] = [None] * spec.num_slots
    self._groups: collections.deque[_Group] = collections.deque()  # Oldest first.
    self._free_store_rows = list(range(spec.prompt_store_rows))
    self._prefill_queue: collections.deque = collections.deque()  # _Active or _Group
    self._finished: list[Trajectory] = []
    self._tasks_left = True
    self._all_slots_filled = False
    start = time.perf_counter()
    try:
      while True:
        t0 = time.perf_counter()
        busy = self._busy_slots()
        self._harvest()
        while self._tasks_left and self._free_store_rows:
          self._start_group(task_iter, seeds)
        self._account(t0, busy, "host_s")
        t0, busy = time.perf_counter(), self._busy_slots()
        self._fill_slots()
        self._all_slots_filled |= all(a is not None for a in self._slots)
        self._account(t0, busy, "prefill_s")
        did_work = self._prefill_once()
        did_work |= self._decode_once()
        self._update_peak_kv()
        finished, self._finished = self._finished, []
        self.stats.trajectories += len(finished)
        self.stats.wall_s += time.perf_counter() - start
        yield from finished
        start = time.perf_counter()
        if not (self._tasks_left or self._groups or any(self._slots)):
          break
        if not did_work:
          self._wait_for_host()
    finally:
      self.stats.wall_s += time.perf_counter() - start
      self._abandon()
      self._running = False

  def close(self) -> None:
    self._pool.shutdown(wait=True)

  def compiled_step_count(self) -> int:
    """Traces of the jitted steps so far (each trace is one compilation)."""
    return self.steps.num_traces

  # -- scheduling ---------------------------------------------------------------------------

  def _busy_slots(self) -> int:
    return sum(1 for a in self._slots if a is not None and a.state in DEVICE_READY)

  def _account(self, t0: float, busy: int, bucket: str) -> None:
    dt = time.perf_counter() - t0
    setattr(self.stats, bucket, getattr(self.stats, bucket) + dt)
    self.stats.busy_slot_s += busy * dt
    self.stats.slot_s += self.spec.num_slots * dt
    if self._all_slots_filled and self._tasks_left:
      self.stats.steady_busy_slot_s += busy * dt
      self.stats.steady_slot_s += self.spec.num_slots * dt

  def _start_group(self, task_iter, seeds) -> None:
    try:
      index, task = next(task_iter)
    except StopIteration:
      self._tasks_left = False
      return
    if seeds is not None and index >= len(seeds):
      raise ValueError(f"task_seeds has {len(seeds)} entries but there are more tasks; "
                       "give one seed per task.")
    task_seed = index if seeds is None else int(seeds[index])
    g = self.spec.group_size
    members = [_Member(trajectory_id=index * g + m, member=m,
                       seed=_member_seed(self.spec.seed, task_seed, m)) for m in range(g)]
    row = self._free_store_rows.pop(0)
    futures = [self._pool.submit(_timed, self._create_and_reset, task) for _ in members]
    self._groups.append(_Group(group_id=index, task=task, task_seed=task_seed,
                               members=members, store_row=row, reset_futures=futures))

  def _create_and_reset(self, task):
    env = self.env_factory()
    try:
      return env, env.reset(task)
    except BaseException:
      env.close()
      raise

  def _harvest(self) -> None:
    for group in list(self._groups):  # A group that fails to start leaves the deque.
      if group.builder is None and all(f.done() for f in group.reset_futures):
        self._on_group_reset(group)
    for active in self._slots:
      if active is not None and active.state is SlotState.ENV and active.future.done():
        self.stats.env_steps += 1
        try:
          (result, seconds) = active.future.result()
        except Exception as e:  # Not BaseException: an interrupt still stops the run.
          self._fail(active, config_lib.END_ENV_ERROR, e)
          continue
        self.stats.env_thread_s += seconds
        self._on_env_result(active, result)

  def _on_group_reset(self, group: _Group) -> None:
    failure = None
    for member, future in zip(group.members, group.reset_futures):
      try:
        (member.env, observation), seconds = future.result()
        member.observation = valid_text(observation)
      except Exception as e:  # env_factory or env.reset raised (the env is closed).
        failure = failure or e
        continue
      self.stats.env_thread_s += seconds
      self.stats.env_resets += 1
    if failure is not None:
      self._fail_group(group, config_lib.END_ENV_ERROR, failure)
      return
    first = group.members[0]
    for member in group.members[1:]:
      if member.observation != first.observation:
        raise ValueError(f"task {group.group_id}: group members got different reset "
                         "observations; a group shares one prompt, so env.reset(task) "
                         "must be deterministic in the task.")
    system = getattr(first.env, "system_prompt", None) or self.spec.system_prompt
    try:
      turns = ([("system", valid_text(system))] if system else []) + \
          [("user", first.observation)]
      prompt = self.tokenizer.render_conversation(turns, add_generation_prompt=True)
    except Exception as e:
      self._fail_group(group, config_lib.END_RENDER_ERROR, e)
      return
    if len(prompt) + 1 > self.spec.token_limit:
      raise ValueError(
          f"task {group.group_id}: the prompt has {len(prompt)} tokens, leaving no room "
          f"for a generated token within {self.spec.token_limit} "
          f"({self.spec.token_limit_reason}); raise config.rollout.max_total_tokens / "
          "max_len or shorten the task.")
    builder = TrajectoryBuilder(vocab_size=self.model.spec.vocab_size,
                                layer_replay_keys=self._layer_replay_keys)
    builder.add_context(prompt)
    group.builder = builder
    if self.teacher_factory is not None:
      for member in group.members:
        member.teacher = self.teacher_factory(group.task)
    reset = np.zeros(self.spec.prompt_store_rows, bool)
    reset[group.store_row] = True
    self.store = self.steps.reset_rows(self.store, jnp.asarray(reset))
    self._store_lengths[group.store_row] = 0
    self._prefill_queue.append(group)

  def _fill_slots(self) -> None:
    for slot in range(self.spec.num_slots):
      if self._slots[slot] is not None:
        continue
      group = next((g for g in self._groups if g.ready and g.next_member < len(g.members)),
                   None)
      if group is None:
        return
      self._fork_into(slot, group)

  def _fork_into(self, slot: int, group: _Group) -> None:
    member = group.members[group.next_member]
    group.next_member += 1
    active = _Active(slot=slot, group=group, member=member, builder=group.builder.copy(),
                     cache_len=group.cache_len)
    self._slots[slot] = active
    if group.next_member == len(group.members):  # Every member has its copy.
      self._groups.remove(group)
      self._free_store_rows.append(group.store_row)
    if member.teacher is not None and not self._queue_teacher_turn(active, member.observation):
      return  # Ended with its prompt alone: the teacher's first action did not tokenize.
    forced = active.forced.popleft() if active.forced else -1
    self.steps.check_forced(np.asarray([forced]))
    _, version = self._current_params()
    self.cache, sampled = self.steps.fork(
        self.cache, self.store, jnp.int32(group.store_row), jnp.int32(slot),
        group.last_logits_v, jnp.uint32(member.seed), jnp.int32(group.cache_len - 1),
        jnp.int32(forced))
    self._cache_lengths[slot] = self._store_lengths[group.store_row]
    sampled = jax.device_get(sampled)
    self.stats.forks += 1
    active.builder.begin_turn()
    self._on_token(active, sampled.tokens_b[0], sampled.logp_b[0], sampled.mask_bw[0],
                   version)

  def _queue_teacher_turn(self, active: _Active, observation: str) -> bool:
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

  def _current_params(self):
    with self._params_lock:
      return self._params, self._version

  def _on_token(self, active: _Active, token, logp, mask_w, version: int) -> None:
    """A token drawn for `active` (not yet in its cache): record it and decide what next."""
    b = active.builder
    token = int(token)
    b.add_generated(token, float(logp), mask_w, version)
    self.stats.generated_tokens += 1
    if token in self._stop_ids:
      active.eos = token == self.tokenizer.eos_id
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

  def _step_env(self, active: _Active) -> None:
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
    active.future = self._pool.submit(_timed, active.member.env.step, action)

  def _on_env_result(self, active: _Active, result) -> None:
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
          self.tokenizer.render_turn("tool", observation)
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

  def _fail(self, active: _Active, reason: str, error: Exception) -> None:
    """Ends one trajectory on an exception of its env or its text; the others go on."""
    active.error = _error_text(error)
    log.warning("trajectory %d ends with %s: %s", active.member.trajectory_id, reason,
                active.error)
    self._finish(active, reason)

  def _fail_group(self, group: _Group, reason: str, error: Exception) -> None:
    """Ends every member of a group that cannot start (no prompt): no tokens, reward 0."""
    text = _error_text(error)
    log.warning("task %d: its group ends with %s: %s", group.group_id, reason, text)
    width = sampling_mask_lib.packed_width(self.model.spec.vocab_size)
    for m in group.members:
      if m.env is not None:
        self._pool.submit(m.env.close)
        m.env = None
      none_i, none_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
      self._finished.append(Trajectory(
          trajectory_id=m.trajectory_id, group_id=group.group_id, member=m.member,
          seed=m.seed, task=group.task, tokens=none_i, loss_mask=none_f,
          sampler_logp=none_f.copy(), sampling_mask=np.zeros((0, width), np.uint8),
          policy_version=none_i.copy(), turn_index=none_i.copy(),
          replay=tuple({k: v.copy() for k, v in layer.items()} for layer in self._empty_replay),
          turn_spans=[], turn_end_reasons=[], process_signals=[], tool_infos=[], reward=0.0,
          end_reason=reason, temperature=self.spec.recorded_temperature, prompt_length=0,
          error=text))
    self._groups.remove(group)
    self._free_store_rows.append(group.store_row)

  def _finish(self, active: _Active, reason: str) -> None:
    active.end_reason = reason
    if active.cache_len < active.builder.length:
      active.state = SlotState.FLUSH
    else:
      self._finalize(active)

  def _finalize(self, active: _Active) -> None:
    g, m = active.group, active.member
    self._finished.append(active.builder.finish(
        trajectory_id=m.trajectory_id, group_id=g.group_id, member=m.member, seed=m.seed,
        task=g.task, reward=active.reward, end_reason=active.end_reason,
        temperature=self.spec.recorded_temperature, prompt_length=g.cache_len,
        error=active.error))
    self._pool.submit(m.env.close)
    m.env = None
    self._slots[active.slot] = None

  # -- device calls -------------------------------------------------------------------------

  def _prefill_once(self) -> bool:
    if not self._prefill_queue:
      return False
    t0, busy = time.perf_counter(), self._busy_slots()
    to_store = isinstance(self._prefill_queue[0], _Group)
    rows_total = self.spec.prompt_store_rows if to_store else self.spec.num_slots
    owners = [o for o in self._prefill_queue if isinstance(o, _Group) == to_store]
    owners = owners[:self.spec.prefill_rows]
    p, c = self.spec.prefill_rows, self.spec.prefill_chunk
    rows = [o.store_row if to_store else o.slot for o in owners]
    # Rows that sit the call out must be distinct from the working ones.
    rows += [r for r in range(rows_total) if r not in rows][:p - len(rows)]
    tokens = np.zeros((p, c), np.int32)
    positions = np.full((p, c), -1, np.int32)
    seeds = np.zeros(p, np.uint32)
    forced = np.full(p, -1, np.int32)
    counts = []
    for i, o in enumerate(owners):
      chunk = o.builder.tokens[o.cache_len:o.cache_len + c]
      tokens[i, :len(chunk)] = chunk
      positions[i, :len(chunk)] = np.arange(o.cache_len, o.cache_len + len(chunk))
      counts.append(len(chunk))
      if not to_store:
        seeds[i] = o.member.seed
        if o.cache_len + len(chunk) == o.builder.length and o.forced:
          forced[i] = o.forced.popleft()
    params, version = self._current_params()
    lengths = self._store_lengths if to_store else self._cache_lengths
    rows = np.asarray(rows, np.int32)
    new_cache, out = self.steps.prefill(params, self.store if to_store else self.cache,
                                        rows, tokens, positions, seeds, forced, lengths[rows])
    _advance_lengths(lengths, rows, positions)
    if to_store:
      self.store = new_cache
    else:
      self.cache = new_cache
    host = jax.device_get((out.sampled, out.replay))
    sampled, replay = host
    self.stats.prefill_calls += 1
    self.stats.prefill_rows_used += len(owners)
    self.stats.prefilled_tokens += sum(counts)
    for i, (o, n) in enumerate(zip(owners, counts)):
      o.builder.add_replay(replay, i, n)
      o.cache_len += n
      if o.cache_len < o.builder.length:
        continue
      self._prefill_queue.remove(o)
      if to_store:
        o.last_logits_v = out.last_logits_bv[i]
        o.ready = True
        self.stats.prompts_prefilled += 1
      else:
        o.builder.begin_turn()
        self._on_token(o, sampled.tokens_b[i], sampled.logp_b[i], sampled.mask_bw[i], version)
    self._account(t0, busy, "prefill_s")
    return True

  def _decode_once(self) -> bool:
    rows = [a for a in self._slots
            if a is not None and a.state in (SlotState.DECODE, SlotState.FLUSH)]
    if not rows:
      return False
    t0, busy = time.perf_counter(), self._busy_slots()
    s = self.spec.num_slots
    tokens = np.zeros(s, np.int32)
    positions = np.full(s, -1, np.int32)
    seeds = np.zeros(s, np.uint32)
    forced = np.full(s, -1, np.int32)
    for a in rows:
      tokens[a.slot] = a.builder.tokens[a.cache_len]
      positions[a.slot] = a.cache_len
      seeds[a.slot] = a.member.seed
      if a.state is SlotState.DECODE and a.forced:
        forced[a.slot] = a.forced.popleft()
    params, version = self._current_params()
    self.cache, out = self.steps.decode(params, self.cache, tokens, positions, seeds, forced,
                                        self._cache_lengths)
    _advance_lengths(self._cache_lengths, np.arange(s), positions[:, None])
    sampled, replay = jax.device_get((out.sampled, out.replay))
    self.stats.decode_steps += 1
    self.stats.decode_rows += len(rows)
    for a in rows:
      a.builder.add_replay(replay, a.slot, 1)
      a.cache_len += 1
      if a.state is SlotState.FLUSH:
        self._finalize(a)
      else:
        self._on_token(a, sampled.tokens_b[a.slot], sampled.logp_b[a.slot],
                       sampled.mask_bw[a.slot], version)
    self._account(t0, busy, "decode_s")
    return True

  # -- host waits, bookkeeping --------------------------------------------------------------

  def _wait_for_host(self) -> None:
    futures = [a.future for a in self._slots if a is not None and a.state is SlotState.ENV]
    futures += [f for g in self._groups if g.builder is None for f in g.reset_futures]
    pending = [f for f in futures if not f.done()]
    if not pending:
      return
    t0, busy = time.perf_counter(), self._busy_slots()
    concurrent.futures.wait(pending, timeout=1.0,
                            return_when=concurrent.futures.FIRST_COMPLETED)
    self._account(t0, busy, "env_wait_s")

  def _update_peak_kv(self) -> None:
    spec = self.model.spec
    live = sum(cache_lib.cache_bytes_per_sequence(spec, a.cache_len)
               for a in self._slots if a is not None)
    live += sum(cache_lib.cache_bytes_per_sequence(spec, g.cache_len)
                for g in self._groups if g.builder is not None)
    self.stats.peak_kv_bytes = max(self.stats.peak_kv_bytes, live)

  def _abandon(self) -> None:
    """Closes the environments of trajectories left unfinished (an error, or an early stop)."""
    envs = {}
    for a in self._slots:
      if a is not None and a.member.env is not None:
        envs[id(a.member.env)] = a.member.env
    for g in self._groups:
      if g.builder is None:  # Resets not harvested: close each env once its reset returns.
        for f in g.reset_futures:
          f.add_done_callback(_close_reset_env)
      else:
        for m in g.members[g.next_member:]:
          if m.env is not None:
            envs[id(m.env)] = m.env
    for env in envs.values():
      self._pool.submit(env.close)
    self._slots = [None] * self.spec.num_slots
    self._groups.clear()
    self._prefill_queue.clear()


def _advance_lengths(lengths_r, rows_b, positions_bt) -> None:
  """The host record of `cache_lib.new_lengths` after a call fed `positions_bt` to rows."""
  lengths_r[rows_b] = np.maximum(lengths_r[rows_b], positions_bt.max(axis=1) + 1)


def _close_reset_env(future: concurrent.futures.Future) -> None:
  if not future.cancelled() and future.exception() is None:
    (env, _), _ = future.result()
    env.close()
