"""Block-sparse attention against dense float64 attention under the token mask its blocks imply.

The reference builds, with numpy loops, the mask "key s is in a selected block of the
query's KV group and s <= the query's position" and runs plain softmax attention.
Tolerances: atol = rtol = 1e-5 (fp32 vs float64); gradients: check_grads rev mode,
eps 1e-2, atol = rtol = 5e-3.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from agentic_rl.kernels import reference
from tests.kernels import numpy_attention as npa

H, K, D, BLOCK, S, N_SEL = 4, 2, 8, 4, 32, 3
TOL = dict(atol=1e-5, rtol=1e-5)

sparse = jax.jit(reference.block_sparse_attention, static_argnames="block_size")
token_mask = jax.jit(reference.blocks_to_token_mask, static_argnames=("num_keys", "block_size"))
causal = jax.jit(reference.causal_attention)

Q_POS = np.array([[0, 3, 4, 13, 31, -1], [7, 8, 20, 21, 22, 23]])


def qkv(seed):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((2, 6, H, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, S, K, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, S, K, D)), jnp.float32)
  return q, k, v


def random_blocks(seed, allow_future):
  """Distinct blocks per (batch, group, query), own block included, some slots -1.

  With allow_future, some rows also hold blocks past the query's own: the kernel must
  still mask their tokens by position.
  """
  rng = np.random.default_rng(seed)
  blocks = np.full((2, K, 6, N_SEL), -1, np.int32)
  for b in range(2):
    for kv in range(K):
      for t in range(6):
        if Q_POS[b, t] < 0:
          continue
        own = Q_POS[b, t] // BLOCK
        pool = np.arange(S // BLOCK if allow_future else own + 1)
        others = rng.permutation(pool[pool != own])[:rng.integers(0, N_SEL)]
        blocks[b, kv, t, :others.size + 1] = np.concatenate([[own], others])
        blocks[b, kv, t] = rng.permutation(blocks[b, kv, t])  # -1 slots anywhere
  return jnp.asarray(blocks)


@pytest.mark.parametrize("allow_future", [False, True])
def test_matches_dense_attention_under_the_block_mask(allow_future):
  q, k, v = qkv(0)
  blocks = random_blocks(1, allow_future)
  q_pos = jnp.asarray(Q_POS, jnp.int32)
  want = npa.attention(q, k, v, npa.blocks_token_mask(blocks, Q_POS, S, BLOCK))
  np.testing.assert_allclose(sparse(q, k, v, blocks, q_pos, block_size=BLOCK), want, **TOL)


def test_blocks_to_token_mask_matches_numpy():
  blocks = random_blocks(2, allow_future=True)
  got = token_mask(blocks, jnp.asarray(Q_POS, jnp.int32), num_keys=S, block_size=BLOCK)
  np.testing.assert_array_equal(got, npa.blocks_token_mask(blocks, Q_POS, S, BLOCK))


def test_selecting_every_visible_block_is_dense_causal_attention():
  q, k, v = qkv(3)
  q_pos = jnp.asarray(Q_POS, jnp.int32)
  num_blocks = S // BLOCK
  # All 8 blocks, future ones included: causality must come from positions alone.
  blocks = jnp.broadcast_to(jnp.arange(num_blocks, dtype=jnp.int32), (2, K, 6, num_blocks))
  k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (2, S))
  np.testing.assert_allclose(sparse(q, k, v, blocks, q_pos, block_size=BLOCK),
                             causal(q, k, v, q_pos, k_pos), **TOL)


def test_padding_rows_and_empty_selections_are_zero_with_finite_gradients():
  q, k, v = qkv(4)
  q_pos = jnp.asarray(Q_POS, jnp.int32)
  blocks = np.asarray(random_blocks(5, allow_future=False)).copy()
  blocks[1, :, 2] = -1  # a live query whose selection is empty in every group
  blocks = jnp.asarray(blocks)
  ct = jnp.asarray(np.random.default_rng(6).standard_normal(q.shape), jnp.float32)

  def loss(q, k, v):
    return jnp.sum(sparse(q, k, v, blocks, q_pos, block_size=BLOCK) * ct)

  out = sparse(q, k, v, blocks, q_pos, block_size=BLOCK)
  np.testing.assert_array_equal(out[0, 5], 0.0)  # padding query
  np.testing.assert_array_equal(out[1, 2], 0.0)  # nothing selected
  dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(g))
  np.testing.assert_array_equal(dq[0, 5], 0.0)
  np.testing.assert_array_equal(dq[1, 2], 0.0)
  # Keys outside every selected block get no gradient.
  touched = npa.blocks_token_mask(blocks, Q_POS, S, BLOCK).any(axis=2)  # [B, K, S]
  untouched = ~np.transpose(touched, (0, 2, 1))  # [B, S, K]
  np.testing.assert_array_equal(np.asarray(dk)[untouched], 0.0)
  np.testing.assert_array_equal(np.asarray(dv)[untouched], 0.0)


def test_gradients_match_finite_differences():
  q, k, v = qkv(7)
  q_pos = jnp.asarray(Q_POS, jnp.int32)
  blocks = random_blocks(8, allow_future=False)
  fn = lambda q, k, v: sparse(q, k, v, blocks, q_pos, block_size=BLOCK)
  check_grads(fn, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=5e-3, rtol=5e-3)
