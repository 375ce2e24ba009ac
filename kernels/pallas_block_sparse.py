"""Block-sparse GQA attention (G layers) as a portable Pallas kernel.

Every query group attends only to the key blocks the indexer selected for it
(kernels/reference.block_sparse_attention). The selection [B, K, T, n] comes
in as an ordinary int32 input; selection itself (top-k) stays in XLA.

Grid: (batch, kv head, query position). One program holds the Gp query heads
of a GQA group at one position (they share the selection) and loops over the
n selected slots: slot -1 is skipped, otherwise block `blk` of the
position-indexed K/V buffer is read by a dynamic index on its leading axis
(k_ref[blk] -> [block_size, D], i.e. tokens blk*bs .. blk*bs+bs-1) and folded
into a float32 online softmax. Causality inside a block is by position:
token blk*bs + i is seen when it is <= the query's position (-1: nothing).
A block index past the buffer is clamped for the read, like the reference's
gather; its tokens lie beyond every position stored, so they are masked.

K/V of one (batch, kv head) are a single block: on GPU a pointer base, on TPU
a VMEM slab, which bounds the context; kernels/pallas_block_sparse_tpu.py
fetches only the selected blocks with scalar prefetch instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels import pallas_common as pc


def _block_sparse_kernel(blocks_ref, q_ref, qpos_ref, k_ref, v_ref, o_ref, *, block_size,
                         scale, mode):
  # blocks_ref [1, n] (int32 table), q_ref [Gp, Dp], qpos_ref [Gp, 1],
  # k_ref / v_ref [N, bs, Dp], o_ref [Gp, Dp]
  rows, head_dim = q_ref.shape
  num_blocks = k_ref.shape[0]
  num_slots = blocks_ref.shape[1]
  q_rd = q_ref[...].astype(jnp.float32)
  qpos_r1 = qpos_ref[...]
  offsets_1c = jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)

  def slot(j, carry):
    blk = blocks_ref[0, j]

    def attend(carry):
      stored = jnp.minimum(blk, num_blocks - 1)
      k_cd = k_ref[stored].astype(jnp.float32)
      v_cd = v_ref[stored].astype(jnp.float32)
      mask_rc = jnp.broadcast_to(blk * block_size + offsets_1c <= qpos_r1,
                                 (rows, block_size))
      s_rc = pc.scores(q_rd, k_cd, mode) * scale
      return pc.softmax_step(carry, s_rc, mask_rc, v_cd, mode)

    return jax.lax.cond(blk >= 0, attend, lambda c: c, carry)

  acc_rd, _, l_r1 = jax.lax.fori_loop(0, num_slots, slot, pc.softmax_init(rows, head_dim))
  o_ref[...] = pc.softmax_finish(acc_rd, l_r1).astype(o_ref.dtype)


def check_block_sparse_inputs(q_bthd, k_bshd, v_bshd, blocks_bktn, q_pos_bt, block_size):
  pc.check_attention_shapes(q_bthd, k_bshd, v_bshd)
  b, t = q_bthd.shape[:2]
  num_kv_heads = k_bshd.shape[2]
  if not isinstance(block_size, int) or block_size <= 0:
    raise ValueError(f"block_size={block_size!r}: expected a positive integer.")
  if blocks_bktn.ndim != 4 or blocks_bktn.shape[:3] != (b, num_kv_heads, t):
    raise ValueError(f"blocks {blocks_bktn.shape}: expected [B, K, T, n] = "
                     f"[{b}, {num_kv_heads}, {t}, n].")
  if q_pos_bt.shape != (b, t):
    raise ValueError(f"q_pos {q_pos_bt.shape}: expected [B, T] = [{b}, {t}].")


def block_sparse_attention(q_bthd, k_bshd, v_bshd, blocks_bktn, q_pos_bt, *, block_size,
                           interpret=False, platform=None, matmul="auto"):
  """Attention over the selected key blocks only; reference semantics.

  q [B, T, H, D]; k / v position-indexed [B, S, K, D]; blocks int [B, K, T, n]
  (-1: unused slot); q_pos [B, T]. Returns [B, T, H, D] in q's dtype.
  """
  check_block_sparse_inputs(q_bthd, k_bshd, v_bshd, blocks_bktn, q_pos_bt, block_size)
  platform = pc.resolve_platform(platform, interpret)
  b, t, h, d = q_bthd.shape
  s, num_kv_heads = k_bshd.shape[1], k_bshd.shape[2]
  n = blocks_bktn.shape[-1]
  gp = pc.next_pow2(h // num_kv_heads)
  dp = pc.padded_head_dim(d)
  sp = pc.round_up(s, block_size)
  num_blocks = sp // block_size
  mode = pc.resolve_matmul(matmul, platform, gp, block_size, dp)

  q_bktgd = pc.group_queries(q_bthd, num_kv_heads, gp, dp)
  qpos_btg1 = jnp.broadcast_to(q_pos_bt.astype(jnp.int32)[:, :, None, None], (b, t, gp, 1))
  k_bkncd = pc.kv_heads_major(k_bshd, dp, sp).reshape(b, num_kv_heads, num_blocks,
                                                      block_size, dp)
  v_bkncd = pc.kv_heads_major(v_bshd, dp, sp).reshape(b, num_kv_heads, num_blocks,
                                                      block_size, dp)
  blocks_bkt1n = blocks_bktn.astype(jnp.int32)[:, :, :, None, :]

  kernel = functools.partial(_block_sparse_kernel, block_size=block_size,
                             scale=1.0 / math.sqrt(d), mode=mode)
  kv_spec = pl.BlockSpec((None, None, num_blocks, block_size, dp),
                         lambda i, j, r: (i, j, 0, 0, 0))
  o_bktgd = pl.pallas_call(
      kernel,
      grid=(b, num_kv_heads, t),
      in_specs=[
          pc.table_spec((None, None, None, 1, n), lambda i, j, r: (i, j, r, 0, 0), platform),
          pl.BlockSpec((None, None, None, gp, dp), lambda i, j, r: (i, j, r, 0, 0)),
          pl.BlockSpec((None, None, gp, 1), lambda i, j, r: (i, r, 0, 0)),
          kv_spec,
          kv_spec,
      ],
      out_specs=pl.BlockSpec((None, None, None, gp, dp), lambda i, j, r: (i, j, r, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((b, num_kv_heads, t, gp, dp), q_bthd.dtype),
      interpret=interpret,
      compiler_params=pc.compiler_params(platform, interpret,
                                         ("parallel", "parallel", "parallel")),
      name="block_sparse_attention",
  )(blocks_bkt1n, q_bktgd, qpos_btg1, k_bkncd, v_bkncd)
  return pc.ungroup_outputs(o_bktgd, t, h, d)
