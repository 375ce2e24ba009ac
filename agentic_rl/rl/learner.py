"""The learner's forward and its loss on one (micro-)batch.

The forward takes the sampler's record as replay (per `config.rl.replay`):
routing (R3), sparse-attention blocks, and the sampling mask (Keep Sampling
Mask), and scores each generated token at the sampler's temperature.

Loss on a micro-batch, with whole-batch denominators (objectives.LossNormalizers):
  pg       aggregate(w_t * l_t)       l_t from ppo_clip or gspo, w_t the correction weight
  + kl_coef * aggregate(KL_t(pi || pi_ref))
  - entropy_coef * aggregate(H_t)
  + value_coef * aggregate(0.5 (V_t - G_t)^2)     (gae)
  + moe_aux_loss / num_micro_batches             (the model's load-balancing loss, when
                                                  loss.moe_aux_loss)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from agentic_rl.model import transformer
from agentic_rl.rl import advantages as adv_lib
from agentic_rl.rl import corrections
from agentic_rl.rl import logprobs as logprobs_lib
from agentic_rl.rl import mismatch
from agentic_rl.rl import objectives
from agentic_rl.records.batch import Batch
from agentic_rl.rl.config import RLSpec


def learner_replay(batch: Batch, spec: RLSpec):
  """The subset of the batch's record that `spec` says to force, or None."""
  keys = [k for k, on in (("experts", spec.replay.routing), ("blocks", spec.replay.blocks))
          if on]
  if batch.replay is None or not keys:
    return None
  replay = tuple({k: layer[k] for k in keys if k in layer} for layer in batch.replay)
  return replay if any(replay) else None


def check_replay_available(batch: Batch, spec: RLSpec, model_spec) -> None:
  """Raises if replay is switched on but the batch lacks what it forces."""
  flags = {"experts": ("config.rl.replay.routing", spec.replay.routing),
           "blocks": ("config.rl.replay.blocks", spec.replay.blocks)}
  wanted = [(i, key, flags[key][0]) for i in range(model_spec.num_layers)
            for key in model_spec.replay_keys(i) if flags[key][1]]
  for i, key, flag in wanted:
    if batch.replay is None or key not in batch.replay[i]:
      raise ValueError(f"{flag}=True but the batch has no replay[{i}][{key!r}]: record it "
                       "in the sampler, or set the flag to False.")
  if spec.replay.sampling_mask and batch.sampling_mask_btw is None:
    raise ValueError("config.rl.replay.sampling_mask=True but the batch has no "
                     "sampling_mask_btw: record it in the sampler (all-zero rows for "
                     "untruncated steps), or set the flag to False.")


def policy_outputs(model, params, batch: Batch, spec: RLSpec) -> dict[str, Any]:
  """Forward with replay; target-aligned 'logp_bt', 'entropy_bt', 'values_bt' (or None), 'aux'."""
  # A sampler that never truncates records all-True masks: replaying them changes nothing,
  # so the mask is not unpacked.
  replay_mask = spec.replay.sampling_mask and spec.sampling_truncated
  mask_w = batch.sampling_mask_btw if replay_mask else None
  logp_bt, entropy_bt, _, aux = logprobs_lib.scored_forward(
      model, params, batch.tokens_bt, batch.positions_bt, batch.temperature_b, mask_w,
      replay=learner_replay(batch, spec), entropy_grad=spec.loss.entropy_coef > 0)
  values_bt = None
  if "values" in aux:
    values_bt = logprobs_lib.shift_to_targets(aux["values"])
  return {"logp_bt": logp_bt, "entropy_bt": entropy_bt, "values_bt": values_bt, "aux": aux}


def needs_old_policy_forward(spec: RLSpec) -> bool:
  """Whether a step of several updates scores its batch with the params it starts from:
  for the PPO ratio's denominator (objective.old_logp_source='learner'), the learner side
  of an importance correction, or the critic's old values. Otherwise the sampler's
  log-probs are the denominator, and the step's first update, whose forward runs at those
  same params, measures the mismatch."""
  return (spec.objective.old_logp_source == "learner" or spec.correction.type != "none"
          or spec.uses_values)


def with_old_policy(model, params, batch: Batch, spec: RLSpec, ref_params=None) -> Batch:
  """The batch with old_logp_bt (and old_values_bt) filled by `params` when the spec needs
  them (`needs_old_policy_forward`), and ref_logp_bt by `ref_params` when the loss has a
  KL term.

  Call once before several epochs over one batch: every epoch's ratio is then against the
  policy the batch was sampled from, and the reference is scored once, not per update.
  """
  mask = batch.loss_mask_bt > 0
  ref_logp = batch.ref_logp_bt
  if spec.loss.kl_coef > 0 and ref_logp is None and ref_params is not None:
    ref_logp = jnp.where(mask, policy_outputs(model, ref_params, batch, spec)["logp_bt"], 0.0)
  if not needs_old_policy_forward(spec):
    return batch.replace(ref_logp_bt=ref_logp)
  out = policy_outputs(model, params, batch, spec)
  old_values = None
  if out["values_bt"] is not None:
    old_values = jnp.where(mask, out["values_bt"], 0.0)
  return batch.replace(old_logp_bt=jnp.where(mask, out["logp_bt"], 0.0),
                       old_values_bt=old_values, ref_logp_bt=ref_logp)


def microbatch_loss(params, ref_params, batch: Batch, adv_bt, norms, *, model, spec: RLSpec,
                    num_micro_batches: int):
  """(loss, (sums, expert_loads)) on one micro-batch; sums add up across micro-batches."""
  mask_bt = batch.loss_mask_bt
  on_bt = mask_bt > 0
  out = policy_outputs(model, params, batch, spec)
  logp_bt = jnp.where(on_bt, out["logp_bt"], 0.0)
  sampler_logp_bt = jnp.where(on_bt, batch.sampler_logp_bt, 0.0)
  if batch.old_logp_bt is not None:
    learner_old_bt = jnp.where(on_bt, batch.old_logp_bt, 0.0)
  else:
    learner_old_bt = jax.lax.stop_gradient(logp_bt)
  # The PPO ratio's denominator is the behaviour policy: the learner's score of it before
  # this round of updates, or the sampler's own log-probs (the clip then bounds both).
  ppo_old_bt = sampler_logp_bt if spec.objective.old_logp_source == "sampler" else learner_old_bt

  sums = {}
  if spec.uses_values:
    adv_bt, v_loss, sums = _critic_terms(out["values_bt"], batch, norms, spec)
  else:
    v_loss = 0.0
  adv_bt = jax.lax.stop_gradient(adv_bt)

  weights_bt, corr_sums = corrections.correction_weights(spec, learner_old_bt,
                                                         sampler_logp_bt, mask_bt)
  clip_low, clip_high = spec.clip_range
  if spec.objective.type == "ppo_clip":
    pg_bt, clipped_bt = objectives.ppo_clip_loss(logp_bt, ppo_old_bt, adv_bt, clip_low,
                                                 clip_high)
  else:
    pg_bt, clipped_bt = objectives.gspo_loss(logp_bt, ppo_old_bt, adv_bt, mask_bt, clip_low,
                                             clip_high)
  pg_loss = objectives.aggregate(weights_bt * pg_bt, mask_bt, spec.loss.aggregation, norms)
  entropy = objectives.aggregate(out["entropy_bt"], mask_bt, spec.loss.aggregation, norms)
  loss = pg_loss - spec.loss.entropy_coef * entropy + spec.loss.value_coef * v_loss

  if spec.loss.kl_coef > 0.0:
    kl = _kl_to_reference(logp_bt, ref_params, batch, norms, model=model, spec=spec)
    loss = loss + spec.loss.kl_coef * kl
    sums["kl_to_ref"] = kl

  moe_aux = out["aux"].get("moe_aux_loss", jnp.float32(0.0)) / num_micro_batches
  if spec.loss.moe_aux_loss:
    loss = loss + moe_aux

  ratio_bt = jnp.exp(jnp.where(on_bt, logp_bt - ppo_old_bt, 0.0))
  sums.update({
      "loss": loss, "pg_loss": pg_loss, "entropy": entropy, "moe_aux_loss": moe_aux,
      "clipped_count": jnp.sum(jnp.where(on_bt, clipped_bt, False).astype(jnp.float32)),
      "ppo_ratio_sum": jnp.sum(jnp.where(on_bt, ratio_bt, 0.0)),
      "advantage_sum": jnp.sum(jnp.where(on_bt, adv_bt, 0.0)),
      "reward_sum": jnp.sum(batch.rewards_b * adv_lib.sequence_valid(mask_bt)),
      **corr_sums,
  })
  sums.update(_mismatch_sums(learner_old_bt, sampler_logp_bt, out["aux"]["layers"], batch,
                             model=model, spec=spec))
  sums.update(expert_overflow_sums(out["aux"]["layers"]))
  sums = jax.tree.map(jax.lax.stop_gradient, sums)
  loads = tuple(layer.get("expert_load") for layer in out["aux"]["layers"])
  return loss, (sums, jax.lax.stop_gradient(loads))


def expert_overflow_sums(layers_aux) -> dict:
  """moe/dropped and moe/routed: expert assignments the expert-parallel dispatch dropped
  over capacity, of those routed, summed over layers; {} when no layer has a capacity."""
  counts = transformer.expert_overflow(layers_aux)
  if counts is None:
    return {}
  dropped, routed = (c.astype(jnp.float32) for c in counts)
  return {"moe/dropped": dropped, "moe/routed": routed}


def _critic_terms(values_bt, batch: Batch, norms, spec: RLSpec):
  """(GAE advantages, value loss, critic sums) from the value head's read-out."""
  if values_bt is None:
    raise ValueError("advantage.estimator='gae' needs the model's value head: set "
                     "config.model.value_head=True.")
  mask_bt = batch.loss_mask_bt
  on_bt = mask_bt > 0
  values_bt = jnp.where(on_bt, values_bt, 0.0)
  old_values_bt = (jax.lax.stop_gradient(values_bt) if batch.old_values_bt is None
                   else jnp.where(on_bt, batch.old_values_bt, 0.0))
  adv_bt, returns_bt = adv_lib.gae_advantages(batch.rewards_b, batch.process_reward_bt,
                                              old_values_bt, mask_bt, gamma=spec.advantage.gamma,
                                              lam=spec.advantage.gae_lambda)
  v_loss = objectives.aggregate(
      objectives.value_loss(values_bt, returns_bt, old_values_bt, spec.loss.value_clip),
      mask_bt, spec.loss.aggregation, norms)
  sums = {"value_loss": v_loss, "value_sum": jnp.sum(jnp.where(on_bt, values_bt, 0.0)),
          "return_sum": jnp.sum(returns_bt)}
  return adv_bt, v_loss, sums


def _kl_to_reference(logp_bt, ref_params, batch: Batch, norms, *, model, spec: RLSpec):
  """The aggregated KL to the frozen reference: its log-probs from the batch when filled,
  else scored here with `ref_params`."""
  on_bt = batch.loss_mask_bt > 0
  if batch.ref_logp_bt is not None:
    ref_logp_bt = batch.ref_logp_bt
  elif ref_params is not None:
    ref_logp_bt = policy_outputs(model, ref_params, batch, spec)["logp_bt"]
  else:
    raise ValueError("config.rl.loss.kl_coef > 0 needs the reference policy: pass "
                     "ref_params to init_train_state, or fill Batch.ref_logp_bt.")
  ref_logp_bt = jnp.where(on_bt, jax.lax.stop_gradient(ref_logp_bt), 0.0)
  return objectives.aggregate(objectives.kl_to_reference(logp_bt, ref_logp_bt,
                                                         spec.loss.kl_estimator),
                              batch.loss_mask_bt, spec.loss.aggregation, norms)


def _mismatch_sums(learner_old_bt, sampler_logp_bt, layers_aux, batch: Batch, *, model,
                   spec: RLSpec) -> dict:
  """mm/*: sampler-vs-learner log-prob mismatch and, with replay, selection agreement."""
  stats_kw = dict(num_turns=spec.max_turns, num_position_buckets=spec.mismatch.num_position_buckets,
                  max_position=model.spec.max_seq_len)
  sums = {f"mm/{k}": v for k, v in mismatch.logprob_mismatch_sums(
      learner_old_bt, sampler_logp_bt, batch.loss_mask_bt, batch.turn_index_bt,
      batch.positions_bt, ratio_low=spec.mismatch.ratio_low,
      ratio_high=spec.mismatch.ratio_high, **stats_kw).items()}
  if batch.replay is not None:
    sums.update({f"mm/{k}": v for k, v in mismatch.selection_agreement_sums(
        layers_aux, batch.replay, batch.positions_bt, batch.turn_index_bt,
        **stats_kw).items()})
  return sums


def mismatch_metrics(model, params, batch: Batch, spec: RLSpec) -> dict:
  """Mismatch of the learner (at `params`, with the configured replay) against the batch's
  sampler record, without training: "quantify the mismatch first". Jit-friendly."""
  out = policy_outputs(model, params, batch, spec)
  on_bt = batch.loss_mask_bt > 0
  kw = dict(num_turns=spec.max_turns, num_position_buckets=spec.mismatch.num_position_buckets,
            max_position=model.spec.max_seq_len)
  sums = mismatch.logprob_mismatch_sums(
      jnp.where(on_bt, out["logp_bt"], 0.0), jnp.where(on_bt, batch.sampler_logp_bt, 0.0),
      batch.loss_mask_bt, batch.turn_index_bt, batch.positions_bt,
      ratio_low=spec.mismatch.ratio_low, ratio_high=spec.mismatch.ratio_high, **kw)
  if batch.replay is not None:
    sums.update(mismatch.selection_agreement_sums(out["aux"]["layers"], batch.replay,
                                                  batch.positions_bt, batch.turn_index_bt, **kw))
  return mismatch.finalize(sums)
