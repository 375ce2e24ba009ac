"""Policy objectives, loss aggregation, KL to the reference and the value loss.

Per-token losses (to minimise), with s the policy ratio against theta_old:
  ppo_clip  s_t = exp(logp_t - old_t)
            l_t = -min(s_t A_t, clip(s_t, 1 - eps_low, 1 + eps_high) A_t)
            PPO (Schulman et al. 2017), asymmetric "clip-higher" bounds from DAPO (Yu et al. 2025).
  gspo      s_i = exp(mean_t (logp_t - old_t)) per sequence (length-normalised
            sequence ratio), in the GSPO-token form s_{i,t} = sg(s_i) * pi_t / sg(pi_t):
            l_t = -min(s_{i,t} A_t, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) A_t)
            GSPO (Zheng et al. 2025). With sequence-level advantages and
            aggregation='sequence' this is GSPO exactly.

Aggregation of per-token losses l_t over generated tokens (mask m):
  token     sum_{i,t} m l / sum_{i,t} m                    DAPO token-mean
  sequence  mean_i ( sum_t m l / sum_t m )                 GRPO's per-sequence mean
  constant  sum_{i,t} m l / (num_sequences * L)            Dr. GRPO (L = constant or T)
Denominators come from the whole batch (`loss_normalizers`), so micro-batch
losses add up to the full-batch loss.

KL estimators of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL"):
  k1 = log pi - log pi_ref,  k2 = (log pi - log pi_ref)^2 / 2,
  k3 = pi_ref / pi - 1 - log(pi_ref / pi)     (GRPO's choice, non-negative).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


def ppo_clip_loss(logp_bt, old_logp_bt, adv_bt, clip_low: float, clip_high: float):
  """(loss_bt, clipped_bt): per-token clipped surrogate; clipped_bt marks tokens whose
  clipped branch is active (their gradient is zero)."""
  ratio_bt = jnp.exp(logp_bt - old_logp_bt)
  clipped_ratio_bt = jnp.clip(ratio_bt, 1.0 - clip_low, 1.0 + clip_high)
  unclipped_bt = ratio_bt * adv_bt
  clipped_obj_bt = clipped_ratio_bt * adv_bt
  loss_bt = -jnp.minimum(unclipped_bt, clipped_obj_bt)
  return loss_bt, clipped_obj_bt < unclipped_bt


def gspo_sequence_log_ratio(logp_bt, old_logp_bt, mask_bt):
  """log s_i = mean over generated tokens of (logp - old)."""
  return jnp.sum((logp_bt - old_logp_bt) * mask_bt, axis=1) / jnp.maximum(mask_bt.sum(1), 1.0)


def gspo_loss(logp_bt, old_logp_bt, adv_bt, mask_bt, clip_low: float, clip_high: float):
  """(loss_bt, clipped_bt) of GSPO-token; the value of s_{i,t} is the sequence ratio s_i."""
  log_s_b = gspo_sequence_log_ratio(logp_bt, old_logp_bt, mask_bt)
  log_s_bt = jax.lax.stop_gradient(log_s_b)[:, None] + logp_bt - jax.lax.stop_gradient(logp_bt)
  ratio_bt = jnp.exp(log_s_bt)
  clipped_ratio_bt = jnp.clip(ratio_bt, 1.0 - clip_low, 1.0 + clip_high)
  unclipped_bt = ratio_bt * adv_bt
  clipped_obj_bt = clipped_ratio_bt * adv_bt
  return -jnp.minimum(unclipped_bt, clipped_obj_bt), clipped_obj_bt < unclipped_bt


def kl_to_reference(logp_bt, ref_logp_bt, estimator: str):
  """Per-token estimate of KL(pi || pi_ref) from tokens sampled by (about) pi."""
  log_ratio_bt = logp_bt - ref_logp_bt  # log pi / pi_ref
  if estimator == "k1":
    return log_ratio_bt
  if estimator == "k2":
    return 0.5 * log_ratio_bt ** 2
  if estimator == "k3":
    return jnp.exp(-log_ratio_bt) - 1.0 + log_ratio_bt
  raise ValueError(f"config.rl.loss.kl_estimator={estimator!r}: expected k1, k2 or k3.")


def value_loss(values_bt, returns_bt, old_values_bt=None, clip: float = 0.0):
  """0.5 (V - G)^2 per token; PPO's clipped form max(.., (V_clip - G)^2) when clip > 0."""
  loss_bt = 0.5 * (values_bt - returns_bt) ** 2
  if clip > 0.0 and old_values_bt is not None:
    clipped_bt = old_values_bt + jnp.clip(values_bt - old_values_bt, -clip, clip)
    loss_bt = jnp.maximum(loss_bt, 0.5 * (clipped_bt - returns_bt) ** 2)
  return loss_bt


@flax.struct.dataclass
class LossNormalizers:
  """Whole-batch denominators (scalars), fixed before micro-batching."""

  num_tokens: jax.Array  # generated tokens in the batch
  num_sequences: jax.Array  # sequences with at least one generated token
  constant: jax.Array  # num_sequences_total * L for 'constant'


def loss_normalizers(mask_bt, constant_normalizer: int = 0) -> LossNormalizers:
  b, t = mask_bt.shape
  length = constant_normalizer if constant_normalizer > 0 else t
  return LossNormalizers(
      num_tokens=jnp.maximum(mask_bt.sum(), 1.0),
      num_sequences=jnp.maximum((mask_bt.sum(1) > 0).sum().astype(jnp.float32), 1.0),
      constant=jnp.float32(b * length))


def aggregate(loss_bt, mask_bt, mode: str, norms: LossNormalizers):
  """The scalar loss of per-token `loss_bt` over generated tokens (see module doc)."""
  masked_bt = jnp.where(mask_bt > 0, loss_bt, 0.0)
  if mode == "token":
    return masked_bt.sum() / norms.num_tokens
  if mode == "sequence":
    per_seq_b = masked_bt.sum(1) / jnp.maximum(mask_bt.sum(1), 1.0)
    return per_seq_b.sum() / norms.num_sequences
  if mode == "constant":
    return masked_bt.sum() / norms.constant
  raise ValueError(f"config.rl.loss.aggregation={mode!r}: expected token, sequence or constant.")
