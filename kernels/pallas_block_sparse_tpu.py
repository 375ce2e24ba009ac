"""Block-sparse GQA attention, TPU variant: the selection is scalar-prefetched
into SMEM and drives the K/V BlockSpec index maps, so only the selected
blocks are DMA'd from HBM (the portable kernel keeps the whole K/V slab of a
kv head in VMEM).

Grid: (batch, kv head, query position, slot). The slot axis is sequential
("arbitrary"): the online-softmax state (acc, max, denominator) lives in VMEM
scratch across it, and the output block is written at the last slot. Slot -1
is skipped; its index map repeats the previous valid block so the pipeline
issues no new DMA for it.

Same semantics as kernels/reference.block_sparse_attention. Runs on a TPU, or
on the CPU in TPU interpret mode (interpret=pltpu.InterpretParams()); the
generic interpret mode does not model scalar prefetch. The whole selection
[B, K, T, n] sits in SMEM, so this suits decode and short chunks; long
prefills want a chunked call.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import pallas_block_sparse
from kernels import pallas_common as pc


def _kernel(blocks_ref, fetch_ref, qpos_ref, q_ref, k_ref, v_ref, o_ref, acc_ref, m_ref,
            l_ref, *, block_size, scale, num_kv_heads, num_queries, num_slots):
  # blocks_ref / fetch_ref [B*K*T*n], qpos_ref [B*T] (SMEM); q_ref [Gp, Dp];
  # k_ref / v_ref [bs, Dp] (the block this slot fetched); o_ref [Gp, Dp]
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
    offsets_1c = jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
    mask_rc = jnp.broadcast_to(blk * block_size + offsets_1c <= q_pos, (rows, block_size))
    s_rc = pc.scores(q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32),
                     "dot") * scale
    carry = (acc_ref[...], m_ref[...], l_ref[...])
    acc_ref[...], m_ref[...], l_ref[...] = pc.softmax_step(
        carry, s_rc, mask_rc, v_ref[...].astype(jnp.float32), "dot")

  @pl.when(j == num_slots - 1)
  def _finish():
    o_ref[...] = pc.softmax_finish(acc_ref[...], l_ref[...]).astype(o_ref.dtype)


def _fetch_indices(blocks_bktn, num_blocks):
  """Block to DMA per slot: the slot's own block, or the last valid one before it."""
  n = blocks_bktn.shape[-1]
  slot = jnp.arange(n, dtype=jnp.int32)
  last_valid = jax.lax.cummax(jnp.where(blocks_bktn >= 0, slot, -1), axis=3)
  fetched = jnp.take_along_axis(blocks_bktn, jnp.maximum(last_valid, 0), axis=3)
  return jnp.clip(jnp.where(last_valid >= 0, fetched, 0), 0, num_blocks - 1)


def block_sparse_attention(q_bthd, k_bshd, v_bshd, blocks_bktn, q_pos_bt, *, block_size,
                           interpret=False):
  """Reference-semantics block-sparse attention fetching only selected blocks.

  `interpret`: False on a TPU; on the CPU pass True (mapped to TPU interpret
  mode) or a pltpu.InterpretParams.
  """
  pallas_block_sparse.check_block_sparse_inputs(q_bthd, k_bshd, v_bshd, blocks_bktn,
                                                q_pos_bt, block_size)
  if interpret is True:
    interpret = pltpu.InterpretParams()
  b, t, h, d = q_bthd.shape
  s, num_kv_heads = k_bshd.shape[1], k_bshd.shape[2]
  n = blocks_bktn.shape[-1]
  gp = pc.next_pow2(h // num_kv_heads)
  dp = pc.padded_head_dim(d)
  sp = pc.round_up(s, block_size)
  num_blocks = sp // block_size

  blocks = blocks_bktn.astype(jnp.int32)
  fetch = _fetch_indices(blocks, num_blocks)
  q_bktgd = pc.group_queries(q_bthd, num_kv_heads, gp, dp)
  k_bkncd = pc.kv_heads_major(k_bshd, dp, sp).reshape(b, num_kv_heads, num_blocks,
                                                      block_size, dp)
  v_bkncd = pc.kv_heads_major(v_bshd, dp, sp).reshape(b, num_kv_heads, num_blocks,
                                                      block_size, dp)

  def flat_slot(i, kv, r, j):
    return ((i * num_kv_heads + kv) * t + r) * n + j

  def kv_index(i, kv, r, j, blocks_ref, fetch_ref, qpos_ref):
    return (i, kv, fetch_ref[flat_slot(i, kv, r, j)], 0, 0)

  def q_index(i, kv, r, j, *_):
    return (i, kv, r, 0, 0)

  kernel = functools.partial(_kernel, block_size=block_size, scale=1.0 / math.sqrt(d),
                             num_kv_heads=num_kv_heads, num_queries=t, num_slots=n)
  kv_spec = pl.BlockSpec((None, None, None, block_size, dp), kv_index)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(b, num_kv_heads, t, n),
      in_specs=[pl.BlockSpec((None, None, None, gp, dp), q_index), kv_spec, kv_spec],
      out_specs=pl.BlockSpec((None, None, None, gp, dp), q_index),
      scratch_shapes=[pltpu.VMEM((gp, dp), jnp.float32), pltpu.VMEM((gp, 1), jnp.float32),
                      pltpu.VMEM((gp, 1), jnp.float32)],
  )
  o_bktgd = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, num_kv_heads, t, gp, dp), q_bthd.dtype),
      interpret=interpret,
      compiler_params=None if interpret else pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      name="block_sparse_attention_tpu",
  )(blocks.reshape(-1), fetch.reshape(-1), q_pos_bt.astype(jnp.int32).reshape(-1),
    q_bktgd, k_bkncd, v_bkncd)
  return pc.ungroup_outputs(o_bktgd, t, h, d)
