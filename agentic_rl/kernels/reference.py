"""Pure-jnp reference attention ops: the contract every fast kernel implements.

Shapes: B batch, T queries, S keys, N query heads, K kv heads (N = K * G), H head
dim, C key blocks, J selected blocks per query group, L tokens per block. Names carry
one lowercase letter per axis (q_btnh, k_bskh, blocks_bktj): b, t, s, n, k, g, h, c,
j, l as above, d d_model (agentic_rl/model/attention.py); a letter means one axis.

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


def _group_queries(q_btnh, num_kv_heads):
  """[B, T, N, H] -> [B, T, K, G, H]."""
  b, t, n, h = q_btnh.shape
  return q_btnh.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def masked_attention(q_btnh, k_bskh, v_bskh, mask_bts):
  """Grouped-query softmax attention with an explicit [B, T, S] mask.

  Softmax runs in float32. Rows with no visible key return zeros.
  """
  b, t, n, h = q_btnh.shape
  num_kv_heads = k_bskh.shape[2]
  if t == 1:
    return _one_query_attention(q_btnh, k_bskh, v_bskh, mask_bts)
  q_btkgh = _group_queries(q_btnh, num_kv_heads).astype(jnp.float32)
  k_bskh = k_bskh.astype(jnp.float32)
  v_bskh = v_bskh.astype(jnp.float32)
  # K/V are shared by every query, so they cannot be masked per query before the
  # products: zero the non-finite ones by select, and put NaN back only where a
  # query sees one.
  finite_bsk = (jnp.all(jnp.isfinite(k_bskh), axis=-1)
                & jnp.all(jnp.isfinite(v_bskh), axis=-1))
  k_bskh = jnp.where(finite_bsk[..., None], k_bskh, 0.0)
  v_bskh = jnp.where(finite_bsk[..., None], v_bskh, 0.0)
  scores_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh) / jnp.sqrt(jnp.float32(h))
  mask_b11ts = mask_bts[:, None, None, :, :]
  p_bkgts = safe_softmax(scores_bkgts, mask_b11ts)
  o_btkgh = jnp.einsum("bkgts,bskh->btkgh", p_bkgts, v_bskh)
  sees_bad_btk = jnp.einsum("bts,bsk->btk", mask_bts.astype(jnp.float32),
                            (~finite_bsk).astype(jnp.float32)) > 0
  o_btkgh = jnp.where(sees_bad_btk[..., None, None], jnp.nan, o_btkgh)
  return o_btkgh.reshape(b, t, n, h).astype(q_btnh.dtype)


def _one_query_attention(q_btnh, k_bskh, v_bskh, mask_bts):
  """`masked_attention` for one query per row (a decode step).

  Every kv head's scores come from one [S, K*H] x [K*H, K*G] dot per row, the queries laid
  out block-diagonally, and the output from one [K*G, S] x [S, K*H] dot. That is K times
  the score FLOPs, but XLA:CPU runs these dots far nearer its bytes roofline than per-head
  products and sums, or batched [G, H] x [H, S] dots (`launch/bench_decode_parts.py`'s
  attention_ms and forward_ms, run before and after b92790d).
  The rules are the many-query path's, at row grain: an unseen key or value cannot reach
  the output (a key by the softmax's select, a value by a select), and a seen non-finite
  one makes the row's output NaN. The many-query path makes only that kv group NaN; the
  output projection mixes the groups, so the model's output is the same."""
  b, t, n, h = q_btnh.shape
  num_kv_heads = k_bskh.shape[2]
  s = k_bskh.shape[1]
  g = n // num_kv_heads
  q_bkgh = _group_queries(q_btnh, num_kv_heads)[:, 0].astype(jnp.float32)
  eye_kj = jnp.eye(num_kv_heads, dtype=jnp.float32)
  # [B, K*H, K*G]: head k's queries in rows k*H:(k+1)*H and columns k*G:(k+1)*G.
  q_bcn = jnp.einsum("bkgh,kj->bkhjg", q_bkgh, eye_kj).reshape(
      b, num_kv_heads * h, num_kv_heads * g)
  mask_bs1 = mask_bts[:, 0, :, None]
  k_bsc = k_bskh.astype(jnp.float32).reshape(b, s, num_kv_heads * h)
  v_bsc = jnp.where(mask_bs1, v_bskh.astype(jnp.float32).reshape(b, s, num_kv_heads * h), 0.0)
  scores_bsn = jnp.einsum("bsc,bcn->bsn", k_bsc, q_bcn) / jnp.sqrt(jnp.float32(h))
  p_bsn = safe_softmax(scores_bsn, mask_bs1, axis=1)
  o_bkgjh = jnp.einsum("bsn,bsc->bnc", p_bsn, v_bsc).reshape(b, num_kv_heads, g,
                                                            num_kv_heads, h)
  o_bkgh = jnp.moveaxis(jnp.diagonal(o_bkgjh, axis1=1, axis2=3), -1, 1)
  # A seen -inf score has weight 0, so the output alone would not show it.
  bad_b = (jnp.any(mask_bs1 & ~jnp.isfinite(scores_bsn), axis=(1, 2))
           | jnp.any(~jnp.isfinite(o_bkgh), axis=(1, 2, 3)))
  o_bkgh = jnp.where(bad_b[:, None, None, None], jnp.nan, o_bkgh)
  return o_bkgh.reshape(b, t, n, h).astype(q_btnh.dtype)


def safe_softmax(scores, mask, axis: int = -1):
  """Softmax over `axis` restricted to `mask`; all-masked rows give zeros."""
  scores = jnp.where(mask, scores, _NEG_INF)
  row_max = jnp.max(scores, axis=axis, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.where(mask, jnp.exp(scores - jax.lax.stop_gradient(row_max)), 0.0)
  denom = jnp.sum(p, axis=axis, keepdims=True)
  return p / jnp.where(denom > 0, denom, 1.0)


def visibility_mask(q_pos_bt, k_pos_bs, window=None):
  """[B, T, S] causal visibility by position, optionally within a window."""
  q = q_pos_bt[:, :, None]
  k = k_pos_bs[:, None, :]
  mask = (k >= 0) & (q >= 0) & (k <= q)
  if window is not None:
    mask &= (q - k) < window
  return mask


def causal_attention(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs):
  """Dense causal attention (F layers)."""
  return masked_attention(q_btnh, k_bskh, v_bskh, visibility_mask(q_pos_bt, k_pos_bs))


def sliding_window_attention(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, *, window):
  """Causal attention restricted to the last `window` positions (S layers)."""
  return masked_attention(q_btnh, k_bskh, v_bskh,
                          visibility_mask(q_pos_bt, k_pos_bs, window=window))


def local_window_attention(q_btnh, k_btkh, v_btkh, pos_bt, *, window, chunks_per_window=4):
  """Uncached sliding-window self-attention in O(T * W) instead of O(T^2).

  Same result as `sliding_window_attention(q, k, v, pos, pos, window=window)`
  when each row's valid positions are distinct (-1 padding), wherever they
  start and whatever their gaps or order. Tokens are laid out in chunks of
  ceil(W / chunks_per_window) slots by their rank among the row's positions:
  distinct positions less than W apart are less than W ranks apart, so a query's
  window lies in its own chunk and the chunks_per_window before it. Each query then
  scores (1 + 1 / chunks_per_window) W keys, not 2 W as with chunks of W. Chunks are
  blocks of `chunk` slots here: c the chunk, l the slot within it.
  """
  b, t, n, h = q_btnh.shape
  chunk = max(1, min(-(-window // chunks_per_window), t))
  back = -(-(window - 1) // chunk)  # Earlier chunks a window can reach into.
  num_chunks = -(-t // chunk)
  s = num_chunks * chunk
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

  q_bsnh, k_bskh, v_bskh = by_position(q_btnh), by_position(k_btkh), by_position(v_btkh)
  pos_bs = jnp.full((b, s), -1, jnp.int32).at[rows, slot_bt].set(pos_bt, mode="drop")

  def with_earlier_chunks(x_bs_, fill):
    x_bcl_ = x_bs_.reshape((b, num_chunks, chunk) + x_bs_.shape[2:])
    pad = ((0, 0), (back, 0)) + ((0, 0),) * (x_bcl_.ndim - 2)
    padded = jnp.pad(x_bcl_, pad, constant_values=fill)
    parts = [padded[:, i:i + num_chunks] for i in range(back + 1)]  # Oldest first.
    return jnp.concatenate(parts, axis=2).reshape(
        (b * num_chunks, (back + 1) * chunk) + x_bs_.shape[2:])

  mask = visibility_mask(pos_bs.reshape(b * num_chunks, chunk),
                         with_earlier_chunks(pos_bs, -1), window=window)
  o_bsnh = masked_attention(q_bsnh.reshape((b * num_chunks, chunk) + q_bsnh.shape[2:]),
                            with_earlier_chunks(k_bskh, 0), with_earlier_chunks(v_bskh, 0),
                            mask).reshape(b, s, n, h)
  o_btnh = o_bsnh[rows, jnp.minimum(slot_bt, s - 1)]
  return jnp.where(valid_bt[..., None, None], o_btnh, 0).astype(q_btnh.dtype)


def block_means(k_bskh, lengths_b, *, block_size):
  """Mean key of every block of a position-indexed key buffer -> [B, C, K, H].

  Only positions below the sequence's length count; an empty block's mean is 0.
  This is the indexer's block summary (mean pooling).
  """
  b, s, k, h = k_bskh.shape
  num_blocks = s // block_size
  valid_bs = jnp.arange(s)[None, :] < lengths_b[:, None]
  return _masked_block_mean(k_bskh.reshape(b, num_blocks, block_size, k, h),
                            valid_bs.reshape(b, num_blocks, block_size))


def _masked_block_mean(k_bclkh, valid_bcl):
  """Mean over l of the valid keys: [B, C, L, K, H] -> [B, C, K, H] (any two leading axes)."""
  valid = valid_bcl[..., None, None]
  # Select, not a 0/1 weight: a NaN in a slot past the length must not reach the mean.
  total = jnp.sum(jnp.where(valid, k_bclkh.astype(jnp.float32), 0.0), axis=2)
  count = jnp.sum(valid.astype(jnp.float32), axis=2)
  return total / jnp.maximum(count, 1.0)


def block_scores(q_btnh, block_keys_bckh, q_pos_bt, *, block_size):
  """Indexer scores [B, K, T, C] of every key block for every query group.

  Scoring rule: the group's mean query dotted with the block's mean key,
  scaled by 1/sqrt(H). Past blocks keep their score, the query's own block
  scores +inf, future blocks -inf (never selected). `select_blocks` does not
  rely on the +inf: it puts the own block first by construction.
  """
  num_kv_heads = block_keys_bckh.shape[2]
  h = q_btnh.shape[-1]
  # The mean over the group's G query heads: one query per kv head.
  q_mean_btkh = jnp.mean(_group_queries(q_btnh, num_kv_heads).astype(jnp.float32), axis=3)
  block_keys_bckh = block_keys_bckh.astype(jnp.float32)
  scores_bktc = jnp.einsum("btkh,bckh->bktc", q_mean_btkh,
                           block_keys_bckh) / jnp.sqrt(jnp.float32(h))
  own_bt = jnp.where(q_pos_bt >= 0, q_pos_bt // block_size, -1)
  blk_c = jnp.arange(block_keys_bckh.shape[1])
  own_b1t1 = own_bt[:, None, :, None]
  scores_bktc = jnp.where(blk_c < own_b1t1, scores_bktc, _NEG_INF)
  return jnp.where(blk_c == own_b1t1, jnp.inf, scores_bktc)


def select_blocks(q_btnh, block_keys_bckh, q_pos_bt, *, block_size, num_selected):
  """Top-J block indices [B, K, T, J] per query group (J = num_selected); -1 marks an
  unused slot.

  Slot 0 holds the query's own block; the other J - 1 slots hold its
  highest-scoring past blocks (a NaN score ranks lowest; ties go to the lower
  index). A slot is unused when the query has fewer than J visible blocks,
  and every slot when the query is padding or its own block lies past the
  key buffer. Selection stays in XLA (lax.top_k): no Pallas backend lowers top-k.
  """
  num_blocks = block_keys_bckh.shape[1]
  own_bt = jnp.where(q_pos_bt >= 0, q_pos_bt // block_size, -1)
  own_bt = jnp.where(own_bt < num_blocks, own_bt, -1).astype(jnp.int32)
  # The own block by construction, not by its +inf score: top_k ranks NaN above
  # +inf, and a past +inf (an overflow) ties with it and wins on the lower index.
  own_bkt1 = jnp.broadcast_to(own_bt[:, None, :, None],
                              (q_pos_bt.shape[0], block_keys_bckh.shape[2],
                               q_pos_bt.shape[1], 1))
  num_top = min(num_selected, num_blocks)
  parts = [own_bkt1]
  if num_top > 1:
    scores_bktc = block_scores(q_btnh, block_keys_bckh, q_pos_bt, block_size=block_size)
    blk_c = jnp.arange(num_blocks)
    past_bktc = jnp.where((blk_c < own_bkt1) & ~jnp.isnan(scores_bktc), scores_bktc,
                          _NEG_INF)
    _, idx_bktj = jax.lax.top_k(past_bktc, num_top - 1)  # Ties (-inf too): lower index.
    parts.append(jnp.where(idx_bktj < own_bkt1, idx_bktj, -1).astype(jnp.int32))
  if num_top < num_selected:
    parts.append(jnp.full(own_bkt1.shape[:-1] + (num_selected - num_top,), -1, jnp.int32))
  return jnp.concatenate(parts, axis=-1)


def block_sparse_attention(q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt, *, block_size):
  """Attention of each query group over the tokens of its selected blocks only.

  k_bskh / v_bskh are position-indexed buffers (key at index s has position s).
  Causality inside a block is kept by position; block index -1 is skipped.
  Below, m indexes the J * L tokens of a query group's selected blocks.
  """
  b, t, n, h = q_btnh.shape
  num_kv_heads = k_bskh.shape[2]
  num_slots = blocks_bktj.shape[-1]
  offs_l = jnp.arange(block_size)
  tok_bktm = (jnp.maximum(blocks_bktj, 0)[..., None] * block_size + offs_l).reshape(
      b, num_kv_heads, t, num_slots * block_size)
  valid_bktm = jnp.repeat(blocks_bktj >= 0, block_size, axis=-1)
  valid_bktm &= tok_bktm <= q_pos_bt[:, None, :, None]
  k_bksh = jnp.swapaxes(k_bskh, 1, 2).astype(jnp.float32)
  v_bksh = jnp.swapaxes(v_bskh, 1, 2).astype(jnp.float32)
  gather = jax.vmap(jax.vmap(lambda kv_sh, idx_tm: kv_sh[idx_tm]))  # over B, K
  # Gathered per query, so masked slots (future or stale tokens) are dropped by select.
  k_bktmh = jnp.where(valid_bktm[..., None], gather(k_bksh, tok_bktm), 0.0)
  v_bktmh = jnp.where(valid_bktm[..., None], gather(v_bksh, tok_bktm), 0.0)
  q_bkgth = jnp.transpose(_group_queries(q_btnh, num_kv_heads), (0, 2, 3, 1, 4)).astype(
      jnp.float32)
  scores_bkgtm = jnp.einsum("bkgth,bktmh->bkgtm", q_bkgth, k_bktmh) / jnp.sqrt(
      jnp.float32(h))
  p_bkgtm = safe_softmax(scores_bkgtm, valid_bktm[:, :, None])
  o_bkgth = jnp.einsum("bkgtm,bktmh->bkgth", p_bkgtm, v_bktmh)
  return jnp.transpose(o_bkgth, (0, 3, 1, 2, 4)).reshape(b, t, n, h).astype(q_btnh.dtype)


def blocks_to_token_mask(blocks_bktj, q_pos_bt, num_keys, *, block_size):
  """The [B, K, T, S] token mask that a block selection implies (for tests/metrics)."""
  blk_s = jnp.arange(num_keys) // block_size
  hit_bktjs = (blocks_bktj[..., None] == blk_s) & (blocks_bktj[..., None] >= 0)
  mask_bkts = jnp.any(hit_bktjs, axis=-2)
  return mask_bkts & (jnp.arange(num_keys) <= q_pos_bt[:, None, :, None])
