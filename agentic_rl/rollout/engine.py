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
  5. runs one decode call over every slot that has a token to feed: up to
     `decode_steps_per_call` steps on the device, until every slot has stopped
     (one step while prefill work waits or a free slot could take a task).

A slot whose turn ends (stop id or max_new_tokens_per_turn) pauses while its
environment steps on a host thread; the other slots keep decoding. The
observation comes back as a tool turn plus the next assistant header, and is
chunk-prefilled into the same slot after the tokens already there: the
prefix is never prefilled again. A finished trajectory frees its slot at
once for the next ready prompt.

Environment protocol: `env_factory() -> env`; `env.reset(task) -> str`;
`env.step(action_text) -> StepResult(observation, reward, done, info)` with
info['process_signal'] and, when done, info['end_reason']; `env.close()`;
an optional `env.system_prompt` str and, read after reset, an optional `env.tools` list of
JSON tool schemas (for chat templates that render them). Rewards are summed over steps.

Text boundary: every observation and every action (decoded from the model, or a
teacher's) passes through `valid_text` before a tokenizer or an environment sees it,
so a lone surrogate becomes U+FFFD instead of an error.

Failures of one trajectory (an env's exception, a text that does not tokenize) end
only that trajectory, or its group when they hit the shared prompt; see turns.py.

Teacher forcing (optional): `teacher_factory(task) -> teacher` with
`teacher.act(observation) -> str`; each model turn then feeds the teacher's
text (+ end_turn) instead of drawing, recording the model's log-prob of it.
Used to benchmark with real trajectory lengths and to record demonstrations.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import numpy as np

from agentic_rl.model import cache as cache_lib
from agentic_rl.model import transformer
from agentic_rl.records.trajectory import Trajectory, TrajectoryBuilder
from agentic_rl.rollout import config as config_lib
from agentic_rl.rollout import device_batch
from agentic_rl.rollout import episodes
from agentic_rl.rollout import prefill_shapes
from agentic_rl.rollout import sampling
from agentic_rl.rollout.device_steps import DeviceSteps
from agentic_rl.rollout.engine_stats import RolloutStats
from agentic_rl.rollout.env_threads import (close_unfinished, create_and_reset, take_resets,
                                          timed)
from agentic_rl.rollout.episodes import DEVICE_READY, Active, Group, Member, SlotState
from agentic_rl.rollout.turns import TrajectoryTurns
from agentic_rl.rollout.valid_text import valid_text


class RolloutEngine(TrajectoryTurns):
  """Continuous batching of multi-turn tool-use trajectories; see the module docstring.

  The scheduler lives here: slots, groups, prompt-store rows and the device calls;
  what happens to one trajectory between those calls is its base, turns.TrajectoryTurns.
  """

  def __init__(self, model: transformer.Model, params, spec: config_lib.RolloutSpec,
               tokenizer, env_factory: Callable[[], Any], *, policy_version: int = 0,
               teacher_factory: Callable[[Any], Any] | None = None,
               steps: DeviceSteps | None = None, mesh=None):
    """steps: compiled device steps to share with other engines of the same model,
    sampling setting, chunk size and mesh (default: new ones). mesh: the devices to
    sample on, caches sharded by the rules (parallel/placement.sampler_mesh); None: one."""
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
    if steps is not None and mesh is None:
      mesh = steps.mesh
    chunks = prefill_shapes.chunk_sizes(spec)
    if steps is None:
      steps = DeviceSteps(model, sampling_params, chunks, mesh)
    elif (steps.model.spec != model.spec or steps.sampling_params != sampling_params
          or steps.chunks != chunks or steps.mesh != mesh):
      raise ValueError("the shared DeviceSteps were built for another model spec, sampling "
                       f"setting ({steps.sampling_params}), chunks ({steps.chunks}) or mesh; "
                       f"this engine needs {sampling_params} and chunks {chunks}.")
    self.steps = steps
    self.cache = steps.init_cache(spec.num_slots, spec.max_len)
    self.store = steps.init_cache(spec.prompt_store_rows, spec.max_len)
    # Host records of each row's cache length, kept apart from the trajectories' own
    # counts, so each device step checks its positions without reading the device.
    self._cache_lengths = np.zeros(spec.num_slots, np.int64)
    self._store_lengths = np.zeros(spec.prompt_store_rows, np.int64)
    self._layer_replay_keys = tuple(model.spec.replay_keys(i)
                                    for i in range(model.spec.num_layers))
    self._empty_replay = episodes.empty_replay(model.spec)
    self._stop_ids = frozenset(tokenizer.stop_ids)
    self._is_stop_v = np.zeros(model.spec.vocab_size, bool)
    self._is_stop_v[list(self._stop_ids)] = True
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
    self._slots: list[Active | None] = [None] * spec.num_slots
    self._groups: collections.deque[Group] = collections.deque()  # Oldest first.
    self._free_store_rows = list(range(spec.prompt_store_rows))
    self._prefill_queue: collections.deque = collections.deque()  # Active or Group
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
        self._account(t0, busy, "fork_s")
        did_work = self._prefill_once()
        did_work |= self._decode_once()
        t0, busy = time.perf_counter(), self._busy_slots()
        self._update_peak_kv()
        self._account(t0, busy, "host_s")
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

  def warm_up(self) -> int:
    """Compiles every step a run can ask for now (prefill into the slots and the prompt
    store, decode, at every cache length bucket), so none compiles mid-run; needs params
    (set_params). Returns the compilations it made."""
    params, _ = self._current_params()
    if params is None:
      raise ValueError("warm_up needs params: call set_params first.")
    before = self.steps.num_traces
    rows = prefill_shapes.row_counts(self.spec)
    self.cache = self.steps.warm_up(params, self.cache, prefill_rows=rows,
                                    decode_steps=self.spec.decode_steps_per_call)
    self.store = self.steps.warm_up(params, self.store, prefill_rows=rows)
    return self.steps.num_traces - before

  def compiled_step_count(self) -> int:
    """Traces of the jitted steps so far (each trace is one compilation)."""
    return self.steps.num_traces

  # -- scheduling ---------------------------------------------------------------------------

  def _busy_slots(self) -> int:
    return sum(1 for a in self._slots if a is not None and a.state in DEVICE_READY)

  def _account(self, t0: float, busy: int, bucket: str) -> None:
    self.stats.add_time(bucket, time.perf_counter() - t0, busy,
                        self._all_slots_filled and self._tasks_left)

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
    members = [Member(trajectory_id=index * g + m, member=m,
                      seed=episodes.member_seed(self.spec.seed, task_seed, m))
               for m in range(g)]
    row = self._free_store_rows.pop(0)
    futures = [self._pool.submit(timed, create_and_reset, self.env_factory, task)
               for _ in members]
    self._groups.append(Group(group_id=index, task=task, task_seed=task_seed,
                              members=members, store_row=row, reset_futures=futures))

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

  def _on_group_reset(self, group: Group) -> None:
    failure = take_resets(group, self.stats)
    if failure is not None:
      self._fail_group(group, config_lib.END_ENV_ERROR, failure)
      return
    episodes.check_shared_prompt(group)
    first = group.members[0]
    system = getattr(first.env, "system_prompt", None) or self.spec.system_prompt
    try:
      turns = ([("system", valid_text(system))] if system else []) + \
          [("user", first.observation)]
      tools = getattr(first.env, "tools", None)  # Passed only when set: it is optional.
      prompt = self.tokenizer.render_conversation(
          turns, add_generation_prompt=True, **({"tools": tools} if tools else {}))
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
    self.store = self.steps.reset_rows(self.store, reset)
    self._store_lengths[group.store_row] = 0
    self._prefill_queue.append(group)

  def _fill_slots(self) -> None:
    """Forks a ready group's next member into each free slot. The forks queue on the
    device back to back, and their first draws come back in one transfer: one wait for
    the host per pass, not one per slot."""
    forked = []
    for slot in range(self.spec.num_slots):
      if self._slots[slot] is not None:
        continue
      group = next((g for g in self._groups if g.ready and g.next_member < len(g.members)),
                   None)
      if group is None:
        break
      fork = self._fork_into(slot, group)
      if fork is not None:
        forked.append(fork)
    if not forked:
      return
    draws = jax.device_get([sampled for _, sampled, _ in forked])
    for (active, _, version), sampled in zip(forked, draws):
      active.builder.begin_turn()
      self._on_token(active, sampled.tokens_b[0], sampled.logp_b[0], sampled.mask_bw[0],
                     version)

  def _fork_into(self, slot: int, group: Group):
    """Starts the fork of `group`'s next member into `slot`: (active, its first draw on
    the device, the params version), or None when the member ended before drawing."""
    member = group.members[group.next_member]
    group.next_member += 1
    active = Active(slot=slot, group=group, member=member, builder=group.builder.copy(),
                    cache_len=group.cache_len)
    self._slots[slot] = active
    if group.next_member == len(group.members):  # Every member has its copy.
      self._groups.remove(group)
      self._free_store_rows.append(group.store_row)
    if member.teacher is not None and not self._queue_teacher_turn(active, member.observation):
      return None  # Ended with its prompt alone: the teacher's first action did not tokenize.
    forced = active.forced.popleft() if active.forced else -1
    self.steps.check_forced(np.asarray([forced]))
    _, version = self._current_params()
    # numpy scalars travel with the call; jnp scalars would each be a device op first.
    self.cache, sampled = self.steps.fork(
        self.cache, self.store, np.int32(group.store_row), np.int32(slot),
        group.last_logits_v, np.uint32(member.seed), np.int32(group.cache_len - 1),
        np.int32(forced))
    self._cache_lengths[slot] = self._store_lengths[group.store_row]
    self.stats.forks += 1
    return active, sampled, version

  def _current_params(self):
    with self._params_lock:
      return self._params, self._version

  # -- device calls -------------------------------------------------------------------------

  def _prefill_once(self) -> bool:
    if not self._prefill_queue:
      return False
    t0, busy = time.perf_counter(), self._busy_slots()
    batch = device_batch.prefill_batch(self._prefill_queue, self.spec)
    params, version = self._current_params()
    to_store, rows = batch.to_store, batch.rows_p
    lengths = self._store_lengths if to_store else self._cache_lengths
    new_cache, out = self.steps.prefill(
        params, self.store if to_store else self.cache, rows, batch.tokens_pc,
        batch.positions_pc, batch.seeds_p, batch.forced_p, lengths[rows])
    device_batch.advance_lengths(lengths, rows, batch.positions_pc)
    if to_store:
      self.store = new_cache
    else:
      self.cache = new_cache
    sampled, replay, overflow = jax.device_get((out.sampled, out.replay, out.overflow))
    self.stats.add_overflow(overflow)
    self.stats.prefill_calls += 1
    self.stats.prefill_rows_used += len(batch.owners)
    self.stats.prefilled_tokens += sum(batch.counts)
    self.stats.prefill_shape_tokens += batch.tokens_pc.size
    for i, (o, n) in enumerate(zip(batch.owners, batch.counts)):
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
    tokens, positions, seeds, forced, budget = device_batch.decode_inputs(rows, self.spec)
    params, version = self._current_params()
    # Work that could use the device soon (a prefill waiting, a free slot while tasks are
    # left) gets it after one step, as before the loop existed; otherwise slots run on.
    filling = any(a is None for a in self._slots) and (self._tasks_left or self._groups)
    max_steps = 1 if self._prefill_queue or filling else self.spec.decode_steps_per_call
    self.cache, out = self.steps.decode(params, self.cache, tokens, positions, seeds, forced,
                                        self._cache_lengths, budget_b=budget,
                                        is_stop_v=self._is_stop_v, max_steps=max_steps)
    out = jax.device_get(out)
    drawn = out.drawn_b
    self._cache_lengths += drawn  # Each draw fed one token first.
    self.stats.add_overflow(out.overflow)
    self.stats.decode_calls += 1
    self.stats.decode_steps += int(out.steps)
    self.stats.decode_rows += int(drawn.sum())
    for a in rows:
      n = int(drawn[a.slot])
      a.builder.add_replay(out.replay, a.slot, n)
      a.cache_len += n
      if a.state is SlotState.FLUSH:
        self._finalize(a)
        continue
      for _ in range(min(n, len(a.forced))):
        a.forced.popleft()
      for i in range(n):  # The device stopped the row where the host's rules end its turn.
        if a.state is not SlotState.DECODE:
          raise RuntimeError(f"slot {a.slot}: the decode call drew {n} tokens, but the turn "
                             f"ended after {i}: the device and host stop rules disagree.")
        self._on_token(a, out.tokens_nb[i, a.slot], out.logp_nb[i, a.slot],
                       out.mask_nbw[i, a.slot], version)
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
    close_unfinished(self._slots, self._groups, self._pool)
    self._slots = [None] * self.spec.num_slots
    self._groups.clear()
    self._prefill_queue.clear()

