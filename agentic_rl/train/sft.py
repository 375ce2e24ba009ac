"""SFT warm start: the scripted expert's episodes as token sequences.

`render_demonstrations` lays each expert episode out with the rollout engine's
rules (prompt, then per turn: action + end_turn with loss mask 1, observation turn +
generation prompt with mask 0; the same turn and token budgets). It needs no
model, so it is fast; `record_demonstrations` teacher-forces the same actions
through the engine itself (ReplayTeacher) and is the reference the renderer is
tested against token for token.
The loss is next-token cross-entropy on the model's own tokens (loss mask 1).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from agentic_rl.parallel import placement
from agentic_rl.rl import logprobs as logprobs_lib
from agentic_rl.rl import train_step as train_step_lib
from agentic_rl.rl.train_step import TrainState
from agentic_rl.rollout import engine as engine_lib
from agentic_rl.rollout import teacher as teacher_lib
from agentic_rl.records.trajectory import Trajectory
from agentic_rl.rollout.valid_text import valid_text


def sft_learner_spec(rl_spec, train_spec):
  """The learner spec of the SFT phase: config.train.sft_optim over sft_steps updates."""
  return rl_spec.replace(optim=train_spec.sft_optim, num_steps=train_spec.sft_steps,
                         ppo_epochs=1, minibatches=1)


def record_demonstrations(model, params, rollout_spec, tokenizer, env_factory, tasks, *,
                          play_expert, steps=None, play_recovery=None,
                          recovery: Sequence[bool] = ()) -> list[Trajectory]:
  """One teacher-forced trajectory per task, replaying the actions of the env's expert
  (`play_expert(env, task)`, registry.EnvFamily.play_expert), or of its recovery play
  where `recovery[i]` (the deliberate mistake's tokens then carry no loss)."""
  # One demonstration per task: G identical teacher-forced copies would teach nothing more.
  rollout_spec = dataclasses.replace(rollout_spec, group_size=1)
  episodes = teacher_lib.play_on_fresh_envs(
      list(enumerate(tasks)), env_factory,
      lambda env, item: _player(item[0], play_expert, play_recovery, recovery)(env, item[1]))
  by_task = {id(task): [action for action, _ in e.turns] for task, e in zip(tasks, episodes)}
  no_loss = {id(task): _no_loss_turns(e) for task, e in zip(tasks, episodes)}
  engine = engine_lib.RolloutEngine(
      model, params, rollout_spec, tokenizer, env_factory, steps=steps,
      teacher_factory=lambda task: teacher_lib.ReplayTeacher(by_task[id(task)]))
  try:
    trajectories = engine.run(tasks)
  finally:
    engine.close()
  for t in trajectories:  # Turn k's action tokens carry turn index k.
    for k in no_loss[id(t.task)]:
      t.loss_mask[t.turn_index == k] = 0.0
  return trajectories


def _player(i: int, play_expert, play_recovery, recovery: Sequence[bool]):
  if i < len(recovery) and recovery[i]:
    if play_recovery is None:
      raise ValueError("recovery demonstrations were asked for (config.train."
                       "sft_recovery_share > 0) but the env has no recovery play.")
    return play_recovery
  return play_expert


def _no_loss_turns(episode) -> tuple[int, ...]:
  return tuple(getattr(episode, "no_loss_turns", ()))


def recovery_flags(num_tasks: int, share: float, seed: int) -> list[bool]:
  """Which of `num_tasks` demonstrations are recovery plays: round(share * num_tasks) of
  them, spread by a seeded permutation (the same for every process)."""
  count = int(round(share * num_tasks))
  order = np.random.default_rng([seed, 13]).permutation(num_tasks)
  return (order < count).tolist()


@dataclasses.dataclass(frozen=True)
class Demonstration:
  tokens: np.ndarray  # int32 [T]
  loss_mask: np.ndarray  # float32 [T], 1 on the model's (the expert's) tokens

  @property
  def length(self) -> int:
    return int(self.tokens.shape[0])


def render_demonstration(tokenizer, rollout_spec, first_observation: str,
                         turns: Sequence[tuple[str, str]], system_prompt: str = "",
                         tools=None, no_loss_turns: Sequence[int] = ()
                         ) -> Demonstration | None:
  """One expert episode with the engine's token layout; None if the engine would cut an action.

  An action longer than max_new_tokens_per_turn would be truncated before the env saw it, so
  the recorded observations would no longer follow: such episodes are not demonstrations.
  The actions of `no_loss_turns` (indices into `turns`) get loss mask 0.
  """
  spec = rollout_spec
  # The engine's text boundary: what it would feed the tokenizer (no lone surrogates).
  prompt_turns = ([("system", valid_text(system_prompt))] if system_prompt else []) + \
      [("user", valid_text(first_observation))]
  tokens = list(tokenizer.render_conversation(prompt_turns, add_generation_prompt=True,
                                              **({"tools": tools} if tools else {})))
  mask = [0.0] * len(tokens)
  limit = spec.token_limit
  if len(tokens) + 1 > limit:
    raise ValueError(f"the prompt has {len(tokens)} tokens, leaving no room for a generated "
                     f"token within {limit} ({spec.token_limit_reason}).")
  for n, (action, observation) in enumerate(turns, 1):
    ids = list(tokenizer.encode(valid_text(action), parse_special=True)) + \
        [tokenizer.end_turn_id]
    if len(ids) > spec.max_new_tokens_per_turn:
      return None
    taught = 0.0 if n - 1 in no_loss_turns else 1.0
    for i, tok in enumerate(ids):
      tokens.append(tok)
      mask.append(taught)
      if i + 1 < len(ids) and len(tokens) >= limit:  # The engine ends mid-turn here.
        return Demonstration(np.asarray(tokens, np.int32), np.asarray(mask, np.float32))
    last = n == len(turns)  # The expert's last action ends the episode (submit).
    if last or n >= spec.max_turns:
      break
    context = (list(tokenizer.observation_turn(valid_text(observation)))
               + tokenizer.generation_prompt())
    if len(tokens) + len(context) + 1 > limit:
      break
    tokens.extend(context)
    mask.extend([0.0] * len(context))
  return Demonstration(np.asarray(tokens, np.int32), np.asarray(mask, np.float32))


def render_demonstrations(tokenizer, rollout_spec, env_factory, tasks, system_prompt: str = "",
                          *, play_expert, play_recovery=None, recovery: Sequence[bool] = ()
                          ) -> list[Demonstration | None]:
  """The expert plays every task on fresh envs (its recovery play where `recovery[i]`);
  None where an action exceeds the turn's cap (the engine would truncate it: record those
  with `record_demonstrations`)."""
  def play(env, item):
    i, task = item
    r = _player(i, play_expert, play_recovery, recovery)(env, task)
    prompt = getattr(env, "system_prompt", None) or system_prompt
    return render_demonstration(tokenizer, rollout_spec, r.first_observation, r.turns, prompt,
                                getattr(env, "tools", None), _no_loss_turns(r))

  return teacher_lib.play_on_fresh_envs(list(enumerate(tasks)), env_factory, play)


def padded_length(longest: int, max_len: int, multiple: int = 64) -> int:
  """The SFT batch length: the longest demonstration rounded up to `multiple`, at most
  `max_len`. One length for the whole phase (one compile) instead of the cache capacity;
  padding is masked out of the loss, so only the time per step changes."""
  if longest <= 0 or max_len <= 0 or multiple <= 0:
    raise ValueError(f"padded_length: longest={longest}, max_len={max_len}, "
                     f"multiple={multiple}: expected positive integers")
  return min(max_len, -(-longest // multiple) * multiple)


def demonstration_arrays(trajectories: Sequence[Trajectory | Demonstration], length: int
                         ) -> dict:
  """Pads demonstrations to `length`: tokens, positions (-1 on padding), loss mask."""
  b = len(trajectories)
  tokens = np.zeros((b, length), np.int32)
  positions = np.full((b, length), -1, np.int32)
  loss_mask = np.zeros((b, length), np.float32)
  for i, t in enumerate(trajectories):
    n = min(t.length, length)
    tokens[i, :n] = t.tokens[:n]
    positions[i, :n] = np.arange(n)
    loss_mask[i, :n] = t.loss_mask[:n]
  return {"tokens_bt": tokens, "positions_bt": positions, "loss_mask_bt": loss_mask}


def demonstration_losses(model, params, batch):
  """(mean NLL, token accuracy, moe aux loss) of next-token prediction on the loss-masked
  (the model's own) tokens of a padded demonstration batch."""
  tokens_bt = batch["tokens_bt"]
  ones_b = jnp.ones(tokens_bt.shape[:1], jnp.float32)
  # Target aligned: [b, t] scores token t from position t - 1; column 0 scores nothing.
  logp_bt, _, hit_bt, aux = logprobs_lib.scored_forward(model, params, tokens_bt,
                                                        batch["positions_bt"], ones_b)
  # The loss counts tokens the model itself emits.
  mask_bt = batch["loss_mask_bt"].at[:, 0].set(0.0)
  denom = jnp.maximum(mask_bt.sum(), 1.0)
  loss = -(jnp.where(mask_bt > 0, logp_bt, 0.0)).sum() / denom
  accuracy = (hit_bt * mask_bt).sum() / denom
  return loss, accuracy, aux["moe_aux_loss"]


def demonstration_scores(model, params, batch):
  """(NLL, token accuracy) on held-out demonstrations: SFT's plateau signal."""
  loss, accuracy, _ = demonstration_losses(model, params, batch)
  return loss, accuracy


def make_sft_step(model, optimizer: optax.GradientTransformation, *, donate: bool = False):
  """A jitted `step(state, batch) -> (state, metrics)` of masked next-token cross-entropy.
  With `donate` the state passed in is spent (train_step.jit_donating_state)."""

  def loss_fn(params, batch):
    loss, accuracy, moe_aux = demonstration_losses(model, params, batch)
    return loss + moe_aux, {"sft/loss": loss, "sft/token_accuracy": accuracy,
                            "sft/moe_aux_loss": moe_aux}

  def step(state: TrainState, batch):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(metrics["sft/loss"]) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = state.replace(step=state.step + 1, params=keep(params, state.params),
                              opt_state=keep(opt_state, state.opt_state),
                              skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32))
    return new_state, {**metrics, "sft/grad_norm": grad_norm}

  return train_step_lib.jit_donating_state(step, donate=donate)


class PlateauStop:
  """Stops SFT when the validation NLL has not improved by `min_delta` in `patience`
  scores; remembers the best params (on the host, so later steps cannot donate them)."""

  def __init__(self, score_fn, *, patience: int, min_delta: float):
    self._score_fn, self.patience, self.min_delta = score_fn, patience, min_delta
    self.best_nll, self.best_step, self.best_params = float("inf"), 0, None
    self.last_nll = self.last_accuracy = float("nan")
    self.since_best = 0

  def score(self, step: int, params) -> bool:
    """Scores `params` at `step`; True when SFT should stop."""
    nll, accuracy = (float(x) for x in self._score_fn(params))
    self.last_nll, self.last_accuracy = nll, accuracy
    if nll < self.best_nll - self.min_delta:
      self.best_nll, self.best_step, self.since_best = nll, step, 0
      self.best_params = placement.to_host(params)
    else:
      self.since_best += 1
    return self.since_best >= self.patience

  def state_dict(self) -> dict:
    return {"best_nll": self.best_nll, "best_step": self.best_step,
            "since_best": self.since_best}

  def load_state_dict(self, state: dict | None) -> None:
    if state:  # The best params of a resumed run are those of its checkpoint's lineage.
      self.best_nll, self.best_step = state["best_nll"], state["best_step"]
      self.since_best = state["since_best"]
