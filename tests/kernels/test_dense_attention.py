"""Dense, causal and sliding-window attention kernels against a float64 numpy loop.

Tolerances: fp32 kernel vs float64 reference, atol = rtol = 1e-5 on outputs of O(1).
Numerical gradients: jax.test_util.check_grads (rev mode, one random direction),
eps 1e-2 and atol = rtol = 5e-3 (central differences in float32).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from agentic_rl.kernels import reference
from tests.kernels import numpy_attention as npa

H, K, D = 4, 2, 8
TOL = dict(atol=1e-5, rtol=1e-5)

causal = jax.jit(reference.causal_attention)
sliding = jax.jit(reference.sliding_window_attention, static_argnames="window")
masked = jax.jit(reference.masked_attention)


def qkv(seed, b, t, s):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((b, t, H, D), (b, s, K, D), (b, s, K, D)))


def training_positions():
  """Full sequences (queries = keys); row 1 is padded (-1) after 9 tokens."""
  pos = np.tile(np.arange(12), (2, 1))
  pos[1, 9:] = -1
  return jnp.asarray(pos, jnp.int32), jnp.asarray(pos, jnp.int32)


def cache_positions():
  """A decode-like chunk against a ring-like key buffer: keys out of order, empty slots (-1),
  a padding query, and queries that see no key at all (position 0 with key 0 absent)."""
  q_pos = np.array([[13, 14, 15, 16, 17, -1], [0, 1, 2, 5, 9, 30]])
  k_pos = np.array([[8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 4, 5, 6, 7, -1, -1],
                    [3, 7, 1, -1, 2, 9, 5, 30, 4, 8, 6, 29, 28, -1, 27, 26]])
  return jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32)


CASES = {"training": (training_positions, 12, 12, 10), "cache": (cache_positions, 6, 16, 11)}


@pytest.fixture(params=sorted(CASES), scope="module")
def case(request):
  make_positions, t, s, seed = CASES[request.param]
  q_pos, k_pos = make_positions()
  return qkv(seed, 2, t, s), q_pos, k_pos


def test_masked_attention_matches_numpy_including_empty_rows():
  q, k, v = qkv(0, 2, 6, 16)
  mask = np.random.default_rng(1).random((2, 6, 16)) < 0.4
  mask[0, 2] = False  # a row with no visible key must give zeros
  out = masked(q, k, v, jnp.asarray(mask))
  np.testing.assert_allclose(out, npa.attention(q, k, v, mask), **TOL)
  np.testing.assert_array_equal(out[0, 2], 0.0)


def test_causal_attention_matches_numpy(case):
  (q, k, v), q_pos, k_pos = case
  want = npa.attention(q, k, v, npa.visibility(q_pos, k_pos))
  np.testing.assert_allclose(causal(q, k, v, q_pos, k_pos), want, **TOL)


@pytest.mark.parametrize("window", [1, 4])
def test_sliding_window_attention_matches_numpy(case, window):
  (q, k, v), q_pos, k_pos = case
  want = npa.attention(q, k, v, npa.visibility(q_pos, k_pos, window=window))
  np.testing.assert_allclose(sliding(q, k, v, q_pos, k_pos, window=window), want, **TOL)


def test_window_wider_than_context_is_exactly_causal(case):
  (q, k, v), q_pos, k_pos = case
  wide = sliding(q, k, v, q_pos, k_pos, window=64)  # every position difference is < 64
  np.testing.assert_array_equal(wide, causal(q, k, v, q_pos, k_pos))


def test_window_one_attends_only_to_itself():
  q, k, v = qkv(3, 2, 12, 12)
  q_pos, k_pos = training_positions()
  out = np.asarray(sliding(q, k, v, q_pos, k_pos, window=1))
  # Each query sees exactly its own key, so softmax weight 1 on its own value.
  want = np.repeat(np.asarray(v), H // K, axis=2)
  valid = np.asarray(q_pos) >= 0
  np.testing.assert_allclose(out[valid], want[valid], **TOL)
  np.testing.assert_array_equal(out[~valid], 0.0)


@pytest.mark.parametrize("kernel", ["causal", "sliding"])
def test_padding_rows_are_zero_with_finite_gradients(kernel):
  q, k, v = qkv(4, 2, 12, 12)
  q_pos, k_pos = training_positions()
  fn = causal if kernel == "causal" else functools.partial(sliding, window=4)
  out = fn(q, k, v, q_pos, k_pos)
  pad = np.asarray(q_pos) < 0
  np.testing.assert_array_equal(np.asarray(out)[pad], 0.0)
  ct = jnp.asarray(np.random.default_rng(5).standard_normal(out.shape), jnp.float32)
  dq, dk, dv = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, q_pos, k_pos) * ct),
                        argnums=(0, 1, 2))(q, k, v)
  for g in (dq, dk, dv):
    assert np.all(np.isfinite(g))
  # Padding takes no part: no gradient to padded queries, keys or values.
  for g in (dq, dk, dv):
    np.testing.assert_array_equal(np.asarray(g)[pad], 0.0)


@pytest.mark.parametrize("kernel", ["causal", "sliding"])
def test_gradients_match_finite_differences(kernel):
  q, k, v = qkv(6, 2, 12, 12)
  q_pos, k_pos = training_positions()
  if kernel == "causal":
    fn = lambda q, k, v: causal(q, k, v, q_pos, k_pos)
  else:
    fn = lambda q, k, v: sliding(q, k, v, q_pos, k_pos, window=4)
  check_grads(fn, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=5e-3, rtol=5e-3)


local = jax.jit(reference.local_window_attention,
                static_argnames=("window", "chunks_per_window"))


@pytest.mark.parametrize("chunks_per_window", [1, 2, 4, 3])
@pytest.mark.parametrize("t,window", [(12, 4), (12, 5), (13, 1), (7, 16), (16, 16), (33, 8),
                                      (40, 13)])
def test_local_window_attention_matches_numpy(t, window, chunks_per_window):
  """The O(T*W) chunked path against the float64 dense loop: ragged padding, T not a
  multiple of the window, windows the chunks do not divide, and rows whose positions
  are a permutation."""
  rng = np.random.default_rng(t * 100 + window)
  pos = np.tile(np.arange(t), (3, 1))
  pos[1, t * 2 // 3:] = -1  # Right padding.
  pos[2] = rng.permutation(t)  # Unique positions in any order.
  pos = jnp.asarray(pos, jnp.int32)
  q, k, v = qkv(t + window, 3, t, t)
  want = npa.attention(q, k, v, npa.visibility(pos, pos, window=window))
  np.testing.assert_allclose(
      local(q, k, v, pos, window=window, chunks_per_window=chunks_per_window), want, **TOL)


def test_local_window_attention_gradients_match_the_dense_path():
  pos = jnp.asarray(np.tile(np.arange(20), (2, 1)), jnp.int32).at[1, 15:].set(-1)
  q, k, v = qkv(7, 2, 20, 20)
  w = jax.random.normal(jax.random.key(0), (2, 20, H, D))
  dense = lambda q, k, v: jnp.sum(w * reference.sliding_window_attention(
      q, k, v, pos, pos, window=6))
  chunked = lambda q, k, v: jnp.sum(w * reference.local_window_attention(q, k, v, pos, window=6))
  for g_dense, g_local in zip(jax.grad(dense, (0, 1, 2))(q, k, v),
                              jax.grad(chunked, (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(g_local, g_dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_kv_heads,group", [(1, 4), (2, 2), (4, 1), (3, 2)])
def test_one_query_path_matches_numpy_at_every_head_layout(num_kv_heads, group):
  """The decode step's block-diagonal dots against the float64 loop, with rows that see
  all, some, one and none of the keys."""
  rng = np.random.default_rng(num_kv_heads)
  b, s, d = 4, 19, 8
  q = rng.standard_normal((b, 1, num_kv_heads * group, d)).astype(np.float32)
  k, v = (rng.standard_normal((b, s, num_kv_heads, d)).astype(np.float32) for _ in range(2))
  mask = rng.random((b, 1, s)) < 0.5
  mask[0], mask[2], mask[3] = True, False, False
  mask[2, 0, 7] = True
  got = np.asarray(masked(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask)))
  np.testing.assert_allclose(got, npa.attention(q, k, v, mask), **TOL)
  np.testing.assert_array_equal(got[3], 0.0)


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
def test_one_query_path_matches_numpy_and_the_many_query_path_on_non_finite_keys(fill):
  """A decode step (T = 1) takes its own formulation; it must agree with the float64 loop,
  and with the T > 1 path on the select rules: an unseen non-finite key or value changes
  nothing, a seen one makes that kv group's output NaN."""
  q, k, v = qkv(4, 3, 1, 16)
  mask = np.random.default_rng(5).random((3, 1, 16)) < 0.6
  mask[2] = False  # Sees nothing: zeros.
  mask[0, 0, :2] = True
  k, v = np.array(k), np.array(v)
  unseen = np.argwhere(~mask[1, 0])[:2, 0]
  k[1, unseen[0], 0], v[1, unseen[1], 1] = fill, fill  # Row 1: only unseen ones.
  k[0, 0, 0, 3] = fill  # Row 0: a seen key in kv group 0,
  v[0, 1, 1, 2] = fill  # and a seen value in kv group 1.
  got = np.asarray(masked(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask)))
  # The many-query path on the same row, padded with a query that sees nothing.
  q2 = jnp.concatenate([q, q], axis=1)
  mask2 = np.concatenate([mask, np.zeros_like(mask)], axis=1)
  many = np.asarray(masked(q2, jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask2)))[:, :1]
  np.testing.assert_array_equal(np.isnan(got), np.isnan(many))
  assert np.isnan(got[0]).all() and not np.isnan(got[1:]).any()
  clean_k, clean_v = np.where(np.isfinite(k), k, 0.0), np.where(np.isfinite(v), v, 0.0)
  want = npa.attention(q, clean_k, clean_v, mask)
  np.testing.assert_allclose(got[1:], want[1:], **TOL)
  np.testing.assert_allclose(got[1:], many[1:], **TOL)
  np.testing.assert_array_equal(got[2], 0.0)


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["key", "value"])
def test_one_seen_non_finite_entry_makes_the_decode_row_nan(fill, where):
  """At T = 1 a seen non-finite key or value in one kv group makes the row NaN; the
  many-query path makes only that group NaN. The output projection mixes the groups, so
  the token's next hidden state is NaN either way. The other rows are untouched."""
  q, k, v = qkv(6, 2, 1, 10)
  mask = np.ones((2, 1, 10), bool)
  k, v = np.array(k), np.array(v)
  (k if where == "key" else v)[0, 4, 1, :] = fill  # Row 0, kv group 1, every entry.
  got = np.asarray(masked(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask)))
  q2 = jnp.concatenate([q, q], axis=1)
  many = np.asarray(masked(q2, jnp.asarray(k), jnp.asarray(v),
                           jnp.asarray(np.concatenate([mask, mask], axis=1))))[:, :1]
  assert np.isnan(got[0]).all() and not np.isnan(got[1]).any()
  assert np.isnan(many[0, 0, H // K:]).all() and not np.isnan(many[0, 0, :H // K]).any()
  np.testing.assert_allclose(got[1], many[1], **TOL)
