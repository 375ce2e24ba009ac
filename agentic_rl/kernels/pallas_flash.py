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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from agentic_rl.kernels import pallas_common as pc

DEFAULT_BLOCK_Q_ROWS = 64  # Query rows (positions x heads of a group) per program.
DEFAULT_BLOCK_K = 64  # Keys per tile.
_MIN_ROWS = 16  # Rows per program at least (Triton dot M >= 16; Mosaic sublanes).


def _visible(qpos_r1, kpos_1l, window):
  """[R, L]: key l is seen by query row r (positions; -1 is padding)."""
  mask_rl = (kpos_1l >= 0) & (qpos_r1 >= 0) & (kpos_1l <= qpos_r1)
  if window is not None:
    mask_rl &= (qpos_r1 - kpos_1l) < window
  return mask_rl


def _flash_kernel(count_ref, visit_ref, q_ref, qpos_ref, k_ref, v_ref, kpos_ref, o_ref,
                  *lse_ref, window, scale, mode):
  # count_ref [1, 1], visit_ref [1, nk]  (int32 tables)
  # q_ref [R, Hp], qpos_ref [R, 1], k_ref / v_ref [nk, tk, Hp], kpos_ref [nk, 1, tk]
  # lse_ref (the differentiable forward only) [R, 1]: log sum exp of each row's scores.
  rows, head_dim = q_ref.shape
  q_rh = q_ref[...].astype(jnp.float32)
  qpos_r1 = qpos_ref[...]

  def visit(i, carry):
    tile = visit_ref[0, i]
    k_lh = k_ref[tile].astype(jnp.float32)
    v_lh = v_ref[tile].astype(jnp.float32)
    mask_rl = _visible(qpos_r1, kpos_ref[tile], window)
    scores_rl = pc.scores(q_rh, k_lh, mode) * scale
    return pc.softmax_step(carry, scores_rl, mask_rl, v_lh, mode)

  acc_rh, m_r1, l_r1 = jax.lax.fori_loop(0, count_ref[0, 0], visit,
                                         pc.softmax_init(rows, head_dim))
  o_ref[...] = pc.softmax_finish(acc_rh, l_r1).astype(o_ref.dtype)
  if lse_ref:
    lse_ref[0][...] = pc.log_normaliser(m_r1, l_r1)



def _probabilities(q_rh, k_lh, lse_r1, mask_rl, scale, mode):
  """[R, L] softmax probabilities recomputed from the forward's log-normaliser."""
  scores_rl = pc.scores(q_rh, k_lh, mode) * scale
  return jnp.where(mask_rl, jnp.exp(scores_rl - lse_r1), 0.0)


def _score_grads(p_rl, do_rh, v_lh, delta_r1, mask_rl, mode):
  """d(scores) = p * (dO.v - delta), delta = rowsum(dO * O); 0 off the mask."""
  dp_rl = pc.scores(do_rh, pc.finite_or_zero(v_lh), mode)
  return jnp.where(mask_rl, p_rl * (dp_rl - delta_r1), 0.0)


def _flash_dq_kernel(count_ref, visit_ref, q_ref, do_ref, lse_ref, delta_ref, qpos_ref,
                     k_ref, v_ref, kpos_ref, dq_ref, *, window, scale, mode):
  # Per query tile, as the forward: q / do [R, Hp], lse / delta / qpos [R, 1], the K / V
  # slab [nk, tk, Hp] and its positions [nk, 1, tk], visited through the same tables.
  rows, head_dim = q_ref.shape
  q_rh = q_ref[...].astype(jnp.float32)
  do_rh = do_ref[...].astype(jnp.float32)
  lse_r1, delta_r1, qpos_r1 = lse_ref[...], delta_ref[...], qpos_ref[...]

  def visit(i, dq_rh):
    tile = visit_ref[0, i]
    k_lh = k_ref[tile].astype(jnp.float32)
    mask_rl = _visible(qpos_r1, kpos_ref[tile], window)
    p_rl = _probabilities(q_rh, k_lh, lse_r1, mask_rl, scale, mode)
    ds_rl = _score_grads(p_rl, do_rh, v_ref[tile].astype(jnp.float32), delta_r1, mask_rl,
                         mode)
    return dq_rh + pc.matmul_nn(ds_rl, pc.finite_or_zero(k_lh), mode) * scale

  dq_rh = jax.lax.fori_loop(0, count_ref[0, 0], visit,
                            jnp.zeros((rows, head_dim), jnp.float32))
  dq_ref[...] = dq_rh.astype(dq_ref.dtype)


def _flash_dkdv_kernel(count_ref, visit_ref, q_ref, do_ref, lse_ref, delta_ref, qpos_ref,
                       k_ref, v_ref, kpos_ref, dk_ref, dv_ref, *, window, scale, mode):
  # Per key tile: k / v [tk, Hp], kpos [1, tk]; the query slab q / do [nq, R, Hp] and
  # lse / delta / qpos [nq, R, 1], visited through the transposed tables (the query tiles
  # that visit this key tile). Rows hold every query head of the group, so the sums over
  # rows add up the group's heads: GQA's shared K / V.
  tk, head_dim = k_ref.shape
  k_lh = k_ref[...].astype(jnp.float32)
  v_lh = v_ref[...].astype(jnp.float32)
  kpos_1l = kpos_ref[...]

  def visit(i, carry):
    dk_lh, dv_lh = carry
    tile = visit_ref[0, i]
    q_rh = q_ref[tile].astype(jnp.float32)
    do_rh = do_ref[tile].astype(jnp.float32)
    mask_rl = _visible(qpos_ref[tile], kpos_1l, window)
    p_rl = _probabilities(q_rh, k_lh, lse_ref[tile], mask_rl, scale, mode)
    ds_rl = _score_grads(p_rl, do_rh, v_lh, delta_ref[tile], mask_rl, mode)
    return (dk_lh + pc.matmul_tn(ds_rl, pc.finite_or_zero(q_rh), mode) * scale,
            dv_lh + pc.matmul_tn(p_rl, pc.finite_or_zero(do_rh), mode))

  zeros = jnp.zeros((tk, head_dim), jnp.float32)
  dk_lh, dv_lh = jax.lax.fori_loop(0, count_ref[0, 0], visit, (zeros, zeros))
  dk_ref[...] = dk_lh.astype(dk_ref.dtype)
  dv_ref[...] = dv_lh.astype(dv_ref.dtype)


def _tile_bounds(pos_bcl):
  """Per tile c of positions l: (has a valid position, min valid, max valid)."""
  valid = pos_bcl >= 0
  big = jnp.iinfo(jnp.int32).max
  return (jnp.any(valid, axis=-1), jnp.min(jnp.where(valid, pos_bcl, big), axis=-1),
          jnp.max(jnp.where(valid, pos_bcl, -1), axis=-1))


def visible_tiles(q_pos_bqt, k_pos_bcl, window):
  """[B, nq, nk]: whether query tile q may see any key of key tile c.

  Conservative: a tile pair is visited when some valid key is not after the
  latest valid query and (with a window) not older than the earliest query's
  window.
  """
  has_q, q_min, q_max = _tile_bounds(q_pos_bqt)
  has_k, k_min, k_max = _tile_bounds(k_pos_bcl)
  visible = has_q[:, :, None] & has_k[:, None, :] & (k_min[:, None, :] <= q_max[:, :, None])
  if window is not None:
    visible &= k_max[:, None, :] > q_min[:, :, None] - window
  return visible


def _ordered(visible_bxy):
  """(counts [B, x], ids [B, x, y]): per x, the y it visits first, ascending; then filler."""
  ny = visible_bxy.shape[-1]
  ids = jnp.arange(ny, dtype=jnp.int32)
  order = jnp.argsort(jnp.where(visible_bxy, ids, ids + ny), axis=-1)
  return jnp.sum(visible_bxy, axis=-1).astype(jnp.int32), order.astype(jnp.int32)


def visit_lists(q_pos_bqt, k_pos_bcl, window):
  """Key tiles each query tile must visit -> (counts [B, nq], tiles [B, nq, nk]); visited
  tiles come first in ascending order, the rest is filler (`visible_tiles`)."""
  return _ordered(visible_tiles(q_pos_bqt, k_pos_bcl, window))


def tile_sizes(t: int, s: int, group_pad: int, block_q_rows: int, block_k: int):
  """(query positions per tile, keys per tile), both powers of two."""
  tq = max(1, pc.next_pow2(block_q_rows) // group_pad)
  tq = min(tq, pc.next_pow2(t))
  tq = max(tq, pc.next_pow2(-(-_MIN_ROWS // group_pad)))
  tk = min(pc.next_pow2(block_k), max(_MIN_ROWS, pc.next_pow2(s)))
  return tq, tk


class _Layout(NamedTuple):
  """The kernels' padded, grouped layout of one call's inputs (see the module doc)."""
  b: int
  t: int
  s: int
  n: int
  h: int
  num_kv_heads: int
  gp: int
  hp: int
  tq: int
  tk: int
  nq: int
  nk: int
  rows: int
  mode: str
  platform: str
  q_bkrh: jax.Array  # [B, K, Tp * Gp, Hp]
  qpos_br1: jax.Array  # [B, Tp * Gp, 1]
  k_bkclh: jax.Array  # [B, K, nk, tk, Hp]
  v_bkclh: jax.Array
  kpos_bc1l: jax.Array  # [B, nk, 1, tk]
  visible_bqc: jax.Array  # [B, nq, nk]


def _layout(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, window, interpret, platform,
            block_q_rows, block_k, matmul) -> _Layout:
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
  return _Layout(
      b, t, s, n, h, num_kv_heads, gp, hp, tq, tk, nq, nk, rows, mode, platform,
      q_bkrh=_grouped_rows(q_btnh, num_kv_heads, gp, hp, tp),
      qpos_br1=jnp.repeat(q_pos, gp, axis=1)[:, :, None],
      k_bkclh=pc.kv_heads_major(k_bskh, hp, sp).reshape(b, num_kv_heads, nk, tk, hp),
      v_bkclh=pc.kv_heads_major(v_bskh, hp, sp).reshape(b, num_kv_heads, nk, tk, hp),
      kpos_bc1l=k_pos.reshape(b, nk, 1, tk),
      visible_bqc=visible_tiles(q_pos.reshape(b, nq, tq), k_pos.reshape(b, nk, tk), window))


def _grouped_rows(x_btnh, num_kv_heads, gp, hp, tp):
  """[B, T, N, H] -> [B, K, Tp * Gp, Hp]: query-shaped input in the kernels' row layout."""
  b, t = x_btnh.shape[:2]
  x_bktgh = pc.group_queries(x_btnh, num_kv_heads, gp, hp)
  return jnp.pad(x_bktgh, ((0, 0), (0, 0), (0, tp - t), (0, 0), (0, 0))).reshape(
      b, num_kv_heads, tp * gp, hp)


def _forward_call(lay: _Layout, window, interpret, *, with_lse: bool):
  """o_bkrh [B, K, Tp * Gp, Hp] (and lse_bkr1 [B, K, Tp * Gp, 1] with `with_lse`)."""
  b, num_kv_heads, nq, nk, tk, rows, hp = (lay.b, lay.num_kv_heads, lay.nq, lay.nk, lay.tk,
                                           lay.rows, lay.hp)
  counts_bq, tiles_bqc = _ordered(lay.visible_bqc)
  kernel = functools.partial(_flash_kernel, window=window, scale=1.0 / math.sqrt(lay.h),
                             mode=lay.mode)
  row_spec = lambda width: pl.BlockSpec((None, None, rows, width),
                                        lambda i, j, r: (i, j, r, 0))
  out_specs = [row_spec(hp)]
  out_shape = [jax.ShapeDtypeStruct((b, num_kv_heads, nq * rows, hp), lay.q_bkrh.dtype)]
  if with_lse:
    out_specs.append(row_spec(1))
    out_shape.append(jax.ShapeDtypeStruct((b, num_kv_heads, nq * rows, 1), jnp.float32))
  out = pl.pallas_call(
      kernel,
      grid=(b, num_kv_heads, nq),
      in_specs=[
          pc.table_spec((None, None, 1, 1), lambda i, j, r: (i, r, 0, 0), lay.platform),
          pc.table_spec((None, None, 1, nk), lambda i, j, r: (i, r, 0, 0), lay.platform),
          row_spec(hp),
          pl.BlockSpec((None, rows, 1), lambda i, j, r: (i, r, 0)),
          pl.BlockSpec((None, None, nk, tk, hp), lambda i, j, r: (i, j, 0, 0, 0)),
          pl.BlockSpec((None, None, nk, tk, hp), lambda i, j, r: (i, j, 0, 0, 0)),
          pl.BlockSpec((None, nk, 1, tk), lambda i, j, r: (i, 0, 0, 0)),
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      interpret=interpret,
      compiler_params=pc.compiler_params(lay.platform, interpret,
                                         ("parallel", "parallel", "parallel")),
      name="flash_window_attention" if window is not None else "flash_causal_attention",
  )(counts_bq.reshape(b, nq, 1, 1), tiles_bqc.reshape(b, nq, 1, nk), lay.q_bkrh,
    lay.qpos_br1, lay.k_bkclh, lay.v_bkclh, lay.kpos_bc1l)
  return out if with_lse else (out[0], None)


def _backward_calls(lay: _Layout, window, interpret, do_bkrh, lse_bkr1, delta_bkr1):
  """(dq_bkrh, dk_bkclh, dv_bkclh): one kernel per query tile for dq, one per key tile for
  dk and dv, each visiting only the tile pairs the forward visited."""
  b, num_kv_heads, nq, nk, tk, rows, hp = (lay.b, lay.num_kv_heads, lay.nq, lay.nk, lay.tk,
                                           lay.rows, lay.hp)
  statics = dict(window=window, scale=1.0 / math.sqrt(lay.h), mode=lay.mode)
  params = pc.compiler_params(lay.platform, interpret, ("parallel", "parallel", "parallel"))
  table = lambda shape, index: pc.table_spec(shape, index, lay.platform)
  counts_bq, tiles_bqc = _ordered(lay.visible_bqc)
  row_spec = lambda width: pl.BlockSpec((None, None, rows, width),
                                        lambda i, j, r: (i, j, r, 0))
  slab = lambda shape: pl.BlockSpec((None, None) + shape, lambda i, j, r: (i, j, 0, 0, 0))
  dq_bkrh = pl.pallas_call(
      functools.partial(_flash_dq_kernel, **statics),
      grid=(b, num_kv_heads, nq),
      in_specs=[
          table((None, None, 1, 1), lambda i, j, r: (i, r, 0, 0)),
          table((None, None, 1, nk), lambda i, j, r: (i, r, 0, 0)),
          row_spec(hp), row_spec(hp), row_spec(1), row_spec(1),
          pl.BlockSpec((None, rows, 1), lambda i, j, r: (i, r, 0)),
          slab((nk, tk, hp)), slab((nk, tk, hp)),
          pl.BlockSpec((None, nk, 1, tk), lambda i, j, r: (i, 0, 0, 0)),
      ],
      out_specs=row_spec(hp),
      out_shape=jax.ShapeDtypeStruct(lay.q_bkrh.shape, lay.q_bkrh.dtype),
      interpret=interpret, compiler_params=params, name="flash_attention_dq",
  )(counts_bq.reshape(b, nq, 1, 1), tiles_bqc.reshape(b, nq, 1, nk), lay.q_bkrh, do_bkrh,
    lse_bkr1, delta_bkr1, lay.qpos_br1, lay.k_bkclh, lay.v_bkclh, lay.kpos_bc1l)

  # Transposed tables: per key tile, the query tiles that visit it.
  counts_bc, tiles_bcq = _ordered(jnp.swapaxes(lay.visible_bqc, 1, 2))
  by_tile = lambda x, width: x.reshape(b, num_kv_heads, nq, rows, width)
  key_spec = pl.BlockSpec((None, None, None, tk, hp), lambda i, j, c: (i, j, c, 0, 0))
  dk_bkclh, dv_bkclh = pl.pallas_call(
      functools.partial(_flash_dkdv_kernel, **statics),
      grid=(b, num_kv_heads, nk),
      in_specs=[
          table((None, None, 1, 1), lambda i, j, c: (i, c, 0, 0)),
          table((None, None, 1, nq), lambda i, j, c: (i, c, 0, 0)),
          slab((nq, rows, hp)), slab((nq, rows, hp)), slab((nq, rows, 1)),
          slab((nq, rows, 1)),
          pl.BlockSpec((None, nq, rows, 1), lambda i, j, c: (i, 0, 0, 0)),
          key_spec, key_spec,
          pl.BlockSpec((None, None, 1, tk), lambda i, j, c: (i, c, 0, 0)),
      ],
      out_specs=[key_spec, key_spec],
      out_shape=[jax.ShapeDtypeStruct(lay.k_bkclh.shape, lay.k_bkclh.dtype),
                 jax.ShapeDtypeStruct(lay.v_bkclh.shape, lay.v_bkclh.dtype)],
      interpret=interpret, compiler_params=params, name="flash_attention_dkdv",
  )(counts_bc.reshape(b, nk, 1, 1), tiles_bcq.reshape(b, nk, 1, nq),
    by_tile(lay.q_bkrh, hp), by_tile(do_bkrh, hp), by_tile(lse_bkr1, 1),
    by_tile(delta_bkr1, 1), lay.qpos_br1.reshape(b, nq, rows, 1), lay.k_bkclh, lay.v_bkclh,
    lay.kpos_bc1l)
  return dq_bkrh, dk_bkclh, dv_bkclh


def _kv_from_tiles(x_bkclh, lay: _Layout, dtype):
  """[B, K, nk, tk, Hp] -> [B, S, K, H]."""
  x_bksh = x_bkclh.reshape(lay.b, lay.num_kv_heads, lay.nk * lay.tk, lay.hp)
  return jnp.transpose(x_bksh[:, :, :lay.s, :lay.h], (0, 2, 1, 3)).astype(dtype)


def flash_attention(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, *, window=None,
                    interpret=False, platform=None, block_q_rows=DEFAULT_BLOCK_Q_ROWS,
                    block_k=DEFAULT_BLOCK_K, matmul="auto"):
  """Position-masked GQA attention, optionally windowed; reference semantics.

  q [B, T, N, H], k / v [B, S, K, H], q_pos [B, T], k_pos [B, S] (-1: padding).
  Returns [B, T, N, H] in q's dtype; rows that see no key are zero. Differentiable in q, k
  and v through Pallas backward kernels (`_flash_bwd`).
  """
  statics = (window, interpret, platform, block_q_rows, block_k, matmul)
  return _flash(statics, q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(statics, q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs):
  lay = _layout(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, *statics)
  o_bkrh, _ = _forward_call(lay, statics[0], statics[1], with_lse=False)
  return _ungroup(o_bkrh, lay)


def _ungroup(x_bkrh, lay: _Layout):
  return pc.ungroup_outputs(x_bkrh.reshape(lay.b, lay.num_kv_heads, lay.nq * lay.tq, lay.gp,
                                           lay.hp), lay.t, lay.n, lay.h)


def _flash_fwd(statics, q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs):
  lay = _layout(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, *statics)
  o_bkrh, lse_bkr1 = _forward_call(lay, statics[0], statics[1], with_lse=True)
  return _ungroup(o_bkrh, lay), (q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, o_bkrh,
                                 lse_bkr1)


def _flash_bwd(statics, residuals, do_btnh):
  """FlashAttention-2's backward: probabilities recomputed per tile from the saved
  log-normaliser, delta = rowsum(dO * O); memory O(T + S), never [T, S]."""
  q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, o_bkrh, lse_bkr1 = residuals
  lay = _layout(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, *statics)
  do_bkrh = _grouped_rows(do_btnh.astype(q_btnh.dtype), lay.num_kv_heads, lay.gp, lay.hp,
                          lay.nq * lay.tq)
  delta_bkr1 = jnp.sum(do_bkrh.astype(jnp.float32) * o_bkrh.astype(jnp.float32), axis=-1,
                       keepdims=True)
  dq_bkrh, dk_bkclh, dv_bkclh = _backward_calls(lay, statics[0], statics[1], do_bkrh,
                                                lse_bkr1, delta_bkr1)
  return (_ungroup(dq_bkrh, lay), _kv_from_tiles(dk_bkclh, lay, k_bskh.dtype),
          _kv_from_tiles(dv_bkclh, lay, v_bskh.dtype), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
