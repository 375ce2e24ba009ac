"""The RL phase: score the starting point, then per step sample groups from the task pool
(dynamic sampling), learn on them, log, evaluate when due and checkpoint."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from agentic_rl.records.episode_shape import episode_shape
from agentic_rl.records.trajectory import to_batch
from agentic_rl.rl import dynamic_sampling
from agentic_rl.rl import task_selection
from agentic_rl.rl.train_step import TrainState
from agentic_rl.rollout import episodes
from agentic_rl.train import learner_lengths
from agentic_rl.train import reporting
from agentic_rl.train.curves import history_row
from agentic_rl.train.evaluation import episode_rates
from agentic_rl.train.evaluator import scalar_metrics
from agentic_rl.train.progress import Progress
from agentic_rl.train.run_context import RunContext
from agentic_rl.train.run_state import RunState


class RolloutGroups:
  """The rollout side of one RL step, for DynamicSampler: each task's group runs through
  the engine with seeds from (step, task number), so a resumed step samples the same."""

  def __init__(self, engine, tasks, step: int):
    self.engine = engine
    self.tasks = tasks
    self.step = step
    self.end_reasons: list[str] = []
    self.shapes: list[dict] = []  # Every sampled episode's (records/episode_shape.py).

  def generate(self, task_ids, group_size) -> list[dynamic_sampling.Group]:
    seeds = [self.step * 1_000_003 + self.tasks.number(t) for t in task_ids]
    trajs = self.engine.run([self.tasks.task(t) for t in task_ids], task_seeds=seeds)
    self.end_reasons.extend(t.end_reason for t in trajs)
    self.shapes.extend(episode_shape(t) for t in trajs)
    groups = []
    for g, task in enumerate(task_ids):
      members = [t for t in trajs if t.group_id == g]
      groups.append(dynamic_sampling.Group(task, np.asarray([m.reward for m in members]),
                                           members))
    return groups


def run_rl(ctx: RunContext, state: TrainState, run: RunState) -> TrainState:
  num_steps = int(ctx.config.rl.num_steps)
  state = ctx.state_io.place(state)
  _score_start(ctx, state, run)
  if run.rl_step < num_steps:
    # Every cache-length bucket compiles now, before the RL clock, not inside a step.
    route = ctx.routes.for_step(run.rl_step)
    # In the route's layout (a critic), as the step would adopt it; the step's is a no-op.
    state = ctx.state_io.place(route.adopt(state, ctx.config.seed))
    route.engine.set_params(route.sampler_params(state.params), run.rl_step)
    t0 = time.time()
    compiled = route.engine.warm_up()
    ctx.say(f"rollout steps compiled in {time.time() - t0:.1f}s ({compiled} programs)")
    t0 = time.time()
    _precompile_learner(ctx, route, state)
    ctx.say(f"learner steps compiled in {time.time() - t0:.1f}s (lengths "
            f"{', '.join(map(str, ctx.learner_lengths))})")
  pool = _task_pool(ctx, run)
  sampler = dynamic_sampling.DynamicSampler(pool)  # One per run: its estimate carries on.
  if run.sampler:
    sampler.load_state_dict(run.sampler)
  progress = Progress(run.rl_step, num_steps)
  while run.rl_step < num_steps and not ctx.stop.is_set():
    state, logged = _rl_step(ctx, sampler, state, run, num_steps)
    eta = progress.eta(run.rl_step)
    solve = (run.heldout_last or run.heldout_sft)["heldout/solve_rate"]
    ctx.say(f"rl {run.rl_step}/{num_steps} | reward {logged['rollout/reward_mean']:.3f} | "
            f"train solve {logged['rollout/solve_rate']:.3f} | held-out solve {solve:.3f} | "
            f"{logged['rollout/tokens_per_s']:.0f} tok/s | ETA {eta:.0f}s")
    if run.rl_step % ctx.train_spec.checkpoint_every == 0 or run.rl_step == num_steps:
      ctx.save(state, run)
      sampler.drop_carry()  # A run resumed from here starts with no carry either.
  if ctx.stop.is_set():
    ctx.save(state, run, force=True)
  return state


def _precompile_learner(ctx: RunContext, route, state) -> None:
  """Compiles the route's learner step for a batch of every learner length, shaped as a
  step's (this process's groups x group size rows, placed on the mesh): no RL step
  compiles its learner."""
  rows = ctx.train_spec.groups_per_step // ctx.info.process_count * route.rollout_spec.group_size
  for length in ctx.learner_lengths:
    placeholder = episodes.placeholder_trajectory(route.model.spec,
                                                  route.rollout_spec.temperature, length)
    with ctx.learning():
      route.train_step.precompile(state, ctx.place_rows(to_batch([placeholder] * rows)))


def _score_start(ctx: RunContext, state, run: RunState):
  """Scores the params RL starts from, once, so the summary compares like with like."""
  evaluator = ctx.evaluator
  if evaluator.same_settings(run.heldout_sft):
    return
  if run.rl_step > 0:  # Scored under other settings and RL has moved the params since.
    print("warning: the RL starting point was scored under other held-out settings "
          f"({reporting.eval_settings_text(run.heldout_sft)}) than this run's "
          f"({reporting.eval_settings_text(evaluator.settings())}) and RL has already moved "
          "the params, so it cannot be re-scored; the summary flags the comparison.",
          flush=True)
    return
  start = run.heldout_sft = evaluator.score(ctx.routes.for_step(0), state.params)
  ctx.logger.scalars(run.global_step, scalar_metrics(start, "heldout_sft/"))
  run.history.append(history_row(0, scalar_metrics(start)))  # Held-out keys only.
  ctx.say(f"held-out solve rate of the RL starting point: {start['heldout/solve_rate']:.3f} "
          f"± {start['heldout/solve_stderr']:.3f} ({start['heldout/episodes']} episodes, "
          f"{start['heldout/seconds']:.0f}s)")
  ctx.save(state, run, force=True)


def _task_pool(ctx: RunContext, run: RunState) -> task_selection.TaskPool:
  """The run's task pool over ctx.tasks, restored from `run` when resuming."""
  pool = task_selection.TaskPool(
      ctx.routes.for_step(run.rl_step).rl_spec, ctx.tasks,
      shard=(ctx.info.process_index, ctx.info.process_count),
      default_tier=ctx.env_spec.default_tier)
  if run.pool:
    pool.load_state_dict(run.pool)
    ctx.tasks.position.update(run.stream)
  return pool


def _rl_step(ctx: RunContext, sampler, state, run: RunState, num_steps: int
             ) -> tuple[TrainState, dict]:
  """One step: collect, learn, log, evaluate when due; returns the state and the logged
  metrics."""
  tc = ctx.train_spec
  step = run.rl_step
  route = ctx.routes.for_step(step)
  if step > 0 and ctx.routes.name_for_step(step - 1) != route.name:
    sampler.drop_carry()  # Groups the other route sampled carry its replay records.
  # At a stage switch: the new route's layout (route A adds a critic). Else a no-op.
  state = ctx.state_io.place(route.adopt(state, ctx.config.seed))
  t0 = time.time()
  trajs, numbers, outcome_rewards, rollout_logged = _collect(ctx, route, sampler, state, step)
  t1 = time.time()
  # Every process pads to one length: the smallest learner length that holds the longest
  # trajectory (each compiled before the RL clock; far less padding than max_len).
  # Each minibatch then runs cut to the learner length its own longest row needs.
  row_lengths = ctx.gather(np.asarray([t.length for t in trajs], np.int64))
  local_batch = to_batch(trajs, length=learner_lengths.bucket(int(row_lengths.max()),
                                                              ctx.learner_lengths))
  with ctx.learning():
    state, metrics = route.train_step(state, ctx.place_rows(local_batch), row_lengths)
  # Pinned to the rules' shardings (a no-op where the step kept them).
  state = ctx.state_io.place(state)
  metrics = jax.device_get(metrics)
  learner_s = time.time() - t1
  run.rl_step = step + 1
  # Generated tokens of the kept trajectories, every process's: the learner's loss tokens.
  kept_tokens = float(ctx.gather(np.asarray([sum(t.num_generated for t in trajs)],
                                            np.float64)).sum())
  rollout_s = rollout_logged["rollout/seconds"]
  logged = {**metrics, **rollout_logged,
            # Every episode sampled this step, the uniform groups dynamic sampling dropped
            # included; batch/* is the part the learner trained on.
            **episode_rates("rollout", outcome_rewards),
            **episode_rates("batch", ctx.gather(np.asarray([t.reward for t in trajs],
                                                           np.float64))),
            # Every sampled episode, dropped groups included: the sampler's throughput.
            "rollout/tokens_per_s": rollout_logged["rollout/generated_tokens"]
                                    / max(rollout_s, 1e-9),
            "rollout/trajectories_per_s": len(outcome_rewards) / max(rollout_s, 1e-9),
            "batch/generated_tokens": kept_tokens,
            "rollout/mean_length": float(np.mean([t.length for t in trajs])),
            "rollout/solve_stderr": reporting.solve_stderr_by_task(numbers, outcome_rewards),
            "learner/seconds": learner_s,
            "learner/padded_length": float(local_batch.length),
            "learner/generated_tokens_per_s": kept_tokens / max(learner_s, 1e-9),
            "stage/route_a": float(route.name == "A"),
            **reporting.tool_statistics(trajs)}
  if run.rl_step % tc.eval_every == 0 or run.rl_step == num_steps:
    run.heldout_last = ctx.evaluator.score(route, state.params)
    logged.update(scalar_metrics(run.heldout_last))
  logged = ctx.logger.scalars(run.global_step, logged)
  ctx.logger.episodes(run.global_step, sampler.source.shapes)
  run.history.append(history_row(run.rl_step, logged))
  run.rl_wall_seconds += time.time() - t0
  run.mismatch_kl.append(float(metrics.get("mismatch/k3", float("nan"))))
  if run.rl_step % tc.log_samples_every == 0:
    for t in trajs[:tc.num_samples_logged]:
      ctx.logger.text(run.global_step, "samples",
                      reporting.render_trajectory(ctx.tokenizer, t))
  run.pool, run.stream = sampler.selector.state_dict(), dict(ctx.tasks.position)
  run.sampler = sampler.state_dict()
  return state, logged


def _collect(ctx: RunContext, route, sampler, state, step: int):
  """(this process's trajectories, every process's sampled task numbers and rewards,
  rollout metrics): dynamic sampling until the step's groups are informative."""
  t0 = time.time()
  before = dataclasses.replace(route.engine.stats)
  pool = sampler.selector
  pool.rng = np.random.default_rng([ctx.config.seed, 11, step])
  route.engine.set_params(route.sampler_params(state.params), step)
  source = sampler.source = RolloutGroups(route.engine, ctx.tasks, step)
  groups, stats = sampler.collect(ctx.train_spec.groups_per_step // ctx.info.process_count)
  rollout_s = time.time() - t0
  trajs = [dataclasses.replace(t, group_id=ctx.info.process_index * len(groups) + g)
           for g, group in enumerate(groups) for t in group.payload]
  # Task numbers travel as int32: a float32 gather would round ids above 2^24.
  numbers = ctx.gather(np.asarray([ctx.tasks.number(t) for t, _ in pool.outcomes], np.int32))
  rewards = ctx.gather(np.asarray([r for _, r in pool.outcomes], np.float32))
  selection = pool.selection_stats()
  pool.apply([ctx.tasks.task_id(n) for n in numbers], list(rewards))
  pool.end_step()
  logged = {"rollout/seconds": rollout_s,
            "rollout/groups_dropped": stats.groups_dropped,
            # Uniform groups the batch took because too few informative ones came.
            "rollout/uninformative_filled": stats.uninformative_filled,
            # Informative groups the last step sampled beyond its batch, trained on here;
            # and those no batch takes (carry off, over its cap, or dropped at a checkpoint).
            "rollout/groups_carried": stats.carried_in,
            "rollout/informative_discarded": stats.informative_discarded,
            "rollout/informative_rate_estimate": sampler.informative_rate,
            "rollout/sampling_rounds": stats.rounds,
            "rollout/peak_kv_bytes": route.engine.stats.peak_kv_bytes,
            **_engine_time_split(route.engine.stats, before, ctx.gather),
            **_sampler_overflow(route.engine.stats, before),
            **reporting.end_reason_metrics(source.end_reasons, ctx.gather),
            **selection}
  return trajs, numbers, rewards, logged


# The engine's counters this step logs (RolloutStats fields), as rollout/<name>.
_ENGINE_COUNTERS = {"decode_s": "decode_seconds", "prefill_s": "prefill_seconds",
                    "fork_s": "fork_seconds", "env_wait_s": "env_wait_seconds", "host_s": "host_seconds",
                    "generated_tokens": "generated_tokens", "prefill_calls": "prefill_calls",
                    "decode_calls": "decode_calls", "prefilled_tokens": "prefilled_tokens",
                    "prefill_shape_tokens": "prefill_shape_tokens",
                    # Slot-seconds holding device work, of all slot-seconds: idle slots.
                    "busy_slot_s": "busy_slot_seconds", "slot_s": "slot_seconds"}


def _engine_time_split(stats, before, gather) -> dict:
  """This step's share of the engine's counters (RolloutStats): where the rollout time
  went (decode, prefill, forks into slots, waiting for environments, host bookkeeping) and what it made,
  every sampled episode included; summed over processes."""
  local = np.asarray([getattr(stats, k) - getattr(before, k) for k in _ENGINE_COUNTERS],
                     np.float64)
  totals = np.asarray(gather(local)).reshape(-1, len(_ENGINE_COUNTERS)).sum(0)
  out = {f"rollout/{name}": float(v) for name, v in zip(_ENGINE_COUNTERS.values(), totals)}
  # The share of what the prefill calls computed that was real tokens, not padding.
  shape = out["rollout/prefill_shape_tokens"]
  out["rollout/prefill_fill"] = out["rollout/prefilled_tokens"] / shape if shape else 0.0
  return out


def _sampler_overflow(stats, before) -> dict:
  """rollout/moe_overflow_frac: the share of this step's expert assignments the sampler's
  expert-parallel dispatch dropped over capacity ({} when none had a capacity)."""
  dropped = stats.dropped_assignments - before.dropped_assignments
  routed = stats.routed_assignments - before.routed_assignments
  if not routed:
    return {}
  return {"rollout/moe_dropped_assignments": float(dropped),
          "rollout/moe_overflow_frac": dropped / routed}
