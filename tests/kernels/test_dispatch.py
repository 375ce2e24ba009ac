"""The single kernel dispatch point: backends by name, clear errors, and any Pallas backend
held to the reference ops (atol = rtol = 1e-5, fp32)."""

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

from kernels import dispatch, reference


def test_reference_backend_is_the_reference_ops():
  ops = dispatch.get_ops("reference")
  assert ops.causal_attention is reference.causal_attention
  assert ops.sliding_window_attention is reference.sliding_window_attention
  assert ops.block_sparse_attention is reference.block_sparse_attention
  assert ops.select_blocks is reference.select_blocks


def test_unknown_backend_names_the_value_and_the_choices():
  with pytest.raises(ValueError, match=r"kernel_backend='cuda'.*'reference' or 'pallas'"):
    dispatch.get_ops("cuda")


@pytest.mark.slow  # Pallas interpret mode takes ~15 s on 2 CPU cores.
@pytest.mark.skipif(importlib.util.find_spec("kernels.pallas_ops") is None,
                    reason="no Pallas backend (kernels/pallas_ops.py) in this tree yet")
def test_pallas_backend_matches_reference_in_interpret_mode():
  ops = dispatch.get_ops("pallas", interpret=True)
  rng = np.random.default_rng(0)
  b, t, h, k, d, block = 1, 16, 4, 2, 8, 4
  q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
  kk = jnp.asarray(rng.standard_normal((b, t, k, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, t, k, d)), jnp.float32)
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  tol = dict(atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(ops.causal_attention(q, kk, v, pos, pos),
                             reference.causal_attention(q, kk, v, pos, pos), **tol)
  np.testing.assert_allclose(ops.sliding_window_attention(q, kk, v, pos, pos, window=5),
                             reference.sliding_window_attention(q, kk, v, pos, pos, window=5),
                             **tol)
  bk = reference.block_means(kk, jnp.asarray([t]), block_size=block)
  blocks = reference.select_blocks(q, bk, pos, block_size=block, num_selected=2)
  np.testing.assert_array_equal(
      ops.select_blocks(q, bk, pos, block_size=block, num_selected=2), blocks)
  np.testing.assert_allclose(
      ops.block_sparse_attention(q, kk, v, blocks, pos, block_size=block),
      reference.block_sparse_attention(q, kk, v, blocks, pos, block_size=block), **tol)
