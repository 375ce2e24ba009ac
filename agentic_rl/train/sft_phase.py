"""The SFT phase: imitate the env's scripted expert, optionally stop on a validation
plateau, then hand over to RL with a fresh optimiser state."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.rl import train_step as train_step_lib
from agentic_rl.rl.train_step import TrainState
from agentic_rl.train import distributed
from agentic_rl.train import sft as sft_lib
from agentic_rl.train.progress import Progress
from agentic_rl.train.run_context import RunContext
from agentic_rl.train.run_state import RunState
from agentic_rl.train.state_io import with_reference


def run_sft(ctx: RunContext, state: TrainState, run: RunState) -> TrainState:
  """Trains until config.train.sft_steps (or a plateau, or SIGTERM); returns the state RL
  starts from, with run.phase set to "rl" once handed over."""
  if run.phase != "sft":
    return state
  tc = ctx.train_spec
  route = ctx.routes.for_step(0)
  optimizer = train_step_lib.make_optimizer(sft_lib.sft_learner_spec(route.rl_spec, tc))
  if run.sft_step == 0:
    state = state.replace(opt_state=optimizer.init(state.params))
  state = ctx.state_io.place(state)
  arrays, length = _demonstration_arrays(ctx, route, state)
  step_fn = sft_lib.make_sft_step(route.model, optimizer, donate=True)
  plateau = _plateau(ctx, route, length) if tc.sft_eval_every else None
  if plateau is not None:
    plateau.load_state_dict(run.sft_plateau)
  progress = Progress(run.sft_step, tc.sft_steps)
  while run.sft_step < tc.sft_steps and not ctx.stop.is_set():
    state, plateaued = _sft_step(ctx, step_fn, state, arrays, plateau, run, progress)
    if plateaued:
      break
  if ctx.stop.is_set():
    ctx.save(state, run, force=True)
    return state
  if plateau is not None and plateau.best_params is not None:
    state = state.replace(params=plateau.best_params)
    run.sft_best_step = plateau.best_step
    ctx.say(f"SFT stopped at step {run.sft_step} (validation plateau); keeping the params "
            f"of step {plateau.best_step}, validation nll {plateau.best_nll:.4f}")
  # Hand over to RL: a fresh RL optimiser state; the KL reference is the SFT policy.
  state = with_reference(state.replace(
      opt_state=train_step_lib.make_optimizer(route.rl_spec).init(state.params),
      step=jnp.zeros((), jnp.int32), skipped_steps=jnp.zeros((), jnp.int32)))
  run.phase = "rl"
  # Saved before RL scores its start point: a kill during that evaluation resumes here,
  # not in SFT (RL's first save after the score replaces this one).
  ctx.save(state, run, force=True)
  return state


def _demonstration_arrays(ctx: RunContext, route, state) -> tuple[dict, int]:
  """This process's share of the expert's demonstrations as padded arrays, and the
  length every process pads to (the batch is one global array)."""
  tc = ctx.train_spec
  indices = distributed.shard_indices(tc.sft_demos, ctx.info)
  tasks = [ctx.train_source[i] for i in indices]
  every = sft_lib.recovery_flags(tc.sft_demos, tc.sft_recovery_share, ctx.config.seed)
  recovery = [every[i] for i in indices]
  plays = dict(play_expert=ctx.env_family.play_expert,
               play_recovery=ctx.env_family.play_recovery)
  t0 = time.time()
  demos = sft_lib.render_demonstrations(ctx.tokenizer, route.rollout_spec, ctx.env_factory,
                                        tasks, route.rollout_spec.system_prompt,
                                        recovery=recovery, **plays)
  long_idx = [i for i, d in enumerate(demos) if d is None]
  if long_idx:  # An action over max_new_tokens_per_turn: the engine truncates it as RL would.
    recorded = sft_lib.record_demonstrations(
        route.model, route.sampler_params(state.params), route.rollout_spec, ctx.tokenizer,
        ctx.env_factory, [tasks[i] for i in long_idx], steps=route.engine.steps,
        recovery=[recovery[i] for i in long_idx], **plays)
    for i, d in zip(long_idx, recorded):
      demos[i] = d
  longest = int(ctx.gather(np.asarray([max(d.length for d in demos)], np.int64)).max())
  length = sft_lib.padded_length(longest, route.rollout_spec.max_len)
  ctx.say(f"SFT: {len(demos)} expert demonstrations, {sum(recovery)} of them recovery "
          f"plays, in {time.time() - t0:.1f}s (mean "
          f"{np.mean([d.length for d in demos]):.0f} tokens, padded to {length}; "
          f"{len(long_idx)} with an action over max_new_tokens_per_turn, recorded through "
          "the engine)")
  return sft_lib.demonstration_arrays(demos, length), length


def _plateau(ctx: RunContext, route, length: int) -> sft_lib.PlateauStop:
  """The plateau stop, scoring demonstrations of train tasks the SFT set does not hold."""
  tc = ctx.train_spec
  tasks = [ctx.train_source[tc.sft_demos + i] for i in range(tc.sft_validation_demos)]
  # The same share of recovery plays as the training set: the plateau tracks what trains.
  demos = sft_lib.render_demonstrations(
      ctx.tokenizer, route.rollout_spec, ctx.env_factory, tasks,
      route.rollout_spec.system_prompt, play_expert=ctx.env_family.play_expert,
      play_recovery=ctx.env_family.play_recovery,
      recovery=sft_lib.recovery_flags(len(tasks), tc.sft_recovery_share, ctx.config.seed + 1))
  demos = [d for d in demos if d is not None]
  arrays = {k: jnp.asarray(v) for k, v in sft_lib.demonstration_arrays(demos, length).items()}
  score = jax.jit(lambda p: sft_lib.demonstration_scores(route.model, p, arrays))
  return sft_lib.PlateauStop(score, patience=tc.sft_patience, min_delta=tc.sft_min_delta)


def _sft_step(ctx: RunContext, step_fn, state, arrays, plateau, run: RunState,
              progress: Progress) -> tuple[TrainState, bool]:
  """One SFT step on rows drawn from (seed, step); logs, scores the plateau when due and
  checkpoints. True when the plateau says stop."""
  tc = ctx.train_spec
  s = run.sft_step
  rng = np.random.default_rng([ctx.config.seed, 7, s])
  local_batch = tc.sft_batch_size // ctx.info.process_count
  num_demos = len(arrays["tokens_bt"])
  rows = rng.choice(num_demos, size=local_batch, replace=num_demos < local_batch)
  local = {k: v[rows] for k, v in arrays.items()}
  t0 = time.time()
  with ctx.learning():
    state, metrics = step_fn(state, ctx.place_rows(local))
  state = ctx.state_io.place(state)
  metrics = jax.device_get(metrics)
  run.sft_step = s + 1
  ctx.logger.scalars(run.sft_step, metrics)
  # With a plateau stop the phase may end sooner: the ETA is then an upper bound.
  bound = "<=" if plateau is not None else ""
  ctx.say(f"sft {s + 1}/{tc.sft_steps} | loss {metrics['sft/loss']:.3f} | "
          f"acc {metrics['sft/token_accuracy']:.3f} | {time.time() - t0:.2f}s | "
          f"ETA {bound}{progress.eta(run.sft_step):.0f}s")
  plateaued = False
  if plateau is not None and run.sft_step % tc.sft_eval_every == 0:
    plateaued = plateau.score(run.sft_step, state.params)
    run.sft_plateau = plateau.state_dict()
    ctx.logger.scalars(run.sft_step, {"sft/validation_nll": plateau.last_nll,
                                      "sft/validation_token_accuracy": plateau.last_accuracy})
    ctx.say(f"sft {run.sft_step}: validation nll {plateau.last_nll:.4f} (best "
            f"{plateau.best_nll:.4f} at step {plateau.best_step}), token accuracy "
            f"{plateau.last_accuracy:.3f}")
  if run.sft_step % tc.checkpoint_every == 0 or plateaued:
    ctx.save(state, run, force=plateaued)
  return state, plateaued
