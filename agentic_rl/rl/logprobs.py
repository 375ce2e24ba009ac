"""Target-aligned token log-probs and entropies from the model's logits.

The logits at position t - 1 score token t. Everything returned here is
target aligned ([b, t] is about tokens_bt[b, t]); column 0 has no scoring
logits and is 0.

`scored_forward` is the learner's entry: the forward and its scores, one vocabulary chunk at
a time (chunked_logprobs.py) unless config.model.readout_chunk is 0. `token_logprobs` is the
full-logits form, and the reference the chunked one is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl.records import sampling_mask as sampling_mask_lib
from agentic_rl.rl import chunked_logprobs


def prepend_zero_column(x_b_tm1: jax.Array) -> jax.Array:
  """[B, T-1] scores of tokens 1..T-1 -> [B, T] target aligned, 0 in column 0."""
  return jnp.concatenate([jnp.zeros_like(x_b_tm1[:, :1]), x_b_tm1], axis=1)


def shift_to_targets(x_bt: jax.Array) -> jax.Array:
  """Per-position outputs (e.g. values) -> target aligned: [b, t] <- x[b, t - 1]."""
  return prepend_zero_column(x_bt[:, :-1])


def _scaled_logits(logits_btv, temperature_b, sampling_mask_btw):
  """[B, T-1, V]: the logits that score tokens 1..T-1, over temperature, -inf off the mask."""
  scaled_btv = logits_btv[:, :-1].astype(jnp.float32) / temperature_b[:, None, None]
  if sampling_mask_btw is not None:
    keep_btv = sampling_mask_btw[:, 1:]
    if keep_btv.dtype == jnp.uint8:
      keep_btv = sampling_mask_lib.unpack_mask(keep_btv, scaled_btv.shape[-1])
    # An all-zero row records no truncation (prompt, environment, padding tokens).
    keep_btv = keep_btv | ~jnp.any(keep_btv, axis=-1, keepdims=True)
    scaled_btv = sampling_mask_lib.apply_mask_to_logits(scaled_btv, keep_btv)
  return scaled_btv


def token_logprobs(logits_btv: jax.Array, tokens_bt: jax.Array, temperature_b: jax.Array,
                   sampling_mask_btw: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
  """(logp_bt, entropy_bt) of each target token under softmax(logits / temperature).

  sampling_mask_btw: packed (uint8) or bool target-aligned support; outside it the
    distribution has no mass (Keep Sampling Mask). Entropy is of that same
    renormalised distribution. An all-zero row means "no mask" (tokens the
    sampler did not draw). A drawn token outside its own mask gets -inf.
  """
  logp_b_tm1, entropy_b_tm1 = _target_scores(
      _scaled_logits(logits_btv, temperature_b, sampling_mask_btw), tokens_bt)
  return prepend_zero_column(logp_b_tm1), prepend_zero_column(entropy_b_tm1)


def _target_scores(scaled_btv, tokens_bt):
  """(logp, entropy) [B, T-1] of tokens 1..T-1 from `_scaled_logits`."""
  logp_btv = jax.nn.log_softmax(scaled_btv, axis=-1)
  target_logp_bt = jnp.take_along_axis(logp_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]
  probs_btv = jnp.exp(logp_btv)
  # Outside the mask logp is -inf: 0 * -inf is 0 mass, not NaN. The inner where keeps the
  # -inf out of the product, so its gradient is 0 there too (an outer where alone still
  # back-propagates 0 * -inf = NaN into every logit of the row).
  finite_logp_btv = jnp.where(probs_btv > 0, logp_btv, 0.0)
  return target_logp_bt, -jnp.sum(probs_btv * finite_logp_btv, axis=-1)


def scored_forward(model, params, tokens_bt, positions_bt, temperature_b,
                   sampling_mask_btw=None, replay=None, entropy_grad: bool = True):
  """(logp_bt, entropy_bt, hit_bt, aux): the forward (with `replay`) and, target aligned,
  each token's log-prob and entropy under softmax(logits / temperature) within the packed
  sampling mask, and 1.0 where the token is the argmax of that distribution (no gradient).
  `entropy_grad=False` (a loss without an entropy term) sends no gradient through the
  entropy, and the backward does none of its work."""
  chunk = model.spec.readout_chunk
  if chunk == 0:
    logits_btv, _, aux = model.forward(params, tokens_bt, positions_bt, replay=replay)
    scaled_btv = _scaled_logits(logits_btv, temperature_b, sampling_mask_btw)
    hit_b_tm1 = (jnp.argmax(scaled_btv, axis=-1) == tokens_bt[:, 1:]).astype(jnp.float32)
    logp_b_tm1, entropy_b_tm1 = _target_scores(scaled_btv, tokens_bt)
    if not entropy_grad:
      entropy_b_tm1 = jax.lax.stop_gradient(entropy_b_tm1)
    stats = (logp_b_tm1, entropy_b_tm1, hit_b_tm1)
    return (*(prepend_zero_column(x) for x in stats), aux)
  h_btd, _, aux = model.forward(params, tokens_bt, positions_bt, replay=replay, hidden=True)
  mask_w = None if sampling_mask_btw is None else sampling_mask_btw[:, 1:]
  if mask_w is not None and mask_w.dtype != jnp.uint8:
    mask_w = sampling_mask_lib.pack_mask(mask_w)
  stats = chunked_logprobs.token_stats(h_btd[:, :-1], model.readout_weights(params),
                                       tokens_bt[:, 1:], temperature_b, mask_w, chunk=chunk,
                                       dtype=model.spec.dtype, entropy_grad=entropy_grad)
  return (*(prepend_zero_column(x) for x in stats), aux)
