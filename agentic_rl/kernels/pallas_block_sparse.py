"""Block-sparse GQA attention (G layers) as a portable Pallas kernel.

Every query group attends only to the key blocks the indexer selected for it
(agentic_rl/kernels/reference.block_sparse_attention). The selection [B, K, T, J] comes
in as an ordinary int32 input; selection itself (top-k) stays in XLA.

Grid: (batch, kv head, query position). One program holds the Gp query heads
of a GQA group at one position (they share the selection) and loops over the
J selected slots: slot -1 is skipped, otherwise block `blk` of the
position-indexed K/V buffer is read by a dynamic index on its leading axis
(k_ref[blk] -> [block_size, H], i.e. tokens blk*bs .. blk*bs+bs-1) and folded
into a float32 online softmax. Causality inside a block is by position:
token blk*bs + i is seen when it is <= the query's position (-1: nothing).
A block index past the buffer is clamped for the read, like the reference's
gather; its tokens lie beyond every position stored, so they are masked.

K/V of one (batch, kv head) are a single block: on GPU a pointer base, on TPU
a VMEM slab, which bounds the context; agentic_rl/kernels/pallas_block_sparse_tpu.py
fetches only the selected blocks with scalar prefetch instead.

Axis letters (agentic_rl/kernels/pallas_common.py): r a row (a query head of the group), c a key
block and l a token within it, j a selection slot, g group, h head dim (hp padded).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from agentic_rl.kernels import pallas_common as pc


def _block_sparse_kernel(blocks_ref, q_ref, qpos_ref, k_ref, v_ref, o_ref, *lse_ref,
                         block_size, scale, mode):
  # blocks_ref [1, J] (int32 table), q_ref [Gp, Hp], qpos_ref [Gp, 1],
  # k_ref / v_ref [C, bs, Hp], o_ref [Gp, Hp]; lse_ref (differentiable forward) [Gp, 1].
  rows, head_dim = q_ref.shape
  num_blocks = k_ref.shape[0]
  num_slots = blocks_ref.shape[1]
  q_rh = q_ref[...].astype(jnp.float32)
  qpos_r1 = qpos_ref[...]
  offsets_1l = jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)

  def slot(j, carry):
    blk = blocks_ref[0, j]

    def attend(carry):
      stored = jnp.minimum(blk, num_blocks - 1)
      k_lh = k_ref[stored].astype(jnp.float32)
      v_lh = v_ref[stored].astype(jnp.float32)
      mask_rl = jnp.broadcast_to(blk * block_size + offsets_1l <= qpos_r1,
                                 (rows, block_size))
      scores_rl = pc.scores(q_rh, k_lh, mode) * scale
      return pc.softmax_step(carry, scores_rl, mask_rl, v_lh, mode)

    return jax.lax.cond(blk >= 0, attend, lambda c: c, carry)

  acc_rh, m_r1, l_r1 = jax.lax.fori_loop(0, num_slots, slot, pc.softmax_init(rows, head_dim))
  o_ref[...] = pc.softmax_finish(acc_rh, l_r1).astype(o_ref.dtype)
  if lse_ref:
    lse_ref[0][...] = pc.log_normaliser(m_r1, l_r1)



def _block_sparse_bwd_kernel(blocks_ref, q_ref, do_ref, lse_ref, delta_ref, qpos_ref, k_ref,
                             v_ref, dq_ref, dk_ref, dv_ref, *, block_size, scale, mode):
  # As the forward, plus do_ref [Gp, Hp], lse_ref / delta_ref [Gp, 1]; out: dq_ref [Gp, Hp]
  # and this query's share of dk / dv per selection slot, dk_ref / dv_ref [J, bs, Hp]
  # (summed into the key blocks in XLA: a block selected twice gets both shares).
  rows, head_dim = q_ref.shape
  num_blocks = k_ref.shape[0]
  num_slots = blocks_ref.shape[1]
  q_rh = q_ref[...].astype(jnp.float32)
  do_rh = do_ref[...].astype(jnp.float32)
  lse_r1, delta_r1, qpos_r1 = lse_ref[...], delta_ref[...], qpos_ref[...]
  offsets_1l = jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
  zeros_lh = jnp.zeros((block_size, head_dim), jnp.float32)

  def slot(j, dq_rh):
    blk = blocks_ref[0, j]
    stored = jnp.minimum(jnp.maximum(blk, 0), num_blocks - 1)
    k_lh = k_ref[stored].astype(jnp.float32)
    v_lh = v_ref[stored].astype(jnp.float32)
    mask_rl = jnp.broadcast_to((blk >= 0) & (blk * block_size + offsets_1l <= qpos_r1),
                               (rows, block_size))
    scores_rl = pc.scores(q_rh, k_lh, mode) * scale
    p_rl = jnp.where(mask_rl, jnp.exp(scores_rl - lse_r1), 0.0)
    dp_rl = pc.scores(do_rh, pc.finite_or_zero(v_lh), mode)
    ds_rl = jnp.where(mask_rl, p_rl * (dp_rl - delta_r1), 0.0)
    dk_ref[j] = jnp.where(blk >= 0, pc.matmul_tn(ds_rl, q_rh, mode) * scale,
                          zeros_lh).astype(dk_ref.dtype)
    dv_ref[j] = jnp.where(blk >= 0, pc.matmul_tn(p_rl, do_rh, mode),
                          zeros_lh).astype(dv_ref.dtype)
    return dq_rh + pc.matmul_nn(ds_rl, pc.finite_or_zero(k_lh), mode) * scale

  dq_rh = jax.lax.fori_loop(0, num_slots, slot, jnp.zeros((rows, head_dim), jnp.float32))
  dq_ref[...] = dq_rh.astype(dq_ref.dtype)


def check_block_sparse_inputs(q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt, block_size):
  pc.check_attention_shapes(q_btnh, k_bskh, v_bskh)
  b, t = q_btnh.shape[:2]
  num_kv_heads = k_bskh.shape[2]
  if not isinstance(block_size, int) or block_size <= 0:
    raise ValueError(f"block_size={block_size!r}: expected a positive integer.")
  if blocks_bktj.ndim != 4 or blocks_bktj.shape[:3] != (b, num_kv_heads, t):
    raise ValueError(f"blocks {blocks_bktj.shape}: expected [B, K, T, J] = "
                     f"[{b}, {num_kv_heads}, {t}, J].")
  if q_pos_bt.shape != (b, t):
    raise ValueError(f"q_pos {q_pos_bt.shape}: expected [B, T] = [{b}, {t}].")


@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """What both block-sparse kernels (this one and the TPU prefetch variant) feed their
  grid: queries grouped per kv head and padded, keys and values cut into blocks."""
  gp: int  # Query heads per kv head, padded to a power of two.
  hp: int  # head_dim, padded.
  num_blocks: int
  q_bktgh: jax.Array
  k_bkclh: jax.Array
  v_bkclh: jax.Array


def block_layout(q_btnh, k_bskh, v_bskh, block_size: int) -> BlockLayout:
  b, _, n, h = q_btnh.shape
  s, num_kv_heads = k_bskh.shape[1], k_bskh.shape[2]
  gp = pc.next_pow2(n // num_kv_heads)
  hp = pc.padded_head_dim(h)
  sp = pc.round_up(s, block_size)
  num_blocks = sp // block_size

  def blocked(x_bskh):
    return pc.kv_heads_major(x_bskh, hp, sp).reshape(b, num_kv_heads, num_blocks,
                                                     block_size, hp)

  return BlockLayout(gp, hp, num_blocks, pc.group_queries(q_btnh, num_kv_heads, gp, hp),
                     blocked(k_bskh), blocked(v_bskh))


def block_sparse_attention(q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt, *, block_size,
                           interpret=False, platform=None, matmul="auto"):
  """Attention over the selected key blocks only; reference semantics.

  q [B, T, N, H]; k / v position-indexed [B, S, K, H]; blocks int [B, K, T, J]
  (-1: unused slot); q_pos [B, T]. Returns [B, T, N, H] in q's dtype. Differentiable in
  q, k and v through a Pallas backward kernel (`_sparse_bwd`).
  """
  check_block_sparse_inputs(q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt, block_size)
  return _sparse((block_size, interpret, platform, matmul), q_btnh, k_bskh, v_bskh,
                 blocks_bktj, q_pos_bt)


def _prepare(statics, q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt):
  block_size, interpret, platform, matmul = statics
  platform = pc.resolve_platform(platform, interpret)
  b, t = q_btnh.shape[:2]
  layout = block_layout(q_btnh, k_bskh, v_bskh, block_size)
  mode = pc.resolve_matmul(matmul, platform, layout.gp, block_size, layout.hp)
  qpos_btg1 = jnp.broadcast_to(q_pos_bt.astype(jnp.int32)[:, :, None, None],
                               (b, t, layout.gp, 1))
  blocks_bkt1j = blocks_bktj.astype(jnp.int32)[:, :, :, None, :]
  return platform, layout, mode, qpos_btg1, blocks_bkt1j


def _specs(layout: BlockLayout, block_size: int):
  """(the K / V slab's BlockSpec, a query row block's BlockSpec of a given width) on the
  (batch, kv head, query position) grid."""
  kv_spec = pl.BlockSpec((None, None, layout.num_blocks, block_size, layout.hp),
                         lambda i, j, r: (i, j, 0, 0, 0))
  row_spec = lambda width: pl.BlockSpec((None, None, None, layout.gp, width),
                                        lambda i, j, r: (i, j, r, 0, 0))
  return kv_spec, row_spec


def _forward_call(statics, q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt, *, with_lse):
  """(o_bktgh, lse_bktg1 or None) in the grouped, padded layout."""
  block_size, interpret = statics[:2]
  platform, layout, mode, qpos_btg1, blocks_bkt1j = _prepare(
      statics, q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt)
  b, t, _, h = q_btnh.shape
  num_kv_heads = k_bskh.shape[2]
  num_slots = blocks_bktj.shape[-1]
  gp, hp = layout.gp, layout.hp
  kernel = functools.partial(_block_sparse_kernel, block_size=block_size,
                             scale=1.0 / math.sqrt(h), mode=mode)
  kv_spec, row_spec = _specs(layout, block_size)
  out_specs = [row_spec(hp)]
  out_shape = [jax.ShapeDtypeStruct((b, num_kv_heads, t, gp, hp), q_btnh.dtype)]
  if with_lse:
    out_specs.append(row_spec(1))
    out_shape.append(jax.ShapeDtypeStruct((b, num_kv_heads, t, gp, 1), jnp.float32))
  out = pl.pallas_call(
      kernel,
      grid=(b, num_kv_heads, t),
      in_specs=[
          pc.table_spec((None, None, None, 1, num_slots), lambda i, j, r: (i, j, r, 0, 0),
                        platform),
          row_spec(hp),
          pl.BlockSpec((None, None, gp, 1), lambda i, j, r: (i, r, 0, 0)),
          kv_spec,
          kv_spec,
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      interpret=interpret,
      compiler_params=pc.compiler_params(platform, interpret,
                                         ("parallel", "parallel", "parallel")),
      name="block_sparse_attention",
  )(blocks_bkt1j, layout.q_bktgh, qpos_btg1, layout.k_bkclh, layout.v_bkclh)
  return out if with_lse else (out[0], None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sparse(statics, q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt):
  o_bktgh, _ = _forward_call(statics, q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt,
                             with_lse=False)
  return pc.ungroup_outputs(o_bktgh, *q_btnh.shape[1:])


def _sparse_fwd(statics, q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt):
  o_bktgh, lse_bktg1 = _forward_call(statics, q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt,
                                     with_lse=True)
  return (pc.ungroup_outputs(o_bktgh, *q_btnh.shape[1:]),
          (q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt, o_bktgh, lse_bktg1))


def _sparse_bwd(statics, residuals, do_btnh):
  """Per query: dq, and its share of dk / dv for each selected slot [J, bs, H], recomputed
  from the saved log-normaliser; XLA then sums the shares into the key blocks. Memory
  O(T * J * bs * H), the selected tokens (what the reference's gather holds), never
  [T, S]."""
  q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt, o_bktgh, lse_bktg1 = residuals
  block_size, interpret = statics[:2]
  platform, layout, mode, qpos_btg1, blocks_bkt1j = _prepare(
      statics, q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt)
  b, t, n, h = q_btnh.shape
  s, num_kv_heads = k_bskh.shape[1], k_bskh.shape[2]
  num_slots = blocks_bktj.shape[-1]
  gp, hp, num_blocks = layout.gp, layout.hp, layout.num_blocks
  do_bktgh = pc.group_queries(do_btnh.astype(q_btnh.dtype), num_kv_heads, gp, hp)
  delta_bktg1 = jnp.sum(do_bktgh.astype(jnp.float32) * o_bktgh.astype(jnp.float32), axis=-1,
                        keepdims=True)
  kernel = functools.partial(_block_sparse_bwd_kernel, block_size=block_size,
                             scale=1.0 / math.sqrt(h), mode=mode)
  kv_spec, row_spec = _specs(layout, block_size)
  share_spec = pl.BlockSpec((None, None, None, num_slots, block_size, hp),
                            lambda i, j, r: (i, j, r, 0, 0, 0))
  share_shape = (b, num_kv_heads, t, num_slots, block_size, hp)
  dq_bktgh, dk_bktjlh, dv_bktjlh = pl.pallas_call(
      kernel,
      grid=(b, num_kv_heads, t),
      in_specs=[
          pc.table_spec((None, None, None, 1, num_slots), lambda i, j, r: (i, j, r, 0, 0),
                        platform),
          row_spec(hp), row_spec(hp), row_spec(1), row_spec(1),
          pl.BlockSpec((None, None, gp, 1), lambda i, j, r: (i, r, 0, 0)),
          kv_spec,
          kv_spec,
      ],
      out_specs=[row_spec(hp), share_spec, share_spec],
      out_shape=[jax.ShapeDtypeStruct(layout.q_bktgh.shape, q_btnh.dtype),
                 jax.ShapeDtypeStruct(share_shape, jnp.float32),
                 jax.ShapeDtypeStruct(share_shape, jnp.float32)],
      interpret=interpret,
      compiler_params=pc.compiler_params(platform, interpret,
                                         ("parallel", "parallel", "parallel")),
      name="block_sparse_attention_bwd",
  )(blocks_bkt1j, layout.q_bktgh, do_bktgh, lse_bktg1, delta_bktg1, qpos_btg1,
    layout.k_bkclh, layout.v_bkclh)

  # Each share into its block (clamped as the forward reads it; unused slots hold zeros).
  target_bktj = jnp.clip(blocks_bktj.astype(jnp.int32), 0, num_blocks - 1)
  rows_b = jnp.arange(b)[:, None, None, None]
  heads_k = jnp.arange(num_kv_heads)[None, :, None, None]

  def into_blocks(share_bktjlh, dtype):
    acc_bkclh = jnp.zeros((b, num_kv_heads, num_blocks, block_size, hp), jnp.float32)
    acc_bkclh = acc_bkclh.at[rows_b, heads_k, target_bktj].add(share_bktjlh)
    x_bksh = acc_bkclh.reshape(b, num_kv_heads, num_blocks * block_size, hp)
    return jnp.transpose(x_bksh[:, :, :s, :h], (0, 2, 1, 3)).astype(dtype)

  return (pc.ungroup_outputs(dq_bktgh, t, n, h), into_blocks(dk_bktjlh, k_bskh.dtype),
          into_blocks(dv_bktjlh, v_bskh.dtype), None, None)


_sparse.defvjp(_sparse_fwd, _sparse_bwd)
