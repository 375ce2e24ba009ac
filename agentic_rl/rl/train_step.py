"""The learner's step on one rollout batch: PPO epochs of jitted minibatch updates, each with
micro-batch accumulation, AdamW, clipping and a non-finite guard.

    spec = rl_config.validate(cfg.rl, cfg.model)
    state = init_train_state(model, params, spec, ref_params=None)
    train_step = make_train_step(model, spec)
    state, metrics = train_step(state, batch)

With config.rl.ppo_epochs x config.rl.minibatches > 1, the step first scores the batch
with the params it starts from (learner.with_old_policy: the old policy, unless the
sampler's log-probs serve as it, and the KL reference once), computes group advantages
on the whole batch, then runs ppo_epochs passes,
each over `minibatches` shuffled row subsets (`minibatch_rows`), each cut to the learner
length its own rows need (`minibatch_length`); the learning-rate schedule counts rollout
batches, not updates. Metrics are means over the updates, with clip_frac of the first and
last epoch beside them. With one update per batch the step is one jitted update, as below.

Order inside one update:
  1. group advantages on the whole batch (GAE is computed per micro-batch, it
     needs the critic and no cross-sequence statistics);
  2. loss and gradient per micro-batch (lax.scan), summed; every micro-batch
     loss is normalised by whole-batch denominators, so the sum is the
     full-batch gradient;
  3. global-norm clipping and AdamW (warmup then cosine decay; no decay on vectors);
  4. if the loss or the gradient is not finite: keep params and optimiser state,
     count the skip in state.skipped_steps;
  5. the aux-loss-free routing-bias update (model.moe.use_routing_bias), outside
     the gradient, from the step's mean expert load.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from agentic_rl.model import transformer
from agentic_rl.rl import advantages as adv_lib
from agentic_rl.rl import learner
from agentic_rl.rl import mismatch
from agentic_rl.rl import objectives
from agentic_rl.records.batch import Batch
from agentic_rl.rl.config import RLSpec


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # train_step calls, int32
  params: Any
  opt_state: Any
  ref_params: Any  # frozen reference policy (KL), or None
  skipped_steps: jax.Array  # updates skipped by the non-finite guard, int32


def learning_rate_schedule(spec: RLSpec) -> optax.Schedule:
  """Linear warmup to learning_rate, then cosine decay to end_lr_ratio * it, over rollout
  batches (optim.decay_steps, 0 = the phase's num_steps): every update of one batch's PPO
  epochs gets that batch's rate. Batch n (1-based) gets learning_rate * n / warmup_steps
  while n <= warmup_steps, so the first batch learns (never a rate of 0), the peak comes
  at batch warmup_steps and the last batch of the schedule gets the end rate."""
  o = spec.optim
  warmup = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.learning_rate, warmup_steps=o.warmup_steps,
      decay_steps=o.schedule_steps(spec.num_steps), end_value=o.learning_rate * o.end_lr_ratio)
  per_batch = lambda count: warmup(count + 1)
  if spec.updates_per_step == 1:
    return per_batch
  return lambda count: per_batch(count // spec.updates_per_step)


def weight_decay_mask(params):
  """Decay matrices only: not norm scales, biases or routing biases (vectors)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(spec: RLSpec) -> optax.GradientTransformation:
  o = spec.optim
  parts = []
  if o.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(o.clip_norm))
  parts.append(optax.adamw(learning_rate_schedule(spec), b1=o.b1, b2=o.b2, eps=o.eps,
                           weight_decay=o.weight_decay, mask=weight_decay_mask))
  return optax.chain(*parts)


def init_train_state(model, params, spec: RLSpec, ref_params=None) -> TrainState:
  if spec.loss.kl_coef > 0 and ref_params is None:
    raise ValueError("config.rl.loss.kl_coef > 0 needs ref_params (the frozen reference "
                     "policy, e.g. a copy of the initial params).")
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=make_optimizer(spec).init(params), ref_params=ref_params,
                    skipped_steps=jnp.zeros((), jnp.int32))


def _split_micro_batches(tree, num_micro_batches: int):
  def split(x):
    return x.reshape((num_micro_batches, x.shape[0] // num_micro_batches) + x.shape[1:])
  return jax.tree.map(split, tree)


def _finalize_metrics(sums, norms, grad_norm, finite, state, lr):
  n_tok = norms.num_tokens
  n_seq = norms.num_sequences
  metrics = {k: sums[k] for k in ("loss", "pg_loss", "entropy", "moe_aux_loss")}
  for k in ("value_loss", "kl_to_ref"):
    if k in sums:
      metrics[k] = sums[k]
  metrics.update({
      "clip_frac": sums["clipped_count"] / n_tok,
      "ppo_ratio_mean": sums["ppo_ratio_sum"] / n_tok,
      "advantage_mean": sums["advantage_sum"] / n_tok,
      "reward_mean": sums["reward_sum"] / n_seq,
      "correction/weight_mean": sums["corr_weight_sum"] / n_tok,
      "correction/rejected_frac": sums["corr_rejected_count"] / n_tok,
      "grad_norm": grad_norm,
      "learning_rate": lr,
      "update_applied": finite.astype(jnp.float32),
      "skipped_steps": state.skipped_steps,
      "update_loss_tokens": n_tok,  # Generated tokens in this update's (mini)batch.
  })
  if "corr_rejected_sequences" in sums:
    metrics["correction/rejected_sequence_frac"] = sums["corr_rejected_sequences"] / n_seq
  if "value_sum" in sums:
    metrics["value_mean"] = sums["value_sum"] / n_tok
    metrics["return_mean"] = sums["return_sum"] / n_tok
  if "moe/dropped" in sums:  # Expert parallel: overflow is logged every step, not hidden.
    metrics["moe/dropped_assignments"] = sums["moe/dropped"]
    metrics["moe/overflow_frac"] = sums["moe/dropped"] / jnp.maximum(sums["moe/routed"], 1.0)
  mm = {k[len("mm/"):]: v for k, v in sums.items() if k.startswith("mm/")}
  metrics.update(mismatch.finalize(mm))
  return metrics


class PrecompilingJit:
  """`jax.jit(fn)` that can also compile ahead of time: `precompile(*args)` compiles for the
  shapes, dtypes and shardings of `args` without running anything, and a later call whose
  arguments match runs that executable. Any other call goes through jit as usual."""

  def __init__(self, fn, **jit_kwargs):
    self._jitted = jax.jit(fn, **jit_kwargs)
    self._compiled = {}

  def lower(self, *args):
    return self._jitted.lower(*args)

  def precompile(self, *args) -> None:
    key = _signature(args)
    if key not in self._compiled:
      self._compiled[key] = self._jitted.lower(*args).compile()

  def __call__(self, *args):
    compiled = self._compiled.get(_signature(args)) if self._compiled else None
    return (compiled or self._jitted)(*args)


def _signature(args) -> tuple:
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple((np.shape(x), np.result_type(x), getattr(x, "sharding", None))
                        for x in leaves)


def jit_donating_state(fn, *, donate: bool):
  """`fn(state, *args) -> (state, out)` jitted; with `donate`, the state's buffers are
  donated to the new state's (the caller's `state` is spent), all but the frozen
  ref_params, which pass through undonated. A reference that shares buffers with the rest
  of the state (taken from the params at RL's start) is copied once, on the first call,
  and the new state carries the copy. `.lower(state, *args)` lowers it;
  `.precompile(state, *args)` compiles it for those shapes without running it."""

  def without_reference(core: TrainState, ref_params, *args):
    new_state, out = fn(core.replace(ref_params=ref_params), *args)
    return new_state.replace(ref_params=None), out

  jitted = PrecompilingJit(without_reference, donate_argnums=(0,) if donate else ())

  def call(state: TrainState, *args):
    core, ref = state.replace(ref_params=None), state.ref_params
    if donate and ref is not None and _buffers(ref) & _buffers(core):
      ref = jax.tree.map(jnp.copy, ref)
    new_core, out = jitted(core, ref, *args)
    return new_core.replace(ref_params=ref), out

  call.lower = lambda state, *args: jitted.lower(state.replace(ref_params=None),
                                                 state.ref_params, *args)
  call.precompile = lambda state, *args: jitted.precompile(state.replace(ref_params=None),
                                                           state.ref_params, *args)
  return call


def _buffers(tree) -> set[int]:
  """The device buffers a tree's arrays hold (two arrays may share one)."""
  return {shard.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
          for shard in x.addressable_shards}


def make_update(model, spec: RLSpec, *, donate: bool = False):
  """A jitted `update(state, batch, adv_bt) -> (state, metrics)`: one optimiser update on
  `batch`; adv_bt None computes the group advantages from `batch` itself. With `donate`
  the state passed in is spent (jit_donating_state)."""
  return jit_donating_state(_update_fn(model, spec), donate=donate)


def _update_fn(model, spec: RLSpec):
  """The update of make_update, not jitted."""
  optimizer = make_optimizer(spec)
  schedule = learning_rate_schedule(spec)
  m = spec.optim.num_micro_batches
  model_spec = model.spec

  def loss_fn(params, ref_params, micro, adv_bt, norms):
    return learner.microbatch_loss(params, ref_params, micro, adv_bt, norms, model=model,
                                   spec=spec, num_micro_batches=m)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def update(state: TrainState, batch: Batch, adv_bt=None):
    b = batch.batch_size
    if b % m:
      raise ValueError(f"batch size {b} is not divisible by "
                       f"config.rl.optim.num_micro_batches={m}.")
    learner.check_replay_available(batch, spec, model_spec)
    norms = objectives.loss_normalizers(batch.loss_mask_bt, spec.loss.constant_normalizer)
    if adv_bt is None:
      adv_bt = _step_advantages(spec, batch)
    if m == 1:
      (_, (sums, loads)), grads = grad_fn(state.params, state.ref_params, batch, adv_bt, norms)
    else:
      micro = _split_micro_batches((batch, adv_bt), m)
      first = jax.tree.map(lambda x: x[0], micro)
      shapes = jax.eval_shape(grad_fn, state.params, state.ref_params, first[0], first[1],
                              norms)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

      def body(carry, mb):
        (_, (sums, loads)), grads = grad_fn(state.params, state.ref_params, mb[0], mb[1],
                                            norms)
        acc_grads, acc_sums, acc_loads = carry
        return (jax.tree.map(jnp.add, acc_grads, grads), mismatch.combine_sums(acc_sums, sums),
                jax.tree.map(jnp.add, acc_loads, loads)), None

      init = (zeros[1], zeros[0][1][0], zeros[0][1][1])
      (grads, sums, loads), _ = jax.lax.scan(body, init, micro)
      loads = jax.tree.map(lambda x: x / m, loads)

    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    if model_spec.moe.use_routing_bias:
      bias_aux = {"layers": tuple({} if l is None else {"expert_load": l} for l in loads)}
      new_params = transformer.update_routing_biases(new_params, bias_aux,
                                                     model_spec.moe.routing_bias_rate)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    # The optimiser's schedule counts applied updates only (skipped ones keep its state).
    lr = schedule(state.step - state.skipped_steps)
    new_state = TrainState(
        step=state.step + 1, params=keep(new_params, state.params),
        opt_state=keep(new_opt_state, state.opt_state), ref_params=state.ref_params,
        skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32))
    return new_state, _finalize_metrics(sums, norms, grad_norm, finite, new_state, lr)

  return update


def batch_advantages(spec: RLSpec, batch: Batch):
  """Group (or turn-level) advantages of the whole batch, target aligned [B, T]."""
  return adv_lib.batch_advantages(spec, batch.rewards_b, batch.group_id_b, batch.loss_mask_bt,
                                  batch.process_reward_bt, batch.turn_index_bt)


def _step_advantages(spec: RLSpec, batch: Batch):
  """What an update gets as advantages: group ones, or zeros for GAE, whose advantages
  come per micro-batch from the values."""
  if spec.uses_values:
    return jnp.zeros_like(batch.loss_mask_bt)
  return batch_advantages(spec, batch)


def _take_rows(tree, rows):
  return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), tree)


def _mean_metrics(per_update: list[dict]) -> dict:
  """Means over a step's updates; counters and the learning rate as after the last one."""
  last = per_update[-1]
  out = {k: jnp.mean(jnp.stack([m[k] for m in per_update]), axis=0) for k in last}
  for k in ("skipped_steps", "learning_rate"):
    out[k] = last[k]
  return out


def minibatch_rows(spec: RLSpec, batch_size: int, step: int) -> list[np.ndarray]:
  """The rows of each update of a step, in order: per epoch a shuffle of the batch split
  into spec.minibatches. Seeded by the update count, so a resumed run shuffles the same."""
  rng = np.random.default_rng([17, step])
  plan = []
  for _ in range(spec.ppo_epochs):
    order = rng.permutation(batch_size) if spec.minibatches > 1 else np.arange(batch_size)
    plan.extend(np.split(order, spec.minibatches))
  return plan


def minibatch_length(row_lengths: np.ndarray, lengths: tuple[int, ...],
                     batch_length: int) -> int:
  """The length a minibatch is cut to: the smallest of `lengths` that holds its longest
  row, at most the batch's own length (() keeps the batch's length)."""
  longest = int(np.max(row_lengths))
  if longest > batch_length:
    raise ValueError(f"a row of {longest} tokens is longer than its batch ({batch_length}).")
  fits = [n for n in lengths if longest <= n < batch_length]
  return min(fits) if fits else batch_length


def row_lengths_of(batch: Batch) -> np.ndarray:
  """Each row's tokens (positions >= 0), read on the host: one process's batches only
  (a batch spread over processes passes its gathered lengths to the step instead)."""
  if not batch.positions_bt.is_fully_addressable:
    raise ValueError("train_step needs row_lengths for a batch spread over processes: pass "
                     "every process's trajectory lengths, gathered in process order.")
  return np.asarray(jax.device_get(jnp.sum(batch.positions_bt >= 0, axis=1)))


def make_train_step(model, spec: RLSpec, *, donate: bool = False,
                    lengths: tuple[int, ...] = ()):
  """`train_step(state, batch, row_lengths=None) -> (state, metrics)` for `model` under
  `spec` (module doc). With `donate` the state passed in is spent: its buffers become the
  new state's. `lengths` (train/learner_lengths.py): each minibatch update runs on its rows
  cut to the smallest of them that holds its longest row, so a minibatch of short rows
  pays for its own length, not the batch's; () keeps the batch's length. `row_lengths`:
  each row's token count, read from the batch when None (one process only)."""
  if spec.updates_per_step == 1:
    update = make_update(model, spec, donate=donate)
    one_update = lambda state, batch, row_lengths=None: update(state, batch, None)
    one_update.precompile = lambda state, batch: update.precompile(state, batch, None)
    return one_update
  update = _update_fn(model, spec)
  lengths = tuple(sorted(set(lengths)))

  micro = spec.optim.num_micro_batches
  scores_old_policy = learner.needs_old_policy_forward(spec)
  score_fn = PrecompilingJit(lambda params, ref_params, batch: learner.with_old_policy(
      model, params, batch, spec, ref_params))
  advantages_fn = PrecompilingJit(lambda batch: _step_advantages(spec, batch))
  update_minibatch = jit_donating_state(update, donate=donate)
  takes = {}  # minibatch length -> its rows of the batch, cut to that length

  def take(length: int):
    if length not in takes:
      takes[length] = PrecompilingJit(lambda batch, adv_bt, rows: (
          _take_rows(batch, rows).truncated(length), _take_rows(adv_bt, rows)[:, :length]))
    return takes[length]

  def precompile(state: TrainState, batch: Batch) -> None:
    """Compiles every program a step on a batch shaped like `batch` runs, at every
    minibatch length it can cut to; nothing trains. The (cheap) old-policy scoring runs,
    to give the update its inputs."""
    score_fn.precompile(state.params, state.ref_params, batch)
    scored = score_fn(state.params, state.ref_params, batch)
    advantages_fn.precompile(scored)
    adv_bt = advantages_fn(scored)
    rows = jnp.zeros((batch.batch_size // spec.minibatches,), jnp.int32)
    for length in {n for n in lengths if n < batch.length} | {batch.length}:
      take(length).precompile(scored, adv_bt, rows)
      update_minibatch.precompile(state, *take(length)(scored, adv_bt, rows))

  def train_step(state: TrainState, batch: Batch, row_lengths=None):
    b, mb = batch.batch_size, spec.minibatches
    if b % mb or (b // mb) % micro:
      raise ValueError(f"batch size {b} does not split into config.rl.minibatches={mb} "
                       f"minibatches of a multiple of config.rl.optim.num_micro_batches="
                       f"{micro} rows.")
    learner.check_replay_available(batch, spec, model.spec)
    if lengths:
      row_lengths = row_lengths_of(batch) if row_lengths is None else np.asarray(row_lengths)
      if row_lengths.shape != (b,):
        raise ValueError(f"row_lengths has shape {row_lengths.shape}, expected ({b},): one "
                         "length per row of the batch.")
    scored = score_fn(state.params, state.ref_params, batch)
    adv_bt = advantages_fn(scored)
    per_update, padded = [], []
    for rows in minibatch_rows(spec, b, int(jax.device_get(state.step))):
      length = (minibatch_length(row_lengths[rows], lengths, batch.length) if lengths
                else batch.length)
      minibatch = take(length)(scored, adv_bt, jnp.asarray(rows, jnp.int32))
      state, metrics = update_minibatch(state, *minibatch)
      per_update.append(metrics)
      padded.append(length)
    clip_frac = lambda updates: jnp.mean(jnp.stack([m["clip_frac"] for m in updates]))
    metrics = _mean_metrics(per_update)
    if not scores_old_policy:
      # No old-policy forward: only the first update's forward ran at the sampled policy's
      # params, so the mismatch is its minibatch's, not a mean over moving params.
      metrics.update({k: v for k, v in per_update[0].items() if k.startswith("mismatch/")})
    if "kl_to_ref" in per_update[0]:
      # At the batch's first update the params are the sampled ones: RL's first batch reads
      # 0 here exactly when the reference is the policy RL started from.
      metrics["kl_to_ref_first_update"] = per_update[0]["kl_to_ref"]
    metrics["clip_frac_first_epoch"] = clip_frac(per_update[:mb])
    metrics["clip_frac_last_epoch"] = clip_frac(per_update[-mb:])
    metrics["updates"] = jnp.float32(len(per_update))
    metrics["learner/minibatch_length"] = jnp.float32(np.mean(padded))
    return state, metrics

  train_step.precompile = precompile
  return train_step
