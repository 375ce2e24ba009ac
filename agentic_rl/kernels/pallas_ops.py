"""The 'pallas' kernel backend: `make_ops` returns the AttentionOps that
agentic_rl/kernels/dispatch.py hands to the model when config.model.kernel_backend is
'pallas'.

- causal_attention, sliding_window_attention: agentic_rl/kernels/pallas_flash.py;
- block_sparse_attention: agentic_rl/kernels/pallas_block_sparse.py (portable), or
  agentic_rl/kernels/pallas_block_sparse_tpu.py (scalar prefetch, TPU only) when
  block_sparse_impl='tpu_prefetch';
- select_blocks: the reference op (top-k stays in XLA).

Gradients: a pallas_call has no autodiff rule, so each op is a jax.custom_vjp.
The flash ops (causal, sliding window) run Pallas backward kernels
(pallas_flash._flash_bwd: dq per query tile, dk and dv per key tile, over the
tile pairs the forward visits, O(T + S) memory); the portable block-sparse op
runs one too (pallas_block_sparse._sparse_bwd: dq and per-slot dk / dv shares
per query, summed into the blocks in XLA). The TPU prefetch variant's backward
recomputes the *reference* op on the saved inputs and takes its VJP.
Positions and block indices are integers and get no cotangent.
"""

from __future__ import annotations

import functools

import jax

from agentic_rl.kernels import pallas_block_sparse
from agentic_rl.kernels import pallas_common
from agentic_rl.kernels import pallas_flash
from agentic_rl.kernels import reference
from agentic_rl.kernels.ops import AttentionOps

BLOCK_SPARSE_IMPLS = ("portable", "tpu_prefetch")


def with_reference_vjp(kernel, reference_op, num_static: int):
  """`kernel(q, k, v, *ints, *statics)`, differentiable in q, k, v via the
  VJP of `reference_op` (same arguments), recomputed in the backward pass."""
  num_args = 3 + 2 + num_static  # q, k, v, two integer arrays, static ints.
  static_argnums = tuple(range(5, num_args))

  @functools.partial(jax.custom_vjp, nondiff_argnums=static_argnums)
  def op(*args):
    return kernel(*args)

  def fwd(*args):
    return kernel(*args), args[:5]

  def bwd(*static_res_g):
    statics, (q, k, v, ints_a, ints_b), g = (static_res_g[:num_static],
                                              static_res_g[num_static],
                                              static_res_g[num_static + 1])
    _, vjp = jax.vjp(lambda q, k, v: reference_op(q, k, v, ints_a, ints_b, *statics), q, k, v)
    return (*vjp(g), None, None)

  op.defvjp(fwd, bwd)
  return op


def make_ops(interpret: bool = False, *, platform: str | None = None,
             block_sparse_impl: str = "portable",
             block_q_rows: int = pallas_flash.DEFAULT_BLOCK_Q_ROWS,
             block_k: int = pallas_flash.DEFAULT_BLOCK_K) -> AttentionOps:
  """Pallas AttentionOps with the reference signatures.

  interpret: run the kernels in Pallas interpret mode (CPU). platform: 'gpu',
  'tpu' or None (jax's default backend) picks tile shapes and compiler params.
  block_sparse_impl: 'portable' (any backend) or 'tpu_prefetch' (TPU, or TPU
  interpret mode on the CPU).
  """
  if block_sparse_impl not in BLOCK_SPARSE_IMPLS:
    raise ValueError(f"block_sparse_impl={block_sparse_impl!r}: expected one of "
                     f"{BLOCK_SPARSE_IMPLS}.")
  if platform is not None and platform not in pallas_common.PLATFORMS:
    raise ValueError(f"platform={platform!r}: expected one of {pallas_common.PLATFORMS} "
                     f"or None (auto).")
  if block_sparse_impl == "tpu_prefetch" and platform == "gpu":
    raise ValueError("block_sparse_impl='tpu_prefetch' uses TPU scalar prefetch; it cannot "
                     "run with platform='gpu'.")

  def window_kernel(q, k, v, q_pos, k_pos, window):
    return pallas_flash.flash_attention(q, k, v, q_pos, k_pos, window=window,
                                        interpret=interpret, platform=platform,
                                        block_q_rows=block_q_rows, block_k=block_k)

  def sparse_kernel(q, k, v, blocks, q_pos, block_size):
    if block_sparse_impl == "tpu_prefetch":
      from agentic_rl.kernels import pallas_block_sparse_tpu  # Imports the TPU Pallas module.
      return pallas_block_sparse_tpu.block_sparse_attention(
          q, k, v, blocks, q_pos, block_size=block_size, interpret=interpret)
    return pallas_block_sparse.block_sparse_attention(
        q, k, v, blocks, q_pos, block_size=block_size, interpret=interpret,
        platform=platform)

  def sparse_reference(q, k, v, blocks, q_pos, block_size):
    return reference.block_sparse_attention(q, k, v, blocks, q_pos, block_size=block_size)

  windowed = window_kernel  # Differentiable: the flash kernels' own backward.
  # The portable kernel has its own Pallas backward; the TPU prefetch variant recomputes
  # the reference's VJP.
  sparse = (with_reference_vjp(sparse_kernel, sparse_reference, num_static=1)
            if block_sparse_impl == "tpu_prefetch" else sparse_kernel)

  def causal_attention(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs):
    return windowed(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, None)

  def sliding_window_attention(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, *, window):
    return windowed(q_btnh, k_bskh, v_bskh, q_pos_bt, k_pos_bs, window)

  def block_sparse_attention(q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt, *, block_size):
    return sparse(q_btnh, k_bskh, v_bskh, blocks_bktj, q_pos_bt, block_size)

  return AttentionOps(
      causal_attention=causal_attention,
      sliding_window_attention=sliding_window_attention,
      local_window_attention=lambda q, k, v, pos, *, window: sliding_window_attention(
          q, k, v, pos, pos, window=window),
      block_sparse_attention=block_sparse_attention,
      select_blocks=reference.select_blocks,
  )
