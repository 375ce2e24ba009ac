"""Importance-sampling corrections of the train-inference mismatch.

r_t = pi_learner(y_t | .) / pi_sampler(y_t | .), with pi_learner taken at the
parameters the batch was sampled from (theta_old: the batch's old_logp_bt, or the
learner's current log-probs, detached). Each correction is a per-token weight w_t,
constant under the gradient, that multiplies the token's policy-gradient loss:

  none          w = 1
  tis           w = min(r, C)                                 TIS (Yao et al. 2025,
                "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training")
  mis_token     w = r * 1[lo <= r <= hi]                      token MIS
  mis_sequence  w = rho * 1[lo <= rho <= hi], broadcast to the sequence's tokens,
                rho = prod_t r_t, or exp(mean_t log r_t) (geometric mean)
                                                              MIS (Liu, Li et al. 2025,
                "When Speed Kills Stability")
  icepop        w = r * 1[alpha <= r <= beta]                 IcePop (Ring-1T, Ling Team
                2025): M(k) = k inside [alpha, beta], 0 outside; [0.5, 5.0] by default.

Masked tokens keep their place in the loss denominator (their gradient is zero,
the normalisation is the batch's). Products are formed in log space.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl.rl.config import RLSpec


def _inside(x, lo, hi):
  return (x >= lo) & (x <= hi)


def tis_weights(log_ratio_bt, cap: float):
  ratio_bt = jnp.exp(log_ratio_bt)
  return jnp.minimum(ratio_bt, cap), ratio_bt > cap


def masked_token_weights(log_ratio_bt, lo: float, hi: float):
  """r * 1[lo <= r <= hi] per token (token MIS and IcePop), and the rejected mask."""
  ratio_bt = jnp.exp(log_ratio_bt)
  keep_bt = _inside(ratio_bt, lo, hi)
  return jnp.where(keep_bt, ratio_bt, 0.0), ~keep_bt


def sequence_log_ratio(log_ratio_bt, mask_bt, how: str):
  """log rho per sequence: sum of token log-ratios (product) or their mean (geometric)."""
  total_b = jnp.sum(log_ratio_bt * mask_bt, axis=1)
  if how == "product":
    return total_b
  if how == "geometric_mean":
    return total_b / jnp.maximum(mask_bt.sum(1), 1.0)
  raise ValueError(f"config.rl.correction.mis_sequence_ratio={how!r}: expected "
                   "'product' or 'geometric_mean'.")


def masked_sequence_weights(log_ratio_bt, mask_bt, lo: float, hi: float, how: str):
  """rho * 1[lo <= rho <= hi] broadcast to tokens, the rejected mask, and rho per sequence."""
  log_rho_b = sequence_log_ratio(log_ratio_bt, mask_bt, how)
  rho_b = jnp.exp(log_rho_b)
  keep_b = _inside(rho_b, lo, hi)
  w_b = jnp.where(keep_b, rho_b, 0.0)
  t = log_ratio_bt.shape[1]
  return (jnp.broadcast_to(w_b[:, None], (w_b.shape[0], t)),
          jnp.broadcast_to(~keep_b[:, None], (w_b.shape[0], t)), rho_b)


def correction_weights(spec: RLSpec, learner_logp_bt, sampler_logp_bt, mask_bt
                       ) -> tuple[jax.Array, dict]:
  """(weights_bt, stats): the active correction's weights (detached) and its statistics.

  stats holds sums over generated tokens (to divide by the token count later):
    'corr_weight_sum', 'corr_rejected_count' (tokens truncated by TIS or masked
    by MIS/IcePop), and for mis_sequence 'corr_rejected_sequences'.
  """
  log_ratio_bt = jax.lax.stop_gradient(learner_logp_bt - sampler_logp_bt) * mask_bt
  c = spec.correction
  kind = c.type
  extra = {}
  if kind == "none":
    w_bt = jnp.ones_like(log_ratio_bt)
    rejected_bt = jnp.zeros(log_ratio_bt.shape, jnp.bool_)
  elif kind == "tis":
    w_bt, rejected_bt = tis_weights(log_ratio_bt, c.tis_cap)
  elif kind == "mis_token":
    w_bt, rejected_bt = masked_token_weights(log_ratio_bt, c.mis_low, c.mis_high)
  elif kind == "icepop":
    w_bt, rejected_bt = masked_token_weights(log_ratio_bt, c.icepop_low, c.icepop_high)
  elif kind == "mis_sequence":
    w_bt, rejected_bt, _ = masked_sequence_weights(log_ratio_bt, mask_bt, c.mis_low, c.mis_high,
                                                   c.mis_sequence_ratio)
    has_tokens_b = mask_bt.sum(1) > 0
    extra["corr_rejected_sequences"] = jnp.sum(
        (rejected_bt[:, 0] & has_tokens_b).astype(jnp.float32))
  else:
    raise ValueError(f"config.rl.correction.type={kind!r} is unknown.")
  w_bt = jax.lax.stop_gradient(w_bt) * mask_bt
  stats = {
      "corr_weight_sum": jnp.sum(w_bt),
      "corr_rejected_count": jnp.sum(rejected_bt.astype(jnp.float32) * mask_bt),
      **extra,
  }
  return w_bt, stats
