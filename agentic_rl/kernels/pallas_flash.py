"""Flash attention over position-masked key tiles: dense causal (F layers) and
sliding-window (S layers) attention in one Pallas kernel.

Visibility is decided by positions (agentic_rl/kernels/reference.py): key p_k is seen by
query p_q when 0 <= p_k <= p_q (and p_q - p_k < W with a window), so the same
kernel serves plain sequences and the S layer's ring buffer + chunk layout,
whose key order is not monotonic.

Which key tiles a query tile visits is decided in XLA, not in the kernel:
from each tile's min/max valid position a conservative "can any pair be
visible" test gives, per query tile, the list of key tiles to visit (visible
ones first, ascending) and its length. The kernel loops over exactly that many
tiles with an online softmax in float32 and masks exactly inside each tile.
On plain sequences this skips the future (causal) and everything older than
the window (sliding); on the ring layout it skips empty and stale tiles.

Grid: (batch, kv head, query tile). A query tile holds tq positions x Gp query
heads of one GQA group flattened to rows (row = t * Gp + g), so every matmul
is a 2-D [rows, H] x [H, tk] product. K/V of the (batch, kv head) are one
block ([n_tiles, tk, H]) indexed by tile on the leading axis: on GPU that is
a pointer offset; on TPU the whole S x H slab sits in VMEM, which bounds S
(a grid-over-tiles TPU variant would lift that; not built).

Axis letters (agentic_rl/kernels/pallas_common.py): r a row of a query tile, q a query tile,
c a key tile and l a key within it, k kv head, h head dim (hp padded).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from agentic_rl.kernels import pallas_common as pc

DEFAULT_BLOCK_Q_ROWS = 64  # Query rows (positions x heads of a group) per program.
DEFAULT_BLOCK_K = 64  # Keys per tile.
_MIN_ROWS = 16  # Rows per program at least (Triton dot M >= 16; Mosaic sublanes).


def _flash_kernel(count_ref, visit_ref, q_ref, qpos_ref, k_ref, v_ref, kpos_ref, o_ref, *,
                  window, scale, mode):
  # count_ref [1, 1], visit_ref [1, nk]  (int32 tables)
  # q_ref [R, Hp], qpos_ref [R, 1], k_ref / v_ref [nk, tk, Hp], kpos_ref [nk, 1, tk]
  rows, head_dim = q_ref.shape
  q_rh = q_ref[...].astype(jnp.float32)
  qpos_r1 = qpos_ref[...]

  def visit(i, carry):
    tile = visit_ref[0, i]
    k_lh = k_ref[tile].astype(jnp.float32)
    v_lh = v_ref[tile].astype(jnp.float32)
    kpos_1l = kpos_ref[tile]
    mask_rl = (kpos_1l >= 0) & (qpos_r1 >= 0) & (kpos_1l <= qpos_r1)
    if window is not None:
      mask_rl &= (qpos_r1 - kpos_1l) < window
    scores_rl = pc.scores(q_rh, k_lh, mode) * scale
    return pc.softmax_step(carry, scores_rl, mask_rl, v_lh, mode)

  acc_rh, _, l_r1 = jax.lax.fori_loop(0, count_ref[0, 0], visit,
                                      pc.softmax_init(rows, head_dim))
  o_ref[...] = pc.softmax_finish(acc_rh, l_r1).astype(o_ref.dtype)


def _tile_bounds(pos_bcl):
  """Per tile c of positions l: (has a valid position, min valid, max valid)."""
  valid = pos_bcl >= 0
  big = jnp.iinfo(jnp.int32).max
  return (jnp.any(valid, axis=-1), jnp.min(jnp.where(valid, pos_bcl, big), axis=-1),
          jnp.max(jnp.where(valid, pos_bcl, -1), axis=-1))


def visit_lists(q_pos_bqt, k_pos_bcl, window):
  """Key tiles each query tile must visit -> (counts [B, nq], tiles [B, nq, nk]).

  Conservative: a tile pair is visited when some valid key is not after the
  latest valid query and (with a window) not older than the earliest query's
  window. Visited tiles come first in ascending order; the rest is filler.
  """
  has_q, q_min, q_max = _tile_bounds(q_pos_bqt)
  has_k, k_min, k_max = _tile_bounds(k_pos_bcl)
  visible = has_q[:, :, None] & has_k[:, None, :] & (k_min[:, None, :] <= q_max[:, :, None])
  if window is not None:
    visible &= k_max[:, None, :] > q_min[:, :, None] - window
  nk = k_pos_bcl.shape[1]
  tile_ids = jnp.arange(nk, dtype=jnp.int32)
  order = jnp.argsort(jnp.where(visible, tile_ids, tile_ids + nk), axis=-1)
  return jnp.sum(visible, axis=-1).astype(jnp.int32), order.astype(jnp.int32)


def tile_sizes(t: int, s: int, group_pad: int, block_q_rows: int, block_k: int):
  """(query positions per tile, keys per tile), both powers of two."""
  tq = max(1, pc.next_pow2(block_q_rows) // group_pad)
  tq = min(tq, pc.next_pow2(t))
  tq = max(tq, pc.next_pow2(-(-_MIN_ROWS // group_pad)))
  tk = min(pc.next_pow2(block_k), max(_MIN_ROWS, pc.next_pow2(s)))
  return tq, tk


def flash_attention(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, *, window=None,
                    interpret=False, platform=None, block_q_rows=DEFAULT_BLOCK_Q_ROWS,
                    block_k=DEFAULT_BLOCK_K, matmul="auto"):
  """Position-masked GQA attention, optionally windowed; reference semantics.

  q [B, T, N, H], k / v [B, S, K, H], q_pos [B, T], k_pos [B, S] (-1: padding).
  Returns [B, T, N, H] in q's dtype; rows that see no key are zero.
  """
  pc.check_attention_shapes(q_btnh, k_bskh, v_bskh)
  if window is not None and (not isinstance(window, int) or window <= 0):
    raise ValueError(f"window={window!r}: expected a positive integer or None.")
  platform = pc.resolve_platform(platform, interpret)
  b, t, n, h = q_btnh.shape
  s, num_kv_heads = k_bskh.shape[1], k_bskh.shape[2]
  if q_pos_bt.shape != (b, t) or k_pos_bs.shape != (b, s):
    raise ValueError(f"positions q {q_pos_bt.shape} / k {k_pos_bs.shape} do not match "
                     f"q {q_btnh.shape} / k {k_bskh.shape}.")
  gp = pc.next_pow2(n // num_kv_heads)
  hp = pc.padded_head_dim(h)
  tq, tk = tile_sizes(t, s, gp, block_q_rows, block_k)
  tp, sp = pc.round_up(t, tq), pc.round_up(s, tk)
  nq, nk, rows = tp // tq, sp // tk, tq * gp
  mode = pc.resolve_matmul(matmul, platform, rows, tk, hp)

  q_pos = jnp.pad(q_pos_bt.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)
  k_pos = jnp.pad(k_pos_bs.astype(jnp.int32), ((0, 0), (0, sp - s)), constant_values=-1)
  counts_bq, tiles_bqc = visit_lists(q_pos.reshape(b, nq, tq), k_pos.reshape(b, nk, tk),
                                     window)
  q_bktgh = pc.group_queries(q_btnh, num_kv_heads, gp, hp)
  q_bkrh = jnp.pad(q_bktgh, ((0, 0), (0, 0), (0, tp - t), (0, 0), (0, 0))).reshape(
      b, num_kv_heads, tp * gp, hp)
  qpos_br1 = jnp.repeat(q_pos, gp, axis=1)[:, :, None]
  k_bkclh = pc.kv_heads_major(k_bskh, hp, sp).reshape(b, num_kv_heads, nk, tk, hp)
  v_bkclh = pc.kv_heads_major(v_bskh, hp, sp).reshape(b, num_kv_heads, nk, tk, hp)
  kpos_bc1l = k_pos.reshape(b, nk, 1, tk)

  kernel = functools.partial(_flash_kernel, window=window, scale=1.0 / math.sqrt(h),
                             mode=mode)
  o_bkrh = pl.pallas_call(
      kernel,
      grid=(b, num_kv_heads, nq),
      in_specs=[
          pc.table_spec((None, None, 1, 1), lambda i, j, r: (i, r, 0, 0), platform),
          pc.table_spec((None, None, 1, nk), lambda i, j, r: (i, r, 0, 0), platform),
          pl.BlockSpec((None, None, rows, hp), lambda i, j, r: (i, j, r, 0)),
          pl.BlockSpec((None, rows, 1), lambda i, j, r: (i, r, 0)),
          pl.BlockSpec((None, None, nk, tk, hp), lambda i, j, r: (i, j, 0, 0, 0)),
          pl.BlockSpec((None, None, nk, tk, hp), lambda i, j, r: (i, j, 0, 0, 0)),
          pl.BlockSpec((None, nk, 1, tk), lambda i, j, r: (i, 0, 0, 0)),
      ],
      out_specs=pl.BlockSpec((None, None, rows, hp), lambda i, j, r: (i, j, r, 0)),
      out_shape=jax.ShapeDtypeStruct((b, num_kv_heads, tp * gp, hp), q_btnh.dtype),
      interpret=interpret,
      compiler_params=pc.compiler_params(platform, interpret,
                                         ("parallel", "parallel", "parallel")),
      name="flash_window_attention" if window is not None else "flash_causal_attention",
  )(counts_bq.reshape(b, nq, 1, 1), tiles_bqc.reshape(b, nq, 1, nk), q_bkrh, qpos_br1,
    k_bkclh, v_bkclh, kpos_bc1l)
  return pc.ungroup_outputs(o_bkrh.reshape(b, num_kv_heads, tp, gp, hp), t, n, h)
