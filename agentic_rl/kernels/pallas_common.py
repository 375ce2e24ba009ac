"""Pieces shared by the Pallas attention kernels: online-softmax tile math,
the small-matmul choice, padding to lowerable tile shapes, and per-platform
compiler parameters.

Layout rules the kernels follow so that one kernel body lowers to Triton (GPU)
and Mosaic (TPU) as well as running in interpret mode:
- every array a kernel touches is 2-D inside the kernel ([rows, cols]);
- block dims are powers of two (Triton) and either full array dims or
  multiples of 8 on the second-minor axis (Mosaic);
- dynamic indexing only on a leading, untiled axis (k_ref[tile] -> [tk, H]);
- integer tables that are read as scalars live in SMEM on TPU.

Axis letters are agentic_rl/kernels/reference.py's (n query heads, k kv heads, g group, h head
dim, c key block or tile, l key within it); inside a kernel, r is a row of a query
tile: a query position x a query head of the group, flattened.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

PLATFORMS = ("gpu", "tpu")
MATMUL_MODES = ("auto", "dot", "broadcast")
# Triton's tensor-core dot wants every matmul dim >= 16; smaller ones use the
# broadcast-multiply-reduce path, which lowers for any power-of-two shape.
_MIN_DOT_DIM = 16
_NEG_INF = float("-inf")


def next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def resolve_platform(platform: str | None, interpret: bool) -> str:
  """'gpu' or 'tpu' (what the kernels are shaped and compiled for)."""
  if platform is None:
    backend = jax.default_backend()
    if backend == "tpu":
      return "tpu"
    if backend in ("gpu", "cuda", "rocm"):
      return "gpu"
    if not interpret:
      raise ValueError(
          f"Pallas kernels compile only for GPU or TPU, but jax's default backend is "
          f"{backend!r}; set config.model.pallas_interpret=True to run them on the CPU "
          f"(interpret mode), or kernel_backend='reference'.")
    return "gpu"  # Interpret mode: shape the kernels as for the GPU path.
  if platform not in PLATFORMS:
    raise ValueError(f"platform={platform!r}: expected one of {PLATFORMS} or None (auto).")
  return platform


def resolve_matmul(matmul: str, platform: str, m: int, n: int, k: int) -> str:
  """'dot' or 'broadcast' for an [m, k] x [k, n] product inside a kernel."""
  if matmul not in MATMUL_MODES:
    raise ValueError(f"matmul={matmul!r}: expected one of {MATMUL_MODES}.")
  if matmul != "auto":
    return matmul
  if platform == "tpu":
    return "dot"  # Mosaic pads small matmuls to the MXU tile itself.
  return "dot" if min(m, n, k) >= _MIN_DOT_DIM else "broadcast"


def compiler_params(platform: str, interpret, dimension_semantics):
  if interpret:
    return None
  if platform == "gpu":
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=4, num_stages=2)
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.CompilerParams(dimension_semantics=tuple(dimension_semantics))


def table_spec(block_shape, index_map, platform: str):
  """BlockSpec for an int32 table the kernel reads as scalars (SMEM on TPU)."""
  if platform == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pl.BlockSpec(block_shape, index_map, memory_space=pltpu.SMEM)
  return pl.BlockSpec(block_shape, index_map)


def scores(q_rh, k_lh, mode: str):
  """q_rh @ k_lh.T in float32 -> [R, L]."""
  if mode == "dot":
    return jax.lax.dot_general(q_rh, k_lh, (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
  return jnp.sum(q_rh[:, None, :] * k_lh[None, :, :], axis=-1)


def weighted_values(p_rl, mask_rl, v_lh, mode: str):
  """p_rl @ v_lh in float32 -> [R, H], with masked keys selected out, not multiplied by a
  zero weight: a non-finite value (a stale slot, a padded key) reaches exactly the rows
  that see it (NaN there, as in the reference) and no other row of the tile."""
  # Float max-reductions: Triton lowers no boolean reduce. NaN fails `< inf` too.
  bad_l1 = jnp.max(jnp.where(jnp.abs(v_lh) < jnp.inf, 0.0, 1.0), axis=1, keepdims=True) > 0
  v_lh = jnp.where(bad_l1, 0.0, v_lh)
  if mode == "dot":
    out_rh = jax.lax.dot_general(p_rl, v_lh, (((1,), (0,)), ((), ())),
                                 precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
  else:
    out_rh = jnp.sum(p_rl[:, :, None] * v_lh[None, :, :], axis=1)
  sees_bad_r1 = jnp.max(jnp.where(mask_rl & bad_l1.T, 1.0, 0.0), axis=1, keepdims=True) > 0
  return jnp.where(sees_bad_r1, jnp.nan, out_rh)


def matmul_nn(a_rl, b_lh, mode: str):
  """a_rl @ b_lh in float32 -> [R, H]."""
  if mode == "dot":
    return jax.lax.dot_general(a_rl, b_lh, (((1,), (0,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
  return jnp.sum(a_rl[:, :, None] * b_lh[None, :, :], axis=1)


def matmul_tn(a_rl, b_rh, mode: str):
  """a_rl.T @ b_rh in float32 -> [L, H] (sums over the rows r)."""
  if mode == "dot":
    return jax.lax.dot_general(a_rl, b_rh, (((0,), (0,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
  return jnp.sum(a_rl[:, :, None] * b_rh[:, None, :], axis=0)


def softmax_init(rows: int, head_dim: int):
  """(acc [R, H], running max [R, 1], running denominator [R, 1])."""
  return (jnp.zeros((rows, head_dim), jnp.float32),
          jnp.full((rows, 1), _NEG_INF, jnp.float32),
          jnp.zeros((rows, 1), jnp.float32))


def softmax_step(carry, scores_rl, mask_rl, v_lh, mode: str):
  """One flash-attention update with a key tile; masked keys contribute nothing.

  The running max starts at -inf; while a row has seen no key its shift is 0,
  so exp never sees inf - inf and an all-masked row keeps acc = l = 0.
  """
  acc_rh, m_r1, l_r1 = carry
  scores_rl = jnp.where(mask_rl, scores_rl, _NEG_INF)
  m_new = jnp.maximum(m_r1, jnp.max(scores_rl, axis=1, keepdims=True))
  shift = jnp.where(m_new == _NEG_INF, 0.0, m_new)
  p_rl = jnp.where(mask_rl, jnp.exp(scores_rl - shift), 0.0)
  correction = jnp.exp(m_r1 - shift)
  l_new = correction * l_r1 + jnp.sum(p_rl, axis=1, keepdims=True)
  acc_new = correction * acc_rh + weighted_values(p_rl, mask_rl, v_lh, mode)
  return acc_new, m_new, l_new


def finite_or_zero(x):
  """Non-finite entries (stale or padded cache slots) zeroed: a product with them must not
  turn a masked-out zero weight into NaN (backward kernels)."""
  return jnp.where(jnp.abs(x) < jnp.inf, x, 0.0)


def log_normaliser(m_r1, l_r1):
  """log sum exp of each row's scores from the online softmax's (max, sum); 0 for a row
  that saw no key (it has no probabilities to recompute)."""
  seen = l_r1 > 0
  return jnp.where(seen, m_r1 + jnp.log(jnp.where(seen, l_r1, 1.0)), 0.0)


def softmax_finish(acc_rh, l_r1):
  """Normalised output; rows that saw no key are exactly zero."""
  seen = l_r1 > 0
  return jnp.where(seen, acc_rh / jnp.where(seen, l_r1, 1.0), 0.0)


def padded_head_dim(h: int) -> int:
  return max(_MIN_DOT_DIM, next_pow2(h))


def group_queries(q_btnh, num_kv_heads: int, group_pad: int, head_dim_pad: int):
  """[B, T, N, H] -> [B, K, T, Gp, Hp]: the G query heads of each kv head, zero-padded."""
  b, t, n, h = q_btnh.shape
  g = n // num_kv_heads
  q_btkgh = q_btnh.reshape(b, t, num_kv_heads, g, h)
  q_btkgh = jnp.pad(q_btkgh,
                    ((0, 0), (0, 0), (0, 0), (0, group_pad - g), (0, head_dim_pad - h)))
  return jnp.transpose(q_btkgh, (0, 2, 1, 3, 4))


def ungroup_outputs(o_bktgh, t: int, n: int, h: int):
  """[B, K, Tp, Gp, Hp] -> [B, t, N, H], dropping the padding (n query heads, h head dim)."""
  b, k = o_bktgh.shape[:2]
  g = n // k
  o_bktgh = o_bktgh[:, :, :t, :g, :h]
  return jnp.transpose(o_bktgh, (0, 2, 1, 3, 4)).reshape(b, t, n, h)


def kv_heads_major(x_bskh, head_dim_pad: int, length_pad: int):
  """[B, S, K, H] -> [B, K, Sp, Hp], zero-padded."""
  b, s, k, h = x_bskh.shape
  x_bskh = jnp.pad(x_bskh, ((0, 0), (0, length_pad - s), (0, 0), (0, head_dim_pad - h)))
  return jnp.transpose(x_bskh, (0, 2, 1, 3))


def check_attention_shapes(q_btnh, k_bskh, v_bskh):
  if q_btnh.ndim != 4 or k_bskh.ndim != 4 or v_bskh.ndim != 4:
    raise ValueError(f"attention expects q [B, T, N, H], k and v [B, S, K, H]; got "
                     f"q {q_btnh.shape}, k {k_bskh.shape}, v {v_bskh.shape}.")
  if k_bskh.shape != v_bskh.shape:
    raise ValueError(f"k {k_bskh.shape} and v {v_bskh.shape} must have the same shape.")
  b, _, n, h = q_btnh.shape
  kb, _, k, kh = k_bskh.shape
  if kb != b or kh != h:
    raise ValueError(f"q {q_btnh.shape} and k {k_bskh.shape} disagree on batch or head_dim.")
  if n % k:
    raise ValueError(f"q has {n} heads, not a multiple of the {k} kv heads (GQA).")
