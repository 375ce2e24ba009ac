"""Pure-jnp reference attention ops: the contract every fast kernel implements.

Shapes: B batch, T queries, S keys, H query heads, K kv heads (H = K * G),
D head dim, N key blocks, n selected blocks per query group.

Positions, not indices, decide visibility: a key at position p_k is visible
to a query at p_q when 0 <= p_k <= p_q (and p_q - p_k < W for a window).
Position -1 marks padding; a query that sees no key gets a zero output, never
NaN, so padded rows stay finite under autodiff.

Masking is by select, never by a multiply with a zero weight: a key or value a
query cannot see (a stale cache slot, a future token) cannot reach its output
even when it is NaN or inf (0 * NaN is NaN). A non-finite key or value a query
does see still makes that query's output NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def _group_queries(q_bthd, num_kv_heads):
  b, t, h, d = q_bthd.shape
  return q_bthd.reshape(b, t, num_kv_heads, h // num_kv_heads, d)


def masked_attention(q_bthd, k_bshd, v_bshd, mask_bts):
  """Grouped-query softmax attention with an explicit [B, T, S] mask.

  Softmax runs in float32. Rows with no visible key return zeros.
  """
  b, t, h, d = q_bthd.shape
  num_kv_heads = k_bshd.shape[2]
  q_btkgd = _group_queries(q_bthd, num_kv_heads).astype(jnp.float32)
  k_bskd = k_bshd.astype(jnp.float32)
  v_bskd = v_bshd.astype(jnp.float32)
  # K/V are shared by every query, so they cannot be masked per query before the
  # products: zero the non-finite ones by select, and put NaN back only where a
  # query sees one.
  finite_bsk = (jnp.all(jnp.isfinite(k_bskd), axis=-1)
                & jnp.all(jnp.isfinite(v_bskd), axis=-1))
  k_bskd = jnp.where(finite_bsk[..., None], k_bskd, 0.0)
  v_bskd = jnp.where(finite_bsk[..., None], v_bskd, 0.0)
  scores_bkgts = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_bskd) / jnp.sqrt(jnp.float32(d))
  mask_b11ts = mask_bts[:, None, None, :, :]
  p_bkgts = safe_softmax(scores_bkgts, mask_b11ts)
  o_btkgd = jnp.einsum("bkgts,bskd->btkgd", p_bkgts, v_bskd)
  sees_bad_btk = jnp.einsum("bts,bsk->btk", mask_bts.astype(jnp.float32),
                            (~finite_bsk).astype(jnp.float32)) > 0
  o_btkgd = jnp.where(sees_bad_btk[..., None, None], jnp.nan, o_btkgd)
  return o_btkgd.reshape(b, t, h, d).astype(q_bthd.dtype)


def safe_softmax(scores, mask):
  """Softmax over the last axis restricted to `mask`; all-masked rows give zeros."""
  scores = jnp.where(mask, scores, _NEG_INF)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.where(mask, jnp.exp(scores - jax.lax.stop_gradient(row_max)), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return p / jnp.where(denom > 0, denom, 1.0)


def visibility_mask(q_pos_bt, k_pos_bs, window=None):
  """[B, T, S] causal visibility by position, optionally within a window."""
  q = q_pos_bt[:, :, None]
  k = k_pos_bs[:, None, :]
  mask = (k >= 0) & (q >= 0) & (k <= q)
  if window is not None:
    mask &= (q - k) < window
  return mask


def causal_attention(q_bthd, k_bshd, v_bshd, q_pos_bt, k_pos_bs):
  """Dense causal attention (F layers)."""
  return masked_attention(q_bthd, k_bshd, v_bshd, visibility_mask(q_pos_bt, k_pos_bs))


def sliding_window_attention(q_bthd, k_bshd, v_bshd, q_pos_bt, k_pos_bs, *, window):
  """Causal attention restricted to the last `window` positions (S layers)."""
  return masked_attention(q_bthd, k_bshd, v_bshd,
                          visibility_mask(q_pos_bt, k_pos_bs, window=window))


def local_window_attention(q_bthd, k_bthd, v_bthd, pos_bt, *, window):
  """Uncached sliding-window self-attention in O(T * W) instead of O(T^2).

  Same result as `sliding_window_attention(q, k, v, pos, pos, window=window)`
  when each row's valid positions are distinct (-1 padding), wherever they
  start and whatever their gaps or order. Tokens are laid out in chunks of
  `window` by their rank among the row's positions: distinct positions less
  than W apart are less than W ranks apart, so a query's window lies in its
  own chunk and the one before.
  """
  b, t, h, d = q_bthd.shape
  c = max(1, min(window, t))
  n = -(-t // c)
  s = n * c
  rows = jnp.arange(b)[:, None]
  valid_bt = pos_bt >= 0
  # Not the position itself: a row starting past 0 would run off the T slots.
  order_bt = jnp.argsort(jnp.where(valid_bt, pos_bt, jnp.iinfo(jnp.int32).max), axis=1)
  rank_bt = jnp.zeros((b, t), jnp.int32).at[rows, order_bt].set(
      jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
  slot_bt = jnp.where(valid_bt, rank_bt, s)  # Padding goes to a dropped slot.

  def by_position(x_bt_):
    buf = jnp.zeros((b, s) + x_bt_.shape[2:], x_bt_.dtype)
    return buf.at[rows, slot_bt].set(x_bt_, mode="drop")

  q_bs, k_bs, v_bs = by_position(q_bthd), by_position(k_bthd), by_position(v_bthd)
  pos_bs = jnp.full((b, s), -1, jnp.int32).at[rows, slot_bt].set(pos_bt, mode="drop")

  def with_previous_chunk(x_bs_, fill):
    x_bnc_ = x_bs_.reshape((b, n, c) + x_bs_.shape[2:])
    pad = ((0, 0), (1, 0)) + ((0, 0),) * (x_bnc_.ndim - 2)
    prev = jnp.pad(x_bnc_, pad, constant_values=fill)[:, :-1]
    return jnp.concatenate([prev, x_bnc_], axis=2).reshape((b * n, 2 * c) + x_bs_.shape[2:])

  mask = visibility_mask(pos_bs.reshape(b * n, c), with_previous_chunk(pos_bs, -1),
                         window=window)
  o_bs = masked_attention(q_bs.reshape((b * n, c) + q_bs.shape[2:]),
                          with_previous_chunk(k_bs, 0), with_previous_chunk(v_bs, 0),
                          mask).reshape(b, s, h, d)
  o_bthd = o_bs[rows, jnp.minimum(slot_bt, s - 1)]
  return jnp.where(valid_bt[..., None, None], o_bthd, 0).astype(q_bthd.dtype)


def block_means(k_bshd, lengths_b, *, block_size):
  """Mean key of every block of a position-indexed key buffer -> [B, N, K, D].

  Only positions below the sequence's length count; an empty block's mean is 0.
  This is the indexer's block summary (mean pooling).
  """
  b, s, k, d = k_bshd.shape
  n = s // block_size
  valid_bs = jnp.arange(s)[None, :] < lengths_b[:, None]
  return _masked_block_mean(k_bshd.reshape(b, n, block_size, k, d),
                            valid_bs.reshape(b, n, block_size))


def _masked_block_mean(k_bnlkd, valid_bnl):
  valid = valid_bnl[..., None, None]
  # Select, not a 0/1 weight: a NaN in a slot past the length must not reach the mean.
  total = jnp.sum(jnp.where(valid, k_bnlkd.astype(jnp.float32), 0.0), axis=2)
  count = jnp.sum(valid.astype(jnp.float32), axis=2)
  return total / jnp.maximum(count, 1.0)


def block_scores(q_bthd, block_keys_bnkd, q_pos_bt, *, block_size):
  """Indexer scores [B, K, T, N] of every key block for every query group.

  Scoring rule: the group's mean query dotted with the block's mean key,
  scaled by 1/sqrt(D). Past blocks keep their score, the query's own block
  scores +inf, future blocks -inf (never selected). `select_blocks` does not
  rely on the +inf: it puts the own block first by construction.
  """
  num_kv_heads = block_keys_bnkd.shape[2]
  d = q_bthd.shape[-1]
  q_btkd = jnp.mean(_group_queries(q_bthd, num_kv_heads).astype(jnp.float32), axis=3)
  scores = jnp.einsum("btkd,bnkd->bktn", q_btkd,
                      block_keys_bnkd.astype(jnp.float32)) / jnp.sqrt(jnp.float32(d))
  own_bt = jnp.where(q_pos_bt >= 0, q_pos_bt // block_size, -1)
  blk = jnp.arange(block_keys_bnkd.shape[1])
  own = own_bt[:, None, :, None]
  scores = jnp.where(blk < own, scores, _NEG_INF)
  return jnp.where(blk == own, jnp.inf, scores)


def select_blocks(q_bthd, block_keys_bnkd, q_pos_bt, *, block_size, num_selected):
  """Top-n block indices [B, K, T, n] per query group; -1 marks an unused slot.

  Slot 0 holds the query's own block; the other n - 1 slots hold its
  highest-scoring past blocks (a NaN score ranks lowest; ties go to the lower
  index). A slot is unused when the query has fewer than n visible blocks,
  and every slot when the query is padding or its own block lies past the
  key buffer. Selection stays in XLA (lax.top_k): no Pallas backend lowers top-k.
  """
  num_blocks = block_keys_bnkd.shape[1]
  own_bt = jnp.where(q_pos_bt >= 0, q_pos_bt // block_size, -1)
  own_bt = jnp.where(own_bt < num_blocks, own_bt, -1).astype(jnp.int32)
  # The own block by construction, not by its +inf score: top_k ranks NaN above
  # +inf, and a past +inf (an overflow) ties with it and wins on the lower index.
  own_bkt1 = jnp.broadcast_to(own_bt[:, None, :, None],
                              (q_pos_bt.shape[0], block_keys_bnkd.shape[2],
                               q_pos_bt.shape[1], 1))
  n = min(num_selected, num_blocks)
  parts = [own_bkt1]
  if n > 1:
    scores_bktn = block_scores(q_bthd, block_keys_bnkd, q_pos_bt, block_size=block_size)
    blk = jnp.arange(num_blocks)
    past_bktn = jnp.where((blk < own_bkt1) & ~jnp.isnan(scores_bktn), scores_bktn, _NEG_INF)
    _, idx = jax.lax.top_k(past_bktn, n - 1)  # Ties (-inf too) go to the lower index.
    parts.append(jnp.where(idx < own_bkt1, idx, -1).astype(jnp.int32))
  if n < num_selected:
    parts.append(jnp.full(own_bkt1.shape[:-1] + (num_selected - n,), -1, jnp.int32))
  return jnp.concatenate(parts, axis=-1)


def block_sparse_attention(q_bthd, k_bshd, v_bshd, blocks_bktn, q_pos_bt, *, block_size):
  """Attention of each query group over the tokens of its selected blocks only.

  k_bshd / v_bshd are position-indexed buffers (key at index s has position s).
  Causality inside a block is kept by position; block index -1 is skipped.
  """
  b, t, h, d = q_bthd.shape
  num_kv_heads = k_bshd.shape[2]
  n = blocks_bktn.shape[-1]
  offs = jnp.arange(block_size)
  tok_bktl = (jnp.maximum(blocks_bktn, 0)[..., None] * block_size + offs).reshape(
      b, num_kv_heads, t, n * block_size)
  valid_bktl = jnp.repeat(blocks_bktn >= 0, block_size, axis=-1)
  valid_bktl &= tok_bktl <= q_pos_bt[:, None, :, None]
  k_bksd = jnp.swapaxes(k_bshd, 1, 2).astype(jnp.float32)
  v_bksd = jnp.swapaxes(v_bshd, 1, 2).astype(jnp.float32)
  gather = jax.vmap(jax.vmap(lambda kv_sd, idx_tl: kv_sd[idx_tl]))  # over B, K
  # Gathered per query, so masked slots (future or stale tokens) are dropped by select.
  k_bktld = jnp.where(valid_bktl[..., None], gather(k_bksd, tok_bktl), 0.0)
  v_bktld = jnp.where(valid_bktl[..., None], gather(v_bksd, tok_bktl), 0.0)
  q_bkgtd = jnp.transpose(_group_queries(q_bthd, num_kv_heads), (0, 2, 3, 1, 4)).astype(
      jnp.float32)
  scores = jnp.einsum("bkgtd,bktld->bkgtl", q_bkgtd, k_bktld) / jnp.sqrt(jnp.float32(d))
  p = safe_softmax(scores, valid_bktl[:, :, None])
  o_bkgtd = jnp.einsum("bkgtl,bktld->bkgtd", p, v_bktld)
  return jnp.transpose(o_bkgtd, (0, 3, 1, 2, 4)).reshape(b, t, h, d).astype(q_bthd.dtype)


def blocks_to_token_mask(blocks_bktn, q_pos_bt, num_keys, *, block_size):
  """The [B, K, T, S] token mask that a block selection implies (for tests/metrics)."""
  blk_s = jnp.arange(num_keys) // block_size
  hit = (blocks_bktn[..., None] == blk_s) & (blocks_bktn[..., None] >= 0)
  mask = jnp.any(hit, axis=-2)
  return mask & (jnp.arange(num_keys) <= q_pos_bt[:, None, :, None])
