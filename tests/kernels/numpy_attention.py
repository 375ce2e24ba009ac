"""Independent float64 numpy references for the attention kernels, written as plain loops.

Nothing here imports `kernels`: each function restates the contract of
agentic_rl/kernels/reference.py from its docstrings (visibility by position, -1 is padding,
a query that sees no key outputs zeros, query head n reads kv head n // (N / K)).
Model tests reuse these for layer-level references.
"""

from __future__ import annotations

import numpy as np


def visibility(q_pos_bt, k_pos_bs, window=None):
  """[B, T, S] bool: key visible when 0 <= p_k <= p_q (and p_q - p_k < window)."""
  q_pos_bt, k_pos_bs = np.asarray(q_pos_bt), np.asarray(k_pos_bs)
  b, t = q_pos_bt.shape
  s = k_pos_bs.shape[1]
  mask = np.zeros((b, t, s), bool)
  for bi in range(b):
    for ti in range(t):
      pq = q_pos_bt[bi, ti]
      for si in range(s):
        pk = k_pos_bs[bi, si]
        ok = pq >= 0 and 0 <= pk <= pq
        if window is not None:
          ok = ok and pq - pk < window
        mask[bi, ti, si] = ok
  return mask


def attention(q_btnh, k_bskh, v_bskh, mask_bkts):
  """Softmax attention with a per-kv-group mask [B, K, T, S] (or [B, T, S] for all groups)."""
  q = np.asarray(q_btnh, np.float64)
  k = np.asarray(k_bskh, np.float64)
  v = np.asarray(v_bskh, np.float64)
  b, t, h, d = q.shape
  num_kv = k.shape[2]
  group = h // num_kv
  mask = np.asarray(mask_bkts)
  if mask.ndim == 3:
    mask = np.broadcast_to(mask[:, None], (b, num_kv) + mask.shape[1:])
  out = np.zeros((b, t, h, d))
  for bi in range(b):
    for ti in range(t):
      for hi in range(h):
        kv = hi // group
        visible = np.nonzero(mask[bi, kv, ti])[0]
        if visible.size == 0:
          continue
        scores = k[bi, visible, kv] @ q[bi, ti, hi] / np.sqrt(d)
        p = np.exp(scores - scores.max())
        out[bi, ti, hi] = (p / p.sum()) @ v[bi, visible, kv]
  return out


def block_means(k_bskh, lengths_b, block_size):
  """[B, C, K, H]: mean of the keys at positions < length in each block; 0 if none."""
  k = np.asarray(k_bskh, np.float64)
  b, s, num_kv, d = k.shape
  n = s // block_size
  out = np.zeros((b, n, num_kv, d))
  for bi in range(b):
    for ni in range(n):
      rows = [p for p in range(ni * block_size, (ni + 1) * block_size) if p < lengths_b[bi]]
      if rows:
        out[bi, ni] = k[bi, rows].mean(axis=0)
  return out


def raw_block_scores(q_btnh, block_keys_bckh):
  """[B, K, T, C]: the group's mean query . the block's mean key / sqrt(H), unmasked."""
  q = np.asarray(q_btnh, np.float64)
  bk = np.asarray(block_keys_bckh, np.float64)
  b, t, h, d = q.shape
  num_kv = bk.shape[2]
  group = h // num_kv
  out = np.zeros((b, num_kv, t, bk.shape[1]))
  for bi in range(b):
    for kv in range(num_kv):
      for ti in range(t):
        q_mean = q[bi, ti, kv * group:(kv + 1) * group].mean(axis=0)
        out[bi, kv, ti] = bk[bi, :, kv] @ q_mean / np.sqrt(d)
  return out


def blocks_token_mask(blocks_bktj, q_pos_bt, num_keys, block_size):
  """[B, K, T, S]: key s is attended when its block is selected and s <= the query position."""
  return blocks_token_counts(blocks_bktj, q_pos_bt, num_keys, block_size) > 0


def check_topk_selection(blocks_bktj, raw_scores_bktc, q_pos_bt, block_size, num_selected,
                         tie_tol=1e-5):
  """Asserts that `blocks` is a top-n selection under the documented rule.

  For a query at position p (own block o = p // B): the own block is always
  selected, no block above o ever is, there are no duplicates, exactly
  min(n, o + 1) slots are used and the rest are -1, and every selected past
  block scores at least as high as every unselected visible one (up to tie_tol,
  so float32 near-ties cannot make the check flaky). Padding queries select nothing.
  """
  blocks = np.asarray(blocks_bktj)
  scores = np.asarray(raw_scores_bktc)
  q_pos = np.asarray(q_pos_bt)
  b, num_kv, t, n = blocks.shape
  assert n == num_selected, (blocks.shape, num_selected)
  for bi in range(b):
    for kv in range(num_kv):
      for ti in range(t):
        row = blocks[bi, kv, ti]
        where = f"(batch {bi}, kv group {kv}, query {ti}, position {q_pos[bi, ti]}): {row}"
        used = row[row >= 0]
        if q_pos[bi, ti] < 0:
          assert used.size == 0, f"padding query selected blocks {where}"
          continue
        own = q_pos[bi, ti] // block_size
        assert len(set(used.tolist())) == used.size, f"duplicate blocks {where}"
        assert np.all(used <= own), f"future block selected {where}"
        assert own in used, f"own block missing {where}"
        assert used.size == min(n, own + 1), f"wrong number of used slots {where}"
        # -1 slots may only trail when fewer than n blocks are visible.
        assert np.sum(row < 0) == n - used.size, f"bad -1 slots {where}"
        past_selected = [x for x in used if x != own]
        past_unselected = [x for x in range(own) if x not in used]
        if past_selected and past_unselected:
          worst_in = min(scores[bi, kv, ti, x] for x in past_selected)
          best_out = max(scores[bi, kv, ti, x] for x in past_unselected)
          assert worst_in >= best_out - tie_tol, (
              f"not the top-n by score {where}: selected min {worst_in}, "
              f"unselected max {best_out}")


def rope(x, positions_bt, theta):
  """Half-split rotary embedding: pairs (i, i + H/2) rotate by p * theta^(-2i/H)."""
  x = np.asarray(x, np.float64)  # [B, T, heads, H]
  pos = np.asarray(positions_bt, np.float64)
  d = x.shape[-1]
  half = d // 2
  out = np.empty_like(x)
  for i in range(half):
    angle = pos * theta ** (-2.0 * i / d)  # [B, T]
    c, s = np.cos(angle)[:, :, None], np.sin(angle)[:, :, None]  # over heads
    x1, x2 = x[..., i], x[..., i + half]
    out[..., i] = x1 * c - x2 * s
    out[..., i + half] = x2 * c + x1 * s
  return out


def attention_vjp(q_btnh, k_bskh, v_bskh, count_bkts, do_btnh):
  """float64 (dq, dk, dv) of sum(attention(q, k, v) * do), from the softmax derivative.

  count_bkts [B, K, T, S] (or [B, T, S]): how many times key s enters query t's softmax
  (0 = masked; a block selected twice counts its keys twice), so
  p_s = c_s e^{x_s} / sum_r c_r e^{x_r} with x_s = q.k_s / sqrt(H), o = sum_s p_s v_s and
  dv_s += p_s do, dx_s = p_s (do.v_s - do.o), dq += sum_s dx_s k_s / sqrt(H),
  dk_s += dx_s q / sqrt(H). A query that sees no key has o = 0 and no gradient.
  """
  do = np.asarray(do_btnh, np.float64)
  q, k, v, rows = _counted_softmax_rows(q_btnh, k_bskh, v_bskh, count_bkts)
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  scale = 1.0 / np.sqrt(q.shape[-1])
  for bi, ti, hi, kv, seen, p in rows:
    o = p @ v[bi, seen, kv]
    dx = p * (v[bi, seen, kv] @ do[bi, ti, hi] - o @ do[bi, ti, hi])
    dq[bi, ti, hi] += dx @ k[bi, seen, kv] * scale
    dk[bi, seen, kv] += np.outer(dx, q[bi, ti, hi]) * scale
    dv[bi, seen, kv] += np.outer(p, do[bi, ti, hi])
  return dq, dk, dv


def attention_counted(q_btnh, k_bskh, v_bskh, count_bkts):
  """`attention` with multiplicities: the forward whose gradient `attention_vjp` is."""
  q, k, v, rows = _counted_softmax_rows(q_btnh, k_bskh, v_bskh, count_bkts)
  out = np.zeros_like(q)
  for bi, ti, hi, kv, seen, p in rows:
    out[bi, ti, hi] = p @ v[bi, seen, kv]
  return out


def _counted_softmax_rows(q_btnh, k_bskh, v_bskh, count_bkts):
  """q, k, v in float64 and, per query that sees a key, (b, t, h, kv head, seen keys, p):
  p_s = c_s e^{x_s} / sum_r c_r e^{x_r} over the keys it sees, x_s = q.k_s / sqrt(H)."""
  q = np.asarray(q_btnh, np.float64)
  k = np.asarray(k_bskh, np.float64)
  v = np.asarray(v_bskh, np.float64)
  b, t, h, d = q.shape
  num_kv = k.shape[2]
  group = h // num_kv
  count = np.asarray(count_bkts, np.float64)
  if count.ndim == 3:
    count = np.broadcast_to(count[:, None], (b, num_kv) + count.shape[1:])

  def rows():
    for bi in range(b):
      for ti in range(t):
        for hi in range(h):
          kv = hi // group
          c = count[bi, kv, ti]
          seen = np.nonzero(c)[0]
          if seen.size == 0:
            continue  # Sees no key: o = 0 and no gradient.
          x = k[bi, seen, kv] @ q[bi, ti, hi] / np.sqrt(d)
          w = c[seen] * np.exp(x - x.max())
          yield bi, ti, hi, kv, seen, w / w.sum()

  return q, k, v, rows()


def blocks_token_counts(blocks_bktj, q_pos_bt, num_keys, block_size):
  """[B, K, T, S]: how many selected slots of the query's group hold key s's block (s <= the
  query position); a block selected twice puts its keys in the softmax twice."""
  blocks = np.asarray(blocks_bktj)
  q_pos = np.asarray(q_pos_bt)
  b, num_kv, t, _ = blocks.shape
  count = np.zeros((b, num_kv, t, num_keys), np.int64)
  for bi in range(b):
    for kv in range(num_kv):
      for ti in range(t):
        for blk in blocks[bi, kv, ti]:
          if blk < 0:
            continue
          for s in range(blk * block_size, min((blk + 1) * block_size, num_keys)):
            if s <= q_pos[bi, ti]:
              count[bi, kv, ti, s] += 1
  return count
