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
