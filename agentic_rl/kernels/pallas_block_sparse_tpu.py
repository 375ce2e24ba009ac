"""Block-sparse GQA attention, TPU variant: the selection is scalar-prefetched
into SMEM and drives the K/V BlockSpec index maps, so only the selected
blocks are DMA'd from HBM (the portable kernel keeps the whole K/V slab of a
kv head in VMEM).

Grid: (batch, kv head, query position, slot). The slot axis is sequential
("arbitrary"): the online-softmax state (acc, max, denominator) lives in VMEM
scratch across it, and the output block is written at the last slot. Slot -1
is skipped; its index map repeats the previous valid block so the pipeline
issues no new DMA for it.

Same semantics as agentic_rl/kernels/reference.block_sparse_attention. Runs on a TPU, or
on the CPU in TPU interpret mode (interpret=pltpu.InterpretParams()); the
generic interpret mode does not model scalar prefetch. The whole selection
[B, K, T, J] sits in SMEM, so this suits decode and short chunks; long
prefills want a chunked call. Axis letters as in agentic_rl/kernels/pallas_block_sparse.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from agentic_rl.kernels import pallas_block_sparse
from agentic_rl.kernels import pallas_common as pc


def _kernel(blocks_ref, fetch_ref, qpos_ref, q_ref, k_ref, v_ref, o_ref, acc_ref, m_ref,
            l_ref, *, block_size, scale, num_kv_heads, num_queries, num_slots):
  # blocks_ref / fetch_ref [B*K*T*J], qpos_ref [B*T] (SMEM); q_ref [Gp, Hp];
  # k_ref / v_ref [bs, Hp] (the block this slot fetched); o_ref [Gp, Hp]
  del fetch_ref  # Used only by the index maps.
  b, kv, t, j = (pl.program_id(i) for i in range(4))
  rows = q_ref.shape[0]

  @pl.when(j == 0)
  def _init():
    acc_ref[...], m_ref[...], l_ref[...] = pc.softmax_init(rows, q_ref.shape[1])

  blk = blocks_ref[((b * num_kv_heads + kv) * num_queries + t) * num_slots + j]
  q_pos = qpos_ref[b * num_queries + t]

  @pl.when(blk >= 0)
  def _attend():
    offsets_1l = jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
    mask_rl = jnp.broadcast_to(blk * block_size + offsets_1l <= q_pos, (rows, block_size))
    scores_rl = pc.scores(q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32),
                          "dot") * scale
    carry = (acc_ref[...], m_ref[...], l_ref[...])
    acc_ref[...], m_ref[...], l_ref[...] = pc.softmax_step(
        carry, scores_rl, mask_rl, v_ref[...].astype(jnp.float32), "dot")

  @pl.when(j == num_slots - 1)
  def _finish():
    o_ref[...] = pc.softmax_finish(acc_ref[...], l_ref[...]).astype(o_ref.dtype)


def _fetch_indices(blocks_bktj, num_blocks):
  """Block to DMA per slot: the slot's own block, or the last valid one before it."""
  slot_j = jnp.arange(blocks_bktj.shape[-1], dtype=jnp.int32)
  last_valid_bktj = jax.lax.cummax(jnp.where(blocks_bktj >= 0, slot_j, -1), axis=3)
  fetched_bktj = jnp.take_along_axis(blocks_bktj, jnp.maximum(last_valid_bktj, 0), axis=3)
  return jnp.clip(jnp.where(last_valid_bktj >= 0, fetched_bktj, 0), 0, num_blocks - 1)


def block_sparse_attention(q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt, *, block_size,
                           interpret=False):
  """Reference-semantics block-sparse attention fetching only selected blocks.

  `interpret`: False on a TPU; on the CPU pass True (mapped to TPU interpret
  mode) or a pltpu.InterpretParams.
  """
  pallas_block_sparse.check_block_sparse_inputs(q_btnh, k_bskh, v_bskh, blocks_bktj,
                                                q_pos_bt, block_size)
  if interpret is True:
    interpret = pltpu.InterpretParams()
  b, t, n, h = q_btnh.shape
  num_kv_heads = k_bskh.shape[2]
  num_slots = blocks_bktj.shape[-1]
  layout = pallas_block_sparse.block_layout(q_btnh, k_bskh, v_bskh, block_size)
  gp, hp = layout.gp, layout.hp
  blocks_bktj = blocks_bktj.astype(jnp.int32)
  fetch_bktj = _fetch_indices(blocks_bktj, layout.num_blocks)

  def flat_slot(i, kv, r, j):
    return ((i * num_kv_heads + kv) * t + r) * num_slots + j

  def kv_index(i, kv, r, j, blocks_ref, fetch_ref, qpos_ref):
    return (i, kv, fetch_ref[flat_slot(i, kv, r, j)], 0, 0)

  def q_index(i, kv, r, j, *_):
    return (i, kv, r, 0, 0)

  kernel = functools.partial(_kernel, block_size=block_size, scale=1.0 / math.sqrt(h),
                             num_kv_heads=num_kv_heads, num_queries=t, num_slots=num_slots)
  kv_spec = pl.BlockSpec((None, None, None, block_size, hp), kv_index)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(b, num_kv_heads, t, num_slots),
      in_specs=[pl.BlockSpec((None, None, None, gp, hp), q_index), kv_spec, kv_spec],
      out_specs=pl.BlockSpec((None, None, None, gp, hp), q_index),
      scratch_shapes=[pltpu.VMEM((gp, hp), jnp.float32), pltpu.VMEM((gp, 1), jnp.float32),
                      pltpu.VMEM((gp, 1), jnp.float32)],
  )
  o_bktgh = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, num_kv_heads, t, gp, hp), q_btnh.dtype),
      interpret=interpret,
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      name="block_sparse_attention_tpu",
  )(blocks_bktj.reshape(-1), fetch_bktj.reshape(-1), q_pos_bt.astype(jnp.int32).reshape(-1),
    layout.q_bktgh, layout.k_bkclh, layout.v_bkclh)
  return pc.ungroup_outputs(o_bktgh, t, n, h)
