"""Pallas attention kernels (interpret mode on the CPU) against the jnp reference.

Tolerances: fp32 everywhere; kernel outputs match the reference ops, and kernel
gradients a float64 numpy softmax derivative, to atol 1e-5; rows that see no key must be
exactly 0.
Whole-model logits (|logits| up to ~35) match the reference backend to atol 1e-4.
Lowering tests lower each kernel for TPU (Mosaic) and GPU (Triton) without a
device: they catch unsupported ops and block shapes, not compiler failures
further down (Mosaic layout passes, Triton/PTX), which need a real device.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from agentic_rl.model import config as config_lib
from agentic_rl.model import transformer
from agentic_rl.kernels import dispatch
from agentic_rl.kernels import pallas_block_sparse
from agentic_rl.kernels import pallas_block_sparse_tpu
from agentic_rl.kernels import pallas_flash
from agentic_rl.kernels import pallas_ops
from agentic_rl.kernels import reference
from tests.kernels import numpy_attention as npa

ATOL = 1e-5
SMALL_TILES = dict(block_q_rows=8, block_k=8)  # Several query and key tiles per call.


def _qkv(seed, b, t, s, h, k, d):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
  kk = jnp.asarray(rng.standard_normal((b, s, k, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, s, k, d)), jnp.float32)
  return q, kk, v


def _sequence_positions():
  """[4, 19] q and k positions: plain, right-padded, left-padded, and keys that
  start after most queries (those queries see no key: zero rows)."""
  t = 19
  plain = np.arange(t)
  right_pad = np.r_[np.arange(14), [-1] * 5]
  left_pad = np.r_[[-1] * 4, np.arange(15)]
  q_pos = np.stack([plain, right_pad, left_pad, plain])
  k_pos = np.stack([plain, right_pad, left_pad, plain + 10])
  return jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)


def _ring_positions(lengths, window):
  """Ring-buffer slot positions for sequences of the given lengths (-1: empty)."""
  ring = np.full((len(lengths), window), -1)
  for row, length in enumerate(lengths):
    for p in range(max(0, length - window), length):
      ring[row, p % window] = p
  return ring


def _assert_matches(out, ref, visible_bts):
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=ATOL, rtol=0)
  blind_bt = ~np.asarray(visible_bts).any(-1)
  assert blind_bt.any(), "the case should contain rows that see no key"
  assert np.all(np.asarray(out)[blind_bt] == 0.0)
  assert np.isfinite(np.asarray(out)).all()


@functools.partial(jax.jit, static_argnames=("window", "matmul", "platform", "interpret"))
def _flash(q, k, v, q_pos, k_pos, window, matmul, platform=None, interpret=True):
  return pallas_flash.flash_attention(q, k, v, q_pos, k_pos, window=window,
                                      interpret=interpret, platform=platform, matmul=matmul,
                                      **SMALL_TILES)


def _window_reference(q, k, v, q_pos, k_pos, window):
  if window is None:
    return reference.causal_attention(q, k, v, q_pos, k_pos)
  return reference.sliding_window_attention(q, k, v, q_pos, k_pos, window=window)


# GQA with G=3 (padded to 4 inside) and G=2; windows below and above the length.
@pytest.mark.parametrize("window,heads,matmul", [
    (None, (6, 2), "dot"),
    (1, (4, 2), "broadcast"),
    (3, (6, 2), "dot"),
    (64, (4, 1), "broadcast"),
])
def test_flash_matches_reference_on_sequences(window, heads, matmul):
  h, kv = heads
  q_pos, k_pos = _sequence_positions()
  q, k, v = _qkv(0, 4, 19, 19, h, kv, 8)
  out = _flash(q, k, v, q_pos, k_pos, window, matmul)
  ref = _window_reference(q, k, v, q_pos, k_pos, window)
  _assert_matches(out, ref, reference.visibility_mask(q_pos, k_pos, window))


@pytest.mark.parametrize("chunk,matmul", [(3, "dot"), (1, "broadcast")])
def test_sliding_window_on_ring_buffer_layout(chunk, matmul):
  """Keys = W ring slots (scrambled positions, empty slots -1) + the chunk,
  as the S layer's cached path builds them; ragged lengths and a padded chunk."""
  window = 8
  lengths = [13, 3, 0, 21]
  ring = _ring_positions(lengths, window)
  chunk_pos = np.stack([np.arange(n, n + chunk) for n in lengths])
  chunk_pos[3, 1:] = -1  # A chunk padded after its first token.
  chunk_pos[2, :] = -1  # A fully padded sequence: every row sees nothing.
  k_pos = jnp.asarray(np.concatenate([ring, chunk_pos], axis=1), jnp.int32)
  q_pos = jnp.asarray(chunk_pos, jnp.int32)
  q, k, v = _qkv(1, 4, chunk, window + chunk, 4, 2, 16)
  out = _flash(q, k, v, q_pos, k_pos, window, matmul)
  ref = reference.sliding_window_attention(q, k, v, q_pos, k_pos, window=window)
  _assert_matches(out, ref, reference.visibility_mask(q_pos, k_pos, window))


@pytest.mark.parametrize("window,matmul", [(None, "dot"), (5, "broadcast"), (8, "dot")])
def test_flash_backward_kernels_on_scrambled_positions_equal_float64(window, matmul):
  """The Pallas backward (dq per query tile, dk / dv per key tile) against the float64
  softmax derivative: positions out of order with gaps and padding, T and S off the tile,
  several query and key tiles, GQA with a padded group (6 heads over 2 kv heads)."""
  rng = np.random.default_rng(11)
  b, t, s, n, kv, d = 2, 21, 29, 6, 2, 12
  q, k, v = _qkv(12, b, t, s, n, kv, d)
  k_pos = np.stack([rng.permutation(40)[:s] for _ in range(b)])
  k_pos[0, 5:9] = -1
  q_pos = np.stack([rng.permutation(40)[:t] for _ in range(b)])
  q_pos[1, -4:] = -1
  q_pos, k_pos = jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)
  cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def loss(q, k, v):
    out = pallas_flash.flash_attention(q, k, v, q_pos, k_pos, window=window, interpret=True,
                                       matmul=matmul, **SMALL_TILES)
    return jnp.sum(out * cotangent)

  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  counts = npa.visibility(q_pos, k_pos, window)
  want = npa.attention_vjp(q, k, v, counts, cotangent)
  for name, g, w in zip("qkv", got, want):
    assert np.abs(w).max() > 1e-3, f"d{name} should not be trivially zero"
    np.testing.assert_allclose(np.asarray(g), w, atol=ATOL, rtol=0, err_msg=f"d{name}")


def _largest_intermediate(fn, *args) -> int:
  """Elements of the largest array a jaxpr builds outside the Pallas kernels' bodies."""
  def walk(jaxpr):
    sizes = [0]
    for eqn in jaxpr.eqns:
      sizes += [int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape")]
      if eqn.primitive.name == "pallas_call":
        continue
      for param in eqn.params.values():
        inner = getattr(param, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          sizes.append(walk(inner))
    return max(sizes)
  return walk(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("window", [None, 16])
def test_flash_backward_never_builds_the_score_matrix(window):
  b, t, n, kv, d = 1, 256, 4, 2, 16
  q, k, v = _qkv(13, b, t, t, n, kv, d)
  pos = jnp.arange(t, dtype=jnp.int32)[None]

  def grads(attention):
    return jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v)), argnums=(0, 1, 2))

  pallas = lambda q, k, v: pallas_flash.flash_attention(q, k, v, pos, pos, window=window,
                                                         interpret=True)
  dense = lambda q, k, v: reference.sliding_window_attention(q, k, v, pos, pos,
                                                             window=window or t)
  scores = b * n * t * t
  assert _largest_intermediate(grads(dense), q, k, v) >= scores  # The check can fail.
  assert _largest_intermediate(grads(pallas), q, k, v) < scores / 8


@pytest.mark.parametrize("matmul", ["dot", "broadcast"])
def test_block_sparse_backward_kernel_equals_float64(matmul):
  """The block-sparse Pallas backward (dq and per-slot dk / dv shares, summed into the
  blocks) on the hand-made case: S off the block, -1 slots, a block selected twice, a
  padded query, GQA with a padded group."""
  q, k, v, blocks, q_pos, bs = _sparse_case()
  cotangent = jnp.asarray(np.random.default_rng(14).standard_normal(q.shape), jnp.float32)

  def loss(q, k, v):
    out = pallas_block_sparse.block_sparse_attention(q, k, v, blocks, q_pos, block_size=bs,
                                                     interpret=True, matmul=matmul)
    return jnp.sum(out * cotangent)

  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  want = npa.attention_vjp(q, k, v, npa.blocks_token_counts(blocks, q_pos, k.shape[1], bs),
                           cotangent)
  for name, g, w in zip("qkv", got, want):
    assert np.abs(w).max() > 1e-3, f"d{name} should not be trivially zero"
    np.testing.assert_allclose(np.asarray(g), w, atol=ATOL, rtol=0, err_msg=f"d{name}")


def test_block_sparse_backward_holds_the_selected_tokens_not_the_scores():
  b, t, s, n, kv, d, bs, slots = 1, 128, 1024, 4, 2, 16, 8, 2
  q, k, v = _qkv(15, b, t, s, n, kv, d)
  rng = np.random.default_rng(16)
  blocks = jnp.asarray(rng.integers(0, s // bs, (b, kv, t, slots)), jnp.int32)
  q_pos = jnp.full((b, t), s - 1, jnp.int32)

  def grads(attention):
    return jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v)), argnums=(0, 1, 2))

  pallas = lambda q, k, v: pallas_block_sparse.block_sparse_attention(
      q, k, v, blocks, q_pos, block_size=bs, interpret=True)
  mask = reference.blocks_to_token_mask(blocks, q_pos, s, block_size=bs)
  dense = lambda q, k, v: reference.masked_attention(q, k, v, mask.any(1))
  scores = b * n * t * s
  assert _largest_intermediate(grads(dense), q, k, v) >= scores  # The check can fail.
  assert _largest_intermediate(grads(pallas), q, k, v) < scores / 4


def test_visit_lists_skip_future_and_stale_tiles():
  """Hand-checked tile plan: 4 query tiles x 4 key tiles of 4 positions each."""
  pos = jnp.arange(16, dtype=jnp.int32)[None]
  tiles = pos.reshape(1, 4, 4)
  counts, order = pallas_flash.visit_lists(tiles, tiles, None)
  assert counts.tolist() == [[1, 2, 3, 4]]  # Causal: own tile and the ones before.
  assert order[0, 3].tolist() == [0, 1, 2, 3]
  counts, order = pallas_flash.visit_lists(tiles, tiles, 4)
  assert counts.tolist() == [[1, 2, 2, 2]]  # Window 4: own tile and the previous one.
  assert order[0, 2, :2].tolist() == [1, 2]
  padded = jnp.full((1, 1, 4), -1, jnp.int32)
  counts, _ = pallas_flash.visit_lists(padded, tiles, None)
  assert counts.tolist() == [[0]]


def _sparse_case(num_selected=3, block_size=4):
  """S=13 (not a multiple of the block size), T=5 queries per row, GQA 6/2.

  Row 0 uses the indexer's own selection (with -1 slots where a query has
  fewer visible blocks than slots); row 1 a hand-made replay selection with
  -1 slots in the middle and a repeated block; q_pos -1 marks a padded query.
  """
  b, t, s, h, kv, d = 2, 5, 13, 6, 2, 8
  q, k, v = _qkv(2, b, t, s, h, kv, d)
  q_pos = jnp.asarray([[3, 5, 8, 12, -1], [0, 1, 2, 9, 10]], jnp.int32)
  lengths = jnp.asarray([13, 11], jnp.int32)
  block_keys = reference.block_means(
      jnp.pad(k, ((0, 0), (0, 16 - s), (0, 0), (0, 0))), lengths, block_size=block_size)
  blocks = np.array(reference.select_blocks(q, block_keys, q_pos, block_size=block_size,
                                            num_selected=num_selected))
  blocks[1, :, 3] = [[2, -1, 0], [-1, 1, 1]]
  blocks[1, :, 4] = [[-1, -1, -1], [2, -1, 2]]
  assert (blocks[0] == -1).any() and (blocks[1] == -1).any()
  return q, k, v, jnp.asarray(blocks), q_pos, block_size


def _sparse_visibility(blocks, q_pos, s, block_size):
  return reference.blocks_to_token_mask(blocks, q_pos, s, block_size=block_size).any(1)


@pytest.mark.parametrize("matmul", ["dot", "broadcast"])
def test_block_sparse_matches_reference(matmul):
  q, k, v, blocks, q_pos, bs = _sparse_case()
  out = jax.jit(functools.partial(pallas_block_sparse.block_sparse_attention, block_size=bs,
                                  interpret=True, matmul=matmul))(q, k, v, blocks, q_pos)
  ref = reference.block_sparse_attention(q, k, v, blocks, q_pos, block_size=bs)
  _assert_matches(out, ref, _sparse_visibility(blocks, q_pos, k.shape[1], bs))


@pytest.mark.parametrize("matmul", ["dot", "broadcast"])
def test_a_non_finite_key_or_value_reaches_only_the_rows_that_see_it(matmul):
  """NaN in an empty ring slot (position -1) and in a future key: masked out by select,
  so no other row of the tile turns NaN, as in the reference (a zero weight times NaN
  would poison every row of the tile)."""
  q_pos, k_pos = _sequence_positions()
  q, k, v = _qkv(3, 4, 19, 19, 4, 2, 8)
  k, v = np.array(k), np.array(v)
  v[1, 16] = np.nan  # Row 1's padded key (position -1): no query sees it.
  k[1, 17] = np.nan
  v[0, 9] = np.nan  # Row 0's key at position 9: queries 9.. see it, 0..8 must not.
  k, v = jnp.asarray(k), jnp.asarray(v)
  out = np.asarray(_flash(q, k, v, q_pos, k_pos, None, matmul))
  ref = np.asarray(reference.causal_attention(q, k, v, q_pos, k_pos))
  sees_nan_bt = np.zeros(q_pos.shape, bool)
  sees_nan_bt[0, 9:] = True
  assert np.isnan(ref[sees_nan_bt]).all() and np.isnan(out[sees_nan_bt]).all()
  np.testing.assert_allclose(out[~sees_nan_bt], ref[~sees_nan_bt], atol=ATOL, rtol=0)
  assert np.isfinite(out[~sees_nan_bt]).all()

  q, k, v, blocks, q_pos, bs = _sparse_case()
  v = np.array(v)
  v[0, 12] = np.nan  # In block 1 of row 0: only queries that selected block 1 see it.
  v = jnp.asarray(v)
  out = np.asarray(jax.jit(functools.partial(
      pallas_block_sparse.block_sparse_attention, block_size=bs, interpret=True,
      matmul=matmul))(q, k, v, blocks, q_pos))
  ref = np.asarray(reference.block_sparse_attention(q, k, v, blocks, q_pos, block_size=bs))
  token_mask = np.asarray(reference.blocks_to_token_mask(blocks, q_pos, k.shape[1],
                                                         block_size=bs))  # [B, K, T, S]
  sees_nan_bkt = token_mask[..., 12] & (np.arange(2) == 0)[:, None, None]
  sees_nan_btnh = np.repeat(np.moveaxis(sees_nan_bkt, 1, 2), q.shape[2] // k.shape[2],
                            axis=2)[..., None] & np.ones(q.shape, bool)
  assert sees_nan_btnh.any() and (~sees_nan_btnh).any()
  assert np.isnan(out[sees_nan_btnh]).all() and np.isnan(ref[sees_nan_btnh]).all()
  np.testing.assert_allclose(out[~sees_nan_btnh], ref[~sees_nan_btnh], atol=ATOL, rtol=0)


def test_block_sparse_tpu_prefetch_variant_in_tpu_interpret_mode():
  """Selected through make_ops' flag; interpret=True maps to TPU interpret mode."""
  ops = pallas_ops.make_ops(interpret=True, block_sparse_impl="tpu_prefetch")
  q, k, v, blocks, q_pos, bs = _sparse_case()
  out = jax.jit(functools.partial(ops.block_sparse_attention, block_size=bs))(
      q, k, v, blocks, q_pos)
  ref = reference.block_sparse_attention(q, k, v, blocks, q_pos, block_size=bs)
  _assert_matches(out, ref, _sparse_visibility(blocks, q_pos, k.shape[1], bs))


def test_prefetch_fetch_indices_repeat_last_valid_block():
  blocks = jnp.asarray([[[[-1, 3, -1, -1, 1, -1]]]], jnp.int32)
  fetch = pallas_block_sparse_tpu._fetch_indices(blocks, num_blocks=4)
  assert fetch.tolist() == [[[[0, 3, 3, 3, 1, 1]]]]


@pytest.mark.slow
def test_portable_kernels_in_tpu_interpret_mode():
  """The TPU-shaped portable kernels (SMEM tables) under the TPU simulator."""
  interpret = pltpu.InterpretParams()
  q_pos, k_pos = _sequence_positions()
  q, k, v = _qkv(3, 4, 19, 19, 4, 2, 8)
  out = _flash(q, k, v, q_pos, k_pos, 5, "dot", platform="tpu", interpret=interpret)
  ref = reference.sliding_window_attention(q, k, v, q_pos, k_pos, window=5)
  _assert_matches(out, ref, reference.visibility_mask(q_pos, k_pos, 5))
  q, k, v, blocks, q_pos, bs = _sparse_case()
  out = jax.jit(functools.partial(pallas_block_sparse.block_sparse_attention, block_size=bs,
                                  interpret=interpret, platform="tpu"))(q, k, v, blocks, q_pos)
  ref = reference.block_sparse_attention(q, k, v, blocks, q_pos, block_size=bs)
  _assert_matches(out, ref, _sparse_visibility(blocks, q_pos, k.shape[1], bs))


@pytest.mark.slow
def test_bfloat16_inputs_match_reference():
  """bf16 in, f32 softmax inside, bf16 out: equal up to one bf16 rounding (|o| < 4)."""
  q_pos, k_pos = _sequence_positions()
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(7, 4, 19, 19, 4, 2, 8))
  out = _flash(q, k, v, q_pos, k_pos, 3, "dot")
  ref = reference.sliding_window_attention(q, k, v, q_pos, k_pos, window=3)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=0)
  q, k, v, blocks, sq_pos, bs = _sparse_case()
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  out = jax.jit(functools.partial(pallas_block_sparse.block_sparse_attention, block_size=bs,
                                  interpret=True))(q, k, v, blocks, sq_pos)
  ref = reference.block_sparse_attention(q, k, v, blocks, sq_pos, block_size=bs)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=0)


def _lowering_cases(platform, dtype):
  # Awkward sizes on purpose: T, S, G and D all need padding to tile shapes.
  b, t, s, h, kv, d, bs, n = 2, 37, 150, 6, 2, 12, 8, 3
  i32 = jnp.int32
  q = jax.ShapeDtypeStruct((b, t, h, d), dtype)
  kvs = jax.ShapeDtypeStruct((b, s, kv, d), dtype)
  q_pos, k_pos = jax.ShapeDtypeStruct((b, t), i32), jax.ShapeDtypeStruct((b, s), i32)
  blocks = jax.ShapeDtypeStruct((b, kv, t, n), i32)
  flash = functools.partial(pallas_flash.flash_attention, platform=platform)
  cases = {
      "causal": (flash, (q, kvs, kvs, q_pos, k_pos)),
      "sliding": (functools.partial(flash, window=8), (q, kvs, kvs, q_pos, k_pos)),
      "block_sparse": (functools.partial(pallas_block_sparse.block_sparse_attention,
                                         block_size=bs, platform=platform),
                       (q, kvs, kvs, blocks, q_pos)),
  }
  for name in ("causal", "sliding", "block_sparse"):  # The backward kernels too.
    fn, fargs = cases[name]
    cases[f"{name}_grad"] = (
        functools.partial(lambda fn, q, k, v, *ints: jax.grad(
            lambda q, k, v: jnp.sum(fn(q, k, v, *ints).astype(jnp.float32)),
            argnums=(0, 1, 2))(q, k, v), fn), fargs)
  if platform == "tpu":
    cases["block_sparse_prefetch"] = (
        functools.partial(pallas_block_sparse_tpu.block_sparse_attention, block_size=bs),
        (q, kvs, kvs, blocks, q_pos))
  return cases


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("platform,lowering_platform,custom_call", [
    ("tpu", "tpu", "tpu_custom_call"),
    ("gpu", "cuda", "__gpu$xla.gpu.triton"),
])
def test_kernels_lower_for_device_backends(platform, lowering_platform, custom_call, dtype):
  for name, (fn, args) in _lowering_cases(platform, dtype).items():
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(lowering_platform,)).as_text()
    assert custom_call in text, f"{name} did not lower to {custom_call} on {platform}"


def test_make_ops_has_the_reference_signatures():
  ops = dispatch.get_ops("pallas", True)
  assert isinstance(ops, dispatch.AttentionOps)
  for field in ("causal_attention", "sliding_window_attention", "block_sparse_attention",
                "select_blocks"):
    got = inspect.signature(getattr(ops, field)).parameters
    want = inspect.signature(getattr(reference, field)).parameters
    assert [(p.name, p.kind) for p in got.values()] == [(p.name, p.kind) for p in want.values()]
  assert ops.select_blocks is reference.select_blocks
  with pytest.raises(ValueError, match="block_sparse_impl"):
    pallas_ops.make_ops(interpret=True, block_sparse_impl="magic")
  with pytest.raises(ValueError, match="platform"):
    pallas_ops.make_ops(interpret=True, platform="cpu")


def test_compiled_mode_on_cpu_names_the_fix():
  q, k, v = _qkv(0, 1, 4, 4, 2, 1, 8)
  pos = jnp.arange(4, dtype=jnp.int32)[None]
  with pytest.raises(ValueError, match="pallas_interpret"):
    pallas_flash.flash_attention(q, k, v, pos, pos, interpret=False)


def _grad_cases(ops):
  """{op: (bind, (q, k, v), counts)}: counts [B, (K,) T, S] is how often each key enters each
  query's softmax, restated in numpy from positions and blocks (tests/kernels/numpy_attention)."""
  q_pos, k_pos = _sequence_positions()
  q, k, v, blocks, sq_pos, bs = _sparse_case()
  return {
      "causal": (lambda o: functools.partial(o.causal_attention, q_pos_bt=q_pos,
                                             k_pos_bs=k_pos),
                 _qkv(4, 4, 19, 19, 4, 2, 8), npa.visibility(q_pos, k_pos)),
      "sliding": (lambda o: functools.partial(o.sliding_window_attention, q_pos_bt=q_pos,
                                              k_pos_bs=k_pos, window=3),
                  _qkv(5, 4, 19, 19, 4, 2, 8), npa.visibility(q_pos, k_pos, 3)),
      # Row 1 selects block 2 twice for one query: its keys count twice.
      "block_sparse": (lambda o: functools.partial(o.block_sparse_attention,
                                                   blocks_bktj=blocks, q_pos_bt=sq_pos,
                                                   block_size=bs),
                       (q, k, v), npa.blocks_token_counts(blocks, sq_pos, k.shape[1], bs)),
  }


@pytest.mark.parametrize("op", ["causal", "sliding", "block_sparse"])
def test_gradients_equal_float64_gradients(op):
  """The kernels' custom VJPs against the softmax derivative in float64 numpy (itself checked
  against finite differences below), not against jax.grad of the jnp reference, which the
  backward pass recomputes and would share any error with."""
  pallas = pallas_ops.make_ops(interpret=True, **SMALL_TILES)
  bind, (q, k, v), counts = _grad_cases(pallas)[op]
  cotangent = jnp.asarray(np.random.default_rng(6).standard_normal(q.shape), jnp.float32)
  fn = bind(pallas)
  got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent),
                         argnums=(0, 1, 2)))(q, k, v)
  # The counts describe what the kernel computes: its forward is that attention.
  np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v)),
                             npa.attention_counted(q, k, v, counts), atol=ATOL, rtol=0)
  want = npa.attention_vjp(q, k, v, counts, cotangent)
  for name, g, w in zip("qkv", got, want):
    assert np.abs(w).max() > 1e-3, f"d{name} should not be trivially zero"
    np.testing.assert_allclose(np.asarray(g), w, atol=ATOL, rtol=0, err_msg=f"d{name}")


@pytest.mark.parametrize("op", ["causal", "sliding", "block_sparse"])
def test_float64_gradients_match_finite_differences(op):
  """The numpy VJP above against central differences of the numpy forward, in float64,
  along random directions of (q, k, v)."""
  _, (q, k, v), counts = _grad_cases(dispatch.REFERENCE_OPS)[op]
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  rng = np.random.default_rng(9)
  cotangent = rng.standard_normal(q.shape)
  grads = npa.attention_vjp(q, k, v, counts, cotangent)
  f = lambda q, k, v: np.sum(npa.attention_counted(q, k, v, counts) * cotangent)
  eps = 1e-6
  for _ in range(3):
    dirs = [rng.standard_normal(x.shape) for x in (q, k, v)]
    plus = f(*(x + eps * d for x, d in zip((q, k, v), dirs)))
    minus = f(*(x - eps * d for x, d in zip((q, k, v), dirs)))
    want = sum(np.sum(g * d) for g, d in zip(grads, dirs))
    assert (plus - minus) / (2 * eps) == pytest.approx(want, rel=1e-6, abs=1e-8)


# ---- Whole model: pallas backend (interpret) equals the reference backend. ----

def _tiny_model(backend):
  cfg = config_lib.default_model_config()
  cfg.layer_pattern = "SGF"  # One layer of each attention type.
  cfg.num_layers = 3
  cfg.num_dense_layers = 3  # Dense FFNs: MoE is not under test here, and compiles slowly.
  cfg.sliding_window = 4
  cfg.block_size = 4
  cfg.topk_tokens = 8  # 2 of up to 4 blocks: the selection is really sparse.
  cfg.max_seq_len = 16
  cfg.kernel_backend = backend
  cfg.pallas_interpret = True
  return transformer.Model(config_lib.validate(cfg))


def _random_params(model, seed=0):
  """Init-like weights from the parameter shapes (flax init compiles slowly on
  the CPU): N(0, 1/fan_in) matrices, unit norm scales, zero biases."""
  rng = np.random.default_rng(seed)

  def leaf(path, shape_dtype):
    name = jax.tree_util.keystr(path)
    shape = shape_dtype.shape
    if name.endswith("['scale']"):
      return jnp.ones(shape, shape_dtype.dtype)
    if "['b_" in name:
      return jnp.zeros(shape, shape_dtype.dtype)
    fan_in = 1 if "embedding" in name else shape[0]
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), shape_dtype.dtype)

  return jax.tree_util.tree_map_with_path(leaf, model.param_shapes())


@pytest.fixture(scope="module")
def tiny_models():
  ref_model, pallas_model = _tiny_model("reference"), _tiny_model("pallas")
  params = _random_params(ref_model)
  tokens = jax.random.randint(jax.random.key(1), (2, 14), 0, ref_model.spec.vocab_size)
  return ref_model, pallas_model, params, tokens


def test_model_forward_pallas_equals_reference(tiny_models):
  """Full sequences, the second one right-padded (position -1)."""
  ref_model, pallas_model, params, tokens = tiny_models
  t = tokens.shape[1]
  positions = jnp.asarray([np.arange(t), np.r_[np.arange(t - 4), [-1] * 4]], jnp.int32)
  ref_logits, _, ref_aux = jax.jit(ref_model.forward)(params, tokens, positions)
  logits, _, aux = jax.jit(pallas_model.forward)(params, tokens, positions)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-4, rtol=0)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), aux, ref_aux)), \
      "block selection differs between backends"


def test_model_cached_decode_pallas_equals_reference(tiny_models):
  """Token-by-token decode from an empty cache, past the window and several
  blocks; the second sequence starts 3 steps late (ragged lengths, padded steps)."""
  ref_model, pallas_model, params, tokens = tiny_models
  steps = 10
  logits = {}
  for name, model in (("reference", ref_model), ("pallas", pallas_model)):
    forward = jax.jit(model.forward)
    cache = model.init_cache(tokens.shape[0], 16)
    outs = []
    for t in range(steps):
      positions = jnp.asarray([[t], [t - 3 if t >= 3 else -1]], jnp.int32)
      out, cache, _ = forward(params, tokens[:, t:t + 1], positions, cache)
      outs.append(out)
    logits[name] = np.asarray(jnp.concatenate(outs, axis=1))
  np.testing.assert_allclose(logits["pallas"], logits["reference"], atol=1e-4, rtol=0)
