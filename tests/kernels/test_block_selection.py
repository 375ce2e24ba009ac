"""The G-layer indexer: block means, block scores and top-n block selection vs numpy.

Scoring rule under test (agentic_rl/kernels/reference.py): the KV group's mean query dotted
with the block's mean key, divided by sqrt(D); the own block always wins, future
blocks never do. Tolerances: scores and means atol = rtol = 1e-5 (fp32 vs float64);
the top-n check allows ties within 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.kernels import reference
from tests.kernels import numpy_attention as npa

H, K, D, BLOCK = 4, 2, 8, 4
TOL = dict(atol=1e-5, rtol=1e-5)

block_means = jax.jit(reference.block_means, static_argnames="block_size")
block_scores = jax.jit(reference.block_scores, static_argnames="block_size")
select_blocks = jax.jit(reference.select_blocks, static_argnames=("block_size", "num_selected"))

# Own blocks: [0, 0, 1, 3, 7, pad] and [1, 2, 5, 5, 5, 5]: fewer visible blocks than n,
# exactly n, and many more than n.
Q_POS = jnp.asarray([[0, 3, 4, 13, 31, -1], [7, 8, 20, 21, 22, 23]], jnp.int32)


def inputs(seed, num_blocks):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((2, 6, H, D)), jnp.float32)
  block_keys = jnp.asarray(rng.standard_normal((2, num_blocks, K, D)), jnp.float32)
  return q, block_keys


def test_block_means_match_numpy_with_partial_and_empty_blocks():
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.standard_normal((3, 16, K, D)), jnp.float32)
  lengths = jnp.asarray([11, 0, 16], jnp.int32)  # partial last block; empty sequence; full
  got = block_means(k, lengths, block_size=BLOCK)
  assert got.shape == (3, 4, K, D)
  np.testing.assert_allclose(got, npa.block_means(k, np.asarray(lengths), BLOCK), **TOL)
  np.testing.assert_array_equal(got[1], 0.0)
  np.testing.assert_array_equal(got[0, 3], 0.0)  # positions 12..15 are past length 11


def test_block_scores_follow_the_documented_rule():
  q, bk = inputs(1, 8)
  got = np.asarray(block_scores(q, bk, Q_POS, block_size=BLOCK))
  raw = npa.raw_block_scores(q, bk)
  q_pos = np.asarray(Q_POS)
  for b in range(2):
    for t in range(6):
      own = q_pos[b, t] // BLOCK if q_pos[b, t] >= 0 else -1
      row = got[b, :, t]  # [K, N]
      if own < 0:
        assert np.all(row == -np.inf), "a padding query must score every block -inf"
        continue
      np.testing.assert_allclose(row[:, :own], raw[b, :, t, :own], **TOL)
      assert np.all(row[:, own] == np.inf)
      assert np.all(row[:, own + 1:] == -np.inf)


@pytest.mark.parametrize("num_blocks,num_selected", [(8, 3), (8, 1), (8, 8), (2, 3)])
def test_select_blocks_is_a_causal_top_n(num_blocks, num_selected):
  q, bk = inputs(2, num_blocks)
  q_pos = Q_POS if num_blocks * BLOCK > 31 else jnp.minimum(Q_POS, num_blocks * BLOCK - 1)
  got = select_blocks(q, bk, q_pos, block_size=BLOCK, num_selected=num_selected)
  assert got.shape == (2, K, 6, num_selected) and got.dtype == jnp.int32
  npa.check_topk_selection(got, npa.raw_block_scores(q, bk), q_pos, BLOCK, num_selected)


def test_selection_is_shared_by_the_query_heads_of_a_group():
  # Permuting heads inside a group leaves the group's mean query, hence the selection, unchanged.
  q, bk = inputs(3, 8)
  perm = jnp.asarray([1, 0, 3, 2])  # swaps within groups {0,1} and {2,3}
  a = select_blocks(q, bk, Q_POS, block_size=BLOCK, num_selected=3)
  b = select_blocks(q[:, :, perm], bk, Q_POS, block_size=BLOCK, num_selected=3)
  np.testing.assert_array_equal(np.sort(a, -1), np.sort(b, -1))


def test_selection_changes_with_the_scores():
  # Guards against a selection that ignores the scores (e.g. always the latest blocks).
  q, bk = inputs(4, 8)
  q_pos = jnp.full((2, 6), 31, jnp.int32)
  picks = set()
  for sign in (1.0, -1.0):
    got = np.asarray(select_blocks(sign * q, bk, q_pos, block_size=BLOCK, num_selected=2))
    npa.check_topk_selection(got, npa.raw_block_scores(sign * q, bk), q_pos, BLOCK, 2)
    picks.add(tuple(got[0, 0, 0]))
  assert len(picks) == 2, picks
