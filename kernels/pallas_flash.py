"""Flash attention over position-masked key tiles: dense causal (F layers) and
sliding-window (S layers) attention in one Pallas kernel.

Visibility is decided by positions (kernels/reference.py): key p_k is seen by
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
is a 2-D [rows, D] x [D, tk] product. K/V of the (batch, kv head) are one
block ([n_tiles, tk, D]) indexed by tile on the leading axis: on GPU that is
a pointer offset; on TPU the whole S x D slab sits in VMEM, which bounds S
(a grid-over-tiles TPU variant would lift that; not built).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import pallas_common as pc

DEFAULT_BLOCK_Q_ROWS = 64  # Query rows (positions x heads of a group) per program.
DEFAULT_BLOCK_K = 64  # Keys per tile.
_MIN_ROWS = 16  # Rows per program at least (Triton dot M >= 16; Mosaic sublanes).


def _flash_kernel(count_ref, visit_ref, q_ref, qpos_ref, k_ref, v_ref, kpos_ref, o_ref, *,
                  window, scale, mode):
  # count_ref [1, 1], visit_ref [1, nk]  (int32 tables)
  # q_ref [R, Dp], qpos_ref [R, 1], k_ref / v_ref [nk, tk, Dp], kpos_ref [nk, 1, tk]
  rows, head_dim = q_ref.shape
  q_rd = q_ref[...].astype(jnp.float32)
  qpos_r1 = qpos_ref[...]

  def visit(j, carry):
    tile = visit_ref[0, j]
    k_cd = k_ref[tile].astype(jnp.float32)
    v_cd = v_ref[tile].astype(jnp.float32)
    kpos_1c = kpos_ref[tile]
    mask_rc = (kpos_1c >= 0) & (qpos_r1 >= 0) & (kpos_1c <= qpos_r1)
    if window is not None:
      mask_rc &= (qpos_r1 - kpos_1c) < window
    s_rc = pc.scores(q_rd, k_cd, mode) * scale
    return pc.softmax_step(carry, s_rc, mask_rc, v_cd, mode)

  acc_rd, _, l_r1 = jax.lax.fori_loop(0, count_ref[0, 0], visit,
                                      pc.softmax_init(rows, head_dim))
  o_ref[...] = pc.softmax_finish(acc_rd, l_r1).astype(o_ref.dtype)


def _tile_bounds(pos_bnl):
  """Per tile of positions: (has a valid position, min valid, max valid)."""
  valid = pos_bnl >= 0
  big = jnp.iinfo(jnp.int32).max
  return (jnp.any(valid, axis=-1), jnp.min(jnp.where(valid, pos_bnl, big), axis=-1),
          jnp.max(jnp.where(valid, pos_bnl, -1), axis=-1))


def visit_lists(q_pos_bqt, k_pos_bnc, window):
  """Key tiles each query tile must visit -> (counts [B, nq], tiles [B, nq, nk]).

  Conservative: a tile pair is visited when some valid key is not after the
  latest valid query and (with a window) not older than the earliest query's
  window. Visited tiles come first in ascending order; the rest is filler.
  """
  has_q, q_min, q_max = _tile_bounds(q_pos_bqt)
  has_k, k_min, k_max = _tile_bounds(k_pos_bnc)
  visible = has_q[:, :, None] & has_k[:, None, :] & (k_min[:, None, :] <= q_max[:, :, None])
  if window is not None:
    visible &= k_max[:, None, :] > q_min[:, :, None] - window
  nk = k_pos_bnc.shape[1]
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


def flash_attention(q_bthd, k_bshd, v_bshd, q_pos_bt, k_pos_bs, *, window=None,
                    interpret=False, platform=None, block_q_rows=DEFAULT_BLOCK_Q_ROWS,
                    block_k=DEFAULT_BLOCK_K, matmul="auto"):
  """Position-masked GQA attention, optionally windowed; reference semantics.

  q [B, T, H, D], k / v [B, S, K, D], q_pos [B, T], k_pos [B, S] (-1: padding).
  Returns [B, T, H, D] in q's dtype; rows that see no key are zero.
  """
  pc.check_attention_shapes(q_bthd, k_bshd, v_bshd)
  if window is not None and (not isinstance(window, int) or window <= 0):
    raise ValueError(f"window={window!r}: expected a positive integer or None.")
  platform = pc.resolve_platform(platform, interpret)
  b, t, h, d = q_bthd.shape
  s, num_kv_heads = k_bshd.shape[1], k_bshd.shape[2]
  if q_pos_bt.shape != (b, t) or k_pos_bs.shape != (b, s):
    raise ValueError(f"positions q {q_pos_bt.shape} / k {k_pos_bs.shape} do not match "
                     f"q {q_bthd.shape} / k {k_bshd.shape}.")
  gp = pc.next_pow2(h // num_kv_heads)
  dp = pc.padded_head_dim(d)
  tq, tk = tile_sizes(t, s, gp, block_q_rows, block_k)
  tp, sp = pc.round_up(t, tq), pc.round_up(s, tk)
  nq, nk, rows = tp // tq, sp // tk, tq * gp
  mode = pc.resolve_matmul(matmul, platform, rows, tk, dp)

  q_pos = jnp.pad(q_pos_bt.astype(jnp.int32), ((0, 0), (0, tp - t)), constant_values=-1)
  k_pos = jnp.pad(k_pos_bs.astype(jnp.int32), ((0, 0), (0, sp - s)), constant_values=-1)
  counts_bq, tiles_bqn = visit_lists(q_pos.reshape(b, nq, tq), k_pos.reshape(b, nk, tk),
                                     window)
  q_bkrd = pc.group_queries(q_bthd, num_kv_heads, gp, dp)
  q_bkrd = jnp.pad(q_bkrd, ((0, 0), (0, 0), (0, tp - t), (0, 0), (0, 0))).reshape(
      b, num_kv_heads, tp * gp, dp)
  qpos_br1 = jnp.repeat(q_pos, gp, axis=1)[:, :, None]
  k_bkncd = pc.kv_heads_major(k_bshd, dp, sp).reshape(b, num_kv_heads, nk, tk, dp)
  v_bkncd = pc.kv_heads_major(v_bshd, dp, sp).reshape(b, num_kv_heads, nk, tk, dp)
  kpos_bn1c = k_pos.reshape(b, nk, 1, tk)

  kernel = functools.partial(_flash_kernel, window=window, scale=1.0 / math.sqrt(d),
                             mode=mode)
  o_bkrd = pl.pallas_call(
      kernel,
      grid=(b, num_kv_heads, nq),
      in_specs=[
          pc.table_spec((None, None, 1, 1), lambda i, j, r: (i, r, 0, 0), platform),
          pc.table_spec((None, None, 1, nk), lambda i, j, r: (i, r, 0, 0), platform),
          pl.BlockSpec((None, None, rows, dp), lambda i, j, r: (i, j, r, 0)),
          pl.BlockSpec((None, rows, 1), lambda i, j, r: (i, r, 0)),
          pl.BlockSpec((None, None, nk, tk, dp), lambda i, j, r: (i, j, 0, 0, 0)),
          pl.BlockSpec((None, None, nk, tk, dp), lambda i, j, r: (i, j, 0, 0, 0)),
          pl.BlockSpec((None, nk, 1, tk), lambda i, j, r: (i, 0, 0, 0)),
      ],
      out_specs=pl.BlockSpec((None, None, rows, dp), lambda i, j, r: (i, j, r, 0)),
      out_shape=jax.ShapeDtypeStruct((b, num_kv_heads, tp * gp, dp), q_bthd.dtype),
      interpret=interpret,
      compiler_params=pc.compiler_params(platform, interpret,
                                         ("parallel", "parallel", "parallel")),
      name="flash_window_attention" if window is not None else "flash_causal_attention",
  )(counts_bq.reshape(b, nq, 1, 1), tiles_bqn.reshape(b, nq, 1, nk), q_bkrd, qpos_br1,
    k_bkncd, v_bkncd, kpos_bn1c)
  return pc.ungroup_outputs(o_bkrd.reshape(b, num_kv_heads, tp, gp, dp), t, h, d)
