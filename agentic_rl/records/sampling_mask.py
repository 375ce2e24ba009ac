"""Keep Sampling Mask: record the sampler's top-k/top-p support, replay it in the learner.

When the sampler truncates its distribution (top-k, top-p), the token it drew came
from the renormalised distribution over the kept set, not from softmax(logits / T).
The learner must apply the same mask before its log-softmax, or every token's
log-prob differs by the log of the kept mass.

Storage: one bit per vocabulary entry, packed little-endian (bit i of byte j is
vocab id 8*j + i), so a [.., V] bool mask is a [.., ceil(V / 8)] uint8 array.
`numpy.packbits(mask, axis=-1, bitorder="little")` writes identical bytes, so a
host-side rollout engine may pack with numpy.

Alignment in the batch (see `batch.Batch`): sampling_mask_btw[b, t] is the support
of the distribution that token tokens_bt[b, t] was drawn from, i.e. the one
computed from the logits at position t - 1. It is a target-aligned array, like
sampler_logp_bt.

Use in the rollout engine, per decode step:

    logits_bv = logits[:, -1] / temperature
    keep_bv = sampling_mask_from_logits(logits_bv, top_k=50, top_p=0.95)
    logp_bv = jax.nn.log_softmax(apply_mask_to_logits(logits_bv, keep_bv), axis=-1)
    token_b = jax.random.categorical(rng, logp_bv)
    record: sampler_logp = logp_bv[token_b], sampling_mask = pack_mask(keep_bv)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def packed_width(vocab_size: int) -> int:
  """Bytes per packed mask row: ceil(vocab_size / 8)."""
  return -(-vocab_size // 8)


def pack_mask(mask_v: jax.Array) -> jax.Array:
  """bool [..., V] -> uint8 [..., ceil(V / 8)], little-endian bit order."""
  mask_v = jnp.asarray(mask_v)
  if mask_v.dtype != jnp.bool_:
    raise ValueError(f"pack_mask expects a bool mask; got dtype {mask_v.dtype}.")
  return jnp.packbits(mask_v, axis=-1, bitorder="little")


def unpack_mask(packed_w: jax.Array, vocab_size: int) -> jax.Array:
  """uint8 [..., ceil(V / 8)] -> bool [..., V]; the inverse of `pack_mask`."""
  packed_w = jnp.asarray(packed_w)
  if packed_w.dtype != jnp.uint8:
    raise ValueError(f"unpack_mask expects uint8 bytes; got dtype {packed_w.dtype}.")
  if packed_w.shape[-1] != packed_width(vocab_size):
    raise ValueError(f"packed mask has {packed_w.shape[-1]} bytes per row; vocab_size="
                     f"{vocab_size} needs {packed_width(vocab_size)}.")
  bits = jnp.unpackbits(packed_w, axis=-1, count=vocab_size, bitorder="little")
  return bits.astype(jnp.bool_)


def apply_mask_to_logits(logits_v: jax.Array, mask: jax.Array) -> jax.Array:
  """Logits with -inf outside the mask.

  mask: bool [..., V], or the packed uint8 [..., ceil(V / 8)] form (unpacked here).
  A row whose mask is all False would become all -inf (NaN after softmax); a
  mask recorded by a sampler always holds at least the drawn token.
  """
  vocab_size = logits_v.shape[-1]
  if mask.dtype == jnp.uint8:
    mask = unpack_mask(mask, vocab_size)
  if mask.shape[-1] != vocab_size:
    raise ValueError(f"mask has {mask.shape[-1]} entries per row; logits have "
                     f"vocab_size={vocab_size}.")
  return jnp.where(mask, logits_v, -jnp.inf)


def truncates(vocab_size: int, top_k: int = 0, top_p: float = 1.0) -> bool:
  """Whether top-k / top-p drop any token of a `vocab_size` vocabulary (a static choice:
  when not, the mask is all True and need not be computed)."""
  return 0 < top_k < vocab_size or top_p < 1.0


def sampling_mask_from_logits(logits_v: jax.Array, *, top_k: int = 0,
                              top_p: float = 1.0) -> jax.Array:
  """bool [..., V]: the tokens a top-k then top-p sampler may draw.

  logits_v: already divided by the temperature. top_k=0 keeps every token;
  top_p=1.0 keeps every token. Top-p keeps the smallest prefix of the sorted
  distribution (after top-k) whose mass reaches top_p, and always the best
  token. Ties at the cut are broken by vocabulary order (lower id first).

  Work done: none when nothing is truncated; `lax.top_k` (k best, ties lower id first)
  with top-k; one stable sort for top-p alone. The kept ranks go back to vocabulary order
  by one scatter.
  """
  vocab_size = logits_v.shape[-1]
  if not 0 <= top_k <= vocab_size:
    raise ValueError(f"top_k={top_k}: expected 0 (off) or up to vocab_size={vocab_size}.")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p}: expected a number in (0, 1].")
  if not truncates(vocab_size, top_k, top_p):
    return jnp.ones(logits_v.shape, jnp.bool_)
  if 0 < top_k < vocab_size:
    sorted_r, order_r = jax.lax.top_k(logits_v, top_k)
  else:  # Top-p over the whole vocabulary: one stable descending sort.
    order_r = jnp.argsort(-logits_v, axis=-1, stable=True)
    sorted_r = jnp.take_along_axis(logits_v, order_r, axis=-1)
  keep_r = jnp.ones(sorted_r.shape, jnp.bool_)
  if top_p < 1.0:
    probs_r = jax.nn.softmax(sorted_r, axis=-1)
    mass_before_r = jnp.cumsum(probs_r, axis=-1) - probs_r
    keep_r = (mass_before_r < top_p) | (jnp.arange(sorted_r.shape[-1]) == 0)
  return jnp.put_along_axis(jnp.zeros(logits_v.shape, jnp.bool_), order_r, keep_r, axis=-1,
                            inplace=False)
