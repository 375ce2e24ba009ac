"""Token log-probs, entropies and argmax hits from the final hidden state, one vocabulary
chunk at a time: the [B, T, V] logits, their softmax and their gradient are never built.

Forward, a scan over chunks of `chunk` vocabulary rows keeps running [B, T] statistics
(online softmax): the max m, s = sum exp(z - m), u = sum exp(z - m) z, the target's z and
the argmax. Then log Z = m + log s, log p(y) = z_y - log Z, H = log Z - u / s.

Backward (a custom VJP), each chunk's logits are recomputed from the saved log Z and H:
  d log p(y) / dz_j = 1[j = y] - p_j
  dH / dz_j         = -p_j (z_j - log Z + H)
so memory is O(B T (d + chunk)) both ways, for one extra [B, T, d] x [d, chunk] matmul per
chunk. z = logits / temperature, -inf outside the replayed sampling mask (an all-zero
packed row means "no mask"), as `logprobs.token_logprobs` computes it from full logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from agentic_rl.records import sampling_mask as sampling_mask_lib

BITS = 8  # Mask bits per packed byte: chunks are whole bytes.


def check_chunk(chunk: int) -> None:
  if chunk <= 0 or chunk % BITS:
    raise ValueError(f"vocabulary chunk={chunk}: a positive multiple of {BITS} (the packed "
                     "sampling mask's bits per byte).")


def token_stats(h_btd: jax.Array, w_vd: jax.Array, targets_bt: jax.Array,
                temperature_b: jax.Array, sampling_mask_btw: jax.Array | None = None, *,
                chunk: int, dtype=jnp.float32, entropy_grad: bool = True
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(logp_bt, entropy_bt, hit_bt) of `targets_bt` under softmax(h_btd @ w_vd.T / temperature).

  h_btd: the hidden states that score the targets (already position-aligned with them).
  w_vd: the read-out, one row per vocabulary entry (a tied embedding, or the transposed
    unembedding). The matmul runs in `dtype` and accumulates in fp32, as the model's.
  sampling_mask_btw: packed uint8 support per position, or None.
  hit_bt: 1.0 where the target is the first argmax of its logits (no gradient).
  entropy_grad: False when nothing differentiates the entropy (a loss with entropy_coef 0):
    the backward then skips its term instead of multiplying it by a zero cotangent.
  """
  check_chunk(chunk)
  vocab = w_vd.shape[0]
  if sampling_mask_btw is not None:
    if sampling_mask_btw.dtype != jnp.uint8:
      raise ValueError(f"sampling_mask_btw must be packed uint8; got {sampling_mask_btw.dtype}.")
    if sampling_mask_btw.shape[-1] != sampling_mask_lib.packed_width(vocab):
      raise ValueError(f"sampling_mask_btw has {sampling_mask_btw.shape[-1]} bytes per row; "
                       f"a vocabulary of {vocab} needs "
                       f"{sampling_mask_lib.packed_width(vocab)}.")
  logp_bt, entropy_bt, hit_bt = _token_stats(
      chunk, jnp.dtype(dtype).name, bool(entropy_grad), h_btd, w_vd, targets_bt,
      temperature_b.astype(jnp.float32), sampling_mask_btw)
  if not entropy_grad:  # Said, not only skipped: a caller differentiating it gets 0.
    entropy_bt = jax.lax.stop_gradient(entropy_bt)
  return logp_bt, entropy_bt, hit_bt


def _chunked(chunk: int, w_vd, mask_btw):
  """(w_cvd, bits_cbtk or None, no_mask_bt or None): the read-out and the packed mask split
  into vocabulary chunks, padded with empty columns."""
  vocab, d = w_vd.shape
  num_chunks = -(-vocab // chunk)
  w_cvd = jnp.pad(w_vd, ((0, num_chunks * chunk - vocab), (0, 0))).reshape(num_chunks, chunk, d)
  if mask_btw is None:
    return w_cvd, None, None
  b, t, width = mask_btw.shape
  bytes_per_chunk = chunk // BITS
  padded = jnp.pad(mask_btw, ((0, 0), (0, 0), (0, num_chunks * bytes_per_chunk - width)))
  bits_cbtk = jnp.moveaxis(padded.reshape(b, t, num_chunks, bytes_per_chunk), 2, 0)
  # An all-zero row records no truncation (prompt, environment, padding tokens).
  no_mask_bt = ~jnp.any(mask_btw != 0, axis=-1)
  return w_cvd, bits_cbtk, no_mask_bt


def _chunk_logits(dtype, vocab, h_btd, w_kd, start, temperature_b, bits_btk, no_mask_bt):
  """(z_btk, keep_btk): scaled logits of one chunk, -inf outside the support."""
  chunk = w_kd.shape[0]
  logits_btk = jnp.einsum("btd,kd->btk", h_btd.astype(dtype), w_kd.astype(dtype),
                          preferred_element_type=jnp.float32)
  z_btk = logits_btk / temperature_b[:, None, None]
  keep_btk = jnp.broadcast_to(start + jnp.arange(chunk) < vocab, z_btk.shape)
  if bits_btk is not None:
    bits = jnp.unpackbits(bits_btk, axis=-1, count=chunk, bitorder="little").astype(bool)
    keep_btk = keep_btk & (bits | no_mask_bt[..., None])
  return jnp.where(keep_btk, z_btk, -jnp.inf), keep_btk


def _forward(chunk, dtype, h_btd, w_vd, targets_bt, temperature_b, mask_btw):
  vocab = w_vd.shape[0]
  w_cvd, bits_cbtk, no_mask_bt = _chunked(chunk, w_vd, mask_btw)
  bt = targets_bt.shape
  starts = jnp.arange(w_cvd.shape[0], dtype=jnp.int32) * chunk

  def body(carry, xs):
    m_bt, s_bt, u_bt, zy_bt, arg_bt = carry
    w_kd, start, bits_btk = xs
    z_btk, keep_btk = _chunk_logits(dtype, vocab, h_btd, w_kd, start, temperature_b,
                                    bits_btk, no_mask_bt)
    mc_bt = jnp.max(z_btk, axis=-1)
    new_m_bt = jnp.maximum(m_bt, mc_bt)
    shift_bt = jnp.where(jnp.isfinite(new_m_bt), new_m_bt, 0.0)
    decay_bt = jnp.exp(m_bt - shift_bt)
    e_btk = jnp.exp(z_btk - shift_bt[..., None])
    s_bt = s_bt * decay_bt + jnp.sum(e_btk, axis=-1)
    u_bt = u_bt * decay_bt + jnp.sum(e_btk * jnp.where(keep_btk, z_btk, 0.0), axis=-1)
    idx_bt = targets_bt - start
    inside_bt = (idx_bt >= 0) & (idx_bt < chunk)
    z_at_bt = jnp.take_along_axis(z_btk, jnp.clip(idx_bt, 0, chunk - 1)[..., None], -1)[..., 0]
    zy_bt = jnp.where(inside_bt, z_at_bt, zy_bt)
    # Strictly greater: the first chunk holding the max keeps it, as argmax keeps the first.
    arg_bt = jnp.where(mc_bt > m_bt, start + jnp.argmax(z_btk, axis=-1).astype(jnp.int32),
                       arg_bt)
    return (new_m_bt, s_bt, u_bt, zy_bt, arg_bt), None

  init = (jnp.full(bt, -jnp.inf, jnp.float32), jnp.zeros(bt, jnp.float32),
          jnp.zeros(bt, jnp.float32), jnp.full(bt, -jnp.inf, jnp.float32),
          jnp.zeros(bt, jnp.int32))
  xs = (w_cvd, starts, bits_cbtk)
  (m_bt, s_bt, u_bt, zy_bt, arg_bt), _ = jax.lax.scan(body, init, xs)
  log_z_bt = m_bt + jnp.log(s_bt)
  logp_bt = zy_bt - log_z_bt
  entropy_bt = log_z_bt - u_bt / s_bt
  hit_bt = (arg_bt == targets_bt).astype(jnp.float32)
  return (logp_bt, entropy_bt, hit_bt), log_z_bt


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _token_stats(chunk, dtype, entropy_grad, h_btd, w_vd, targets_bt, temperature_b, mask_btw):
  del entropy_grad  # The backward's choice only.
  return _forward(chunk, dtype, h_btd, w_vd, targets_bt, temperature_b, mask_btw)[0]


def _token_stats_fwd(chunk, dtype, entropy_grad, h_btd, w_vd, targets_bt, temperature_b,
                     mask_btw):
  del entropy_grad
  out, log_z_bt = _forward(chunk, dtype, h_btd, w_vd, targets_bt, temperature_b, mask_btw)
  return out, (h_btd, w_vd, targets_bt, temperature_b, mask_btw, log_z_bt, out[1])


def _token_stats_bwd(chunk, dtype, entropy_grad, residuals, cotangents):
  h_btd, w_vd, targets_bt, temperature_b, mask_btw, log_z_bt, entropy_bt = residuals
  g_logp_bt, g_entropy_bt, _ = cotangents
  vocab, d = w_vd.shape
  w_cvd, bits_cbtk, no_mask_bt = _chunked(chunk, w_vd, mask_btw)
  starts = jnp.arange(w_cvd.shape[0], dtype=jnp.int32) * chunk
  # A position whose logits are not finite (a bad id or position, NaN by contract) sends no
  # gradient, as the full-logits path's `where` sends none into its logits.
  ok_bt = jnp.isfinite(log_z_bt) & jnp.isfinite(entropy_bt)
  g_logp_bt = jnp.where(ok_bt, g_logp_bt, 0.0)
  g_entropy_bt = jnp.where(ok_bt, g_entropy_bt, 0.0)
  log_z_bt = jnp.where(ok_bt, log_z_bt, 0.0)
  entropy_bt = jnp.where(ok_bt, entropy_bt, 0.0)
  h_safe_btd = jnp.where(ok_bt[..., None], h_btd, 0)

  def body(dh_btd, xs):
    w_kd, start, bits_btk = xs
    z_btk, keep_btk = _chunk_logits(dtype, vocab, h_safe_btd, w_kd, start, temperature_b,
                                    bits_btk, no_mask_bt)
    z_btk = jnp.where(keep_btk, z_btk, 0.0)
    p_btk = jnp.where(keep_btk, jnp.exp(z_btk - log_z_bt[..., None]), 0.0)
    onehot_btk = (start + jnp.arange(chunk) == targets_bt[..., None]) & keep_btk
    dz_btk = g_logp_bt[..., None] * (onehot_btk - p_btk)
    if entropy_grad:
      dz_btk = dz_btk - g_entropy_bt[..., None] * p_btk * (z_btk - log_z_bt[..., None]
                                                           + entropy_bt[..., None])
    dlogits_btk = (dz_btk / temperature_b[:, None, None]).astype(dtype)
    dh_btd = dh_btd + jnp.einsum("btk,kd->btd", dlogits_btk, w_kd.astype(dtype),
                                 preferred_element_type=jnp.float32)
    dw_kd = jnp.einsum("btk,btd->kd", dlogits_btk, h_safe_btd.astype(dtype),
                       preferred_element_type=jnp.float32)
    return dh_btd, dw_kd

  dh_btd, dw_ckd = jax.lax.scan(body, jnp.zeros(h_btd.shape, jnp.float32),
                                (w_cvd, starts, bits_cbtk))
  dw_vd = dw_ckd.reshape(-1, d)[:vocab]
  return (dh_btd.astype(h_btd.dtype), dw_vd.astype(w_vd.dtype), None, None, None)


_token_stats.defvjp(_token_stats_fwd, _token_stats_bwd)
