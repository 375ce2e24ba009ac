"""Sampling-mask packing and top-k/top-p masks against numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.records import sampling_mask as sm


@pytest.mark.parametrize("vocab", [1, 7, 8, 13, 320])
def test_pack_matches_numpy_and_round_trips(vocab):
  rng = np.random.default_rng(vocab)
  mask = rng.random((3, 5, vocab)) < 0.4
  packed = sm.pack_mask(jnp.asarray(mask))
  assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, sm.packed_width(vocab))
  np.testing.assert_array_equal(np.asarray(packed), np.packbits(mask, axis=-1, bitorder="little"))
  np.testing.assert_array_equal(np.asarray(sm.unpack_mask(packed, vocab)), mask)


def test_bit_order_is_little_endian():
  mask = np.zeros(10, bool)
  mask[[0, 3, 9]] = True
  packed = np.asarray(sm.pack_mask(jnp.asarray(mask)))
  assert packed.tolist() == [1 + 8, 2]  # bit i of byte j is vocab id 8 j + i


def test_apply_mask_sets_minus_inf_outside():
  logits = jnp.arange(10.0).reshape(1, 10)
  mask = np.zeros((1, 10), bool)
  mask[0, [2, 5]] = True
  for m in (jnp.asarray(mask), sm.pack_mask(jnp.asarray(mask))):
    out = np.asarray(sm.apply_mask_to_logits(logits, m))
    assert out[0, 2] == 2.0 and out[0, 5] == 5.0
    assert np.isneginf(np.delete(out[0], [2, 5])).all()


def test_bad_inputs_raise():
  with pytest.raises(ValueError, match="bool mask"):
    sm.pack_mask(jnp.ones((4,), jnp.int32))
  with pytest.raises(ValueError, match="needs 2"):
    sm.unpack_mask(jnp.zeros((3,), jnp.uint8), 13)
  with pytest.raises(ValueError, match="top_p"):
    sm.sampling_mask_from_logits(jnp.zeros((4,)), top_p=0.0)


def _numpy_top_k_top_p(logits, top_k, top_p):
  v = logits.shape[-1]
  keep = np.zeros(v, bool)
  order = sorted(range(v), key=lambda i: (-logits[i], i))
  if top_k:
    order = order[:top_k]
  z = np.array([logits[i] for i in order], np.float64)
  p = np.exp(z - z.max())
  p /= p.sum()
  mass = 0.0
  for rank, i in enumerate(order):
    if rank == 0 or mass < top_p:
      keep[i] = True
    mass += p[rank]
  return keep


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (8, 0.5), (3, 0.99)])
def test_top_k_top_p_matches_reference(top_k, top_p):
  rng = np.random.default_rng(top_k)
  logits = rng.normal(size=(6, 20)).astype(np.float32) * 2
  got = np.asarray(sm.sampling_mask_from_logits(jnp.asarray(logits), top_k=top_k, top_p=top_p))
  for row in range(6):
    np.testing.assert_array_equal(got[row], _numpy_top_k_top_p(logits[row], top_k, top_p))


def test_masked_sampling_draws_only_kept_tokens_and_logp_is_renormalised():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 16)), jnp.float32)
  keep = sm.sampling_mask_from_logits(logits, top_k=4)
  logp = jax.nn.log_softmax(sm.apply_mask_to_logits(logits, keep), axis=-1)
  draws = jax.random.categorical(jax.random.key(0), logp, shape=(500, 1))
  assert np.asarray(keep)[0, np.asarray(draws).ravel()].all()
  np.testing.assert_allclose(np.exp(np.asarray(logp))[np.asarray(keep)].sum(), 1.0, rtol=1e-6)


def _two_sorts(logits_v, top_k, top_p):
  """The mask as it was first written (a stable argsort, then an argsort of that
  permutation to scatter back): the reference for the one-sort and top_k paths."""
  vocab_size = logits_v.shape[-1]
  order_v = jnp.argsort(-logits_v, axis=-1, stable=True)
  sorted_v = jnp.take_along_axis(logits_v, order_v, axis=-1)
  rank_v = jnp.arange(vocab_size)
  keep_sorted = jnp.ones(logits_v.shape, jnp.bool_)
  if top_k:
    keep_sorted = rank_v < top_k
    sorted_v = jnp.where(keep_sorted, sorted_v, -jnp.inf)
  if top_p < 1.0:
    probs_v = jax.nn.softmax(sorted_v, axis=-1)
    mass_before_v = jnp.cumsum(probs_v, axis=-1) - probs_v
    keep_sorted = keep_sorted & ((mass_before_v < top_p) | (rank_v == 0))
  keep_sorted = jnp.broadcast_to(keep_sorted, logits_v.shape)
  return jnp.take_along_axis(keep_sorted, jnp.argsort(order_v, axis=-1), axis=-1)


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (3, 1.0), (31, 1.0), (32, 1.0), (0, 0.5),
                                         (0, 0.9), (5, 0.6), (0, 1.0)])
def test_one_sort_or_top_k_keeps_what_two_sorts_kept(top_k, top_p):
  rng = np.random.default_rng(top_k + int(top_p * 10))
  # Integer logits: many ties at every cut, broken by vocabulary order in both.
  tied = rng.integers(-3, 3, size=(2, 5, 32)).astype(np.float32)
  spread = rng.normal(size=(2, 5, 32)).astype(np.float32) * 3
  for logits in (tied, spread):
    got = sm.sampling_mask_from_logits(jnp.asarray(logits), top_k=top_k, top_p=top_p)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(_two_sorts(jnp.asarray(logits), top_k, top_p)))


@pytest.mark.parametrize("top_k,top_p,sorts", [(0, 1.0, 0), (64, 1.0, 0), (5, 1.0, 0),
                                               (0, 0.9, 1), (5, 0.9, 0)])
def test_the_mask_sorts_at_most_once(top_k, top_p, sorts):
  """No truncation: no work at all; top-k: lax.top_k; top-p alone: one sort."""
  jaxpr = str(jax.make_jaxpr(lambda x: sm.sampling_mask_from_logits(
      x, top_k=top_k, top_p=top_p))(jnp.zeros((4, 64))))
  assert jaxpr.count(" sort[") == sorts
  assert ("top_k[" in jaxpr) == (0 < top_k < 64)
