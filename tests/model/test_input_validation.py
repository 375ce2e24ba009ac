"""`Model.forward` rejects ids and positions it would silently mishandle, with errors that
name the bad entry and its bound.

Without these checks: an id >= vocab_size embeds as NaN and its NaN reached every
position of the row (earlier ones too); a negative id wrapped to another token; a
position at or past a cache's capacity was dropped from the cache while its length
still grew; a cached call that skipped ahead of (or rewound behind) the cache length
left a hole of zeros (or overwrote the past) that later tokens attended to.

Model: "SGF" (every attention type, a dense FFN then MoE), vocab 64, block 4, and a
cache of 16 positions. Checks run on concrete (host) arrays; under jit they are skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model import transformer
from agentic_rl.model.transformer import Model
from tests.model.model_fixtures import draw_params, make_spec

SPEC = make_spec("SGF", 3, num_dense_layers=1)
CAPACITY = 16


@functools.lru_cache(maxsize=None)
def model_and_params():
  model = Model(SPEC)
  return model, draw_params(model, seed=3)


def tokens(n, seed=0):
  return np.random.default_rng(seed).integers(0, SPEC.vocab_size, (1, n)).astype(np.int32)


def prefilled(n):
  """A cache of capacity 16 holding n tokens of one sequence."""
  model, params = model_and_params()
  cache = model.init_cache(1, CAPACITY)
  _, cache, _ = model.forward(params, tokens(n), np.arange(n, dtype=np.int32)[None], cache)
  return cache


@pytest.mark.parametrize("bad_id", [SPEC.vocab_size, SPEC.vocab_size + 7, -1])
def test_a_token_id_outside_the_vocabulary_is_rejected(bad_id):
  model, params = model_and_params()
  toks = tokens(12)
  toks[0, 10] = bad_id
  with pytest.raises(ValueError, match=rf"token id {bad_id} at row 0, index 10.*"
                                       rf"\[0, {SPEC.vocab_size}\)"):
    model.forward(params, toks, np.arange(12, dtype=np.int32)[None])


def test_an_out_of_vocabulary_id_on_a_padding_position_is_rejected_too():
  # Padding still goes through the embedding; a NaN there must not be possible either.
  model, params = model_and_params()
  toks = tokens(8)
  toks[0, 7] = SPEC.vocab_size
  positions = np.array([[0, 1, 2, 3, 4, 5, 6, -1]], np.int32)
  with pytest.raises(ValueError, match="token id 64 at row 0, index 7"):
    model.forward(params, toks, positions)


def test_a_position_below_minus_one_is_rejected():
  model, params = model_and_params()
  positions = np.array([[0, 1, -2, 3]], np.int32)
  with pytest.raises(ValueError, match=r"position -2 at row 0, index 2.*-1 marks padding"):
    model.forward(params, tokens(4), positions)


@pytest.mark.parametrize("position", [CAPACITY, CAPACITY + 5])
def test_a_position_at_or_past_the_cache_capacity_is_rejected(position):
  model, params = model_and_params()
  cache = model.init_cache(1, CAPACITY)
  # Lengths at `position` so that only the capacity, not continuity, is at fault.
  cache = dict(cache, lengths=jnp.asarray([position], jnp.int32))
  with pytest.raises(ValueError, match=rf"position {position} at row 0, index 0 is at or "
                                       rf"past the cache capacity {CAPACITY}"):
    model.forward(params, tokens(1), np.array([[position]], np.int32), cache)


def test_uncached_sparse_layers_reject_positions_past_their_key_buffer():
  # Without a cache, G layers index keys by position in a buffer of T rounded up to the
  # block: a position past it was dropped and its own block never selected.
  model, params = model_and_params()
  positions = np.arange(8, dtype=np.int32)[None] + 4  # 4..11; the buffer holds 0..7
  with pytest.raises(ValueError, match=r"position 8 at row 0, index 4 .*key buffer of 8"):
    model.forward(params, tokens(8), positions)


@pytest.mark.parametrize("position", [6, 4, 0])
def test_a_decode_position_that_skips_ahead_or_rewinds_is_rejected(position):
  model, params = model_and_params()
  cache = prefilled(5)
  with pytest.raises(ValueError, match=rf"row 0 feeds position {position} but its cache holds "
                                       r"5 tokens.*positions 5, 6, 7"):
    model.forward(params, tokens(1), np.array([[position]], np.int32), cache)


def test_a_prefill_chunk_with_a_gap_or_a_repeat_is_rejected():
  model, params = model_and_params()
  cache = prefilled(5)
  for positions in ([5, 7, -1], [5, 5, 6]):
    with pytest.raises(ValueError, match=r"row 0.*5, 6, 7"):
      model.forward(params, tokens(3), np.array([positions], np.int32), cache)


def test_uncached_positions_must_be_distinct():
  model, params = model_and_params()
  with pytest.raises(ValueError, match=r"row 0 holds position 2 twice"):
    model.forward(params, tokens(4), np.array([[0, 1, 2, 2]], np.int32))


def test_valid_calls_pass_and_sit_out_rows_are_not_checked_for_continuity():
  model, params = model_and_params()
  cache = prefilled(5)
  cache = jax.tree.map(lambda x: jnp.concatenate([x, x]), cache)  # two rows holding 5
  toks = np.concatenate([tokens(3), tokens(3, seed=1)])
  positions = np.array([[5, 6, 7], [-1, -1, -1]], np.int32)  # row 1 sits the call out
  logits, cache, _ = model.forward(params, toks, positions, cache)
  assert np.isfinite(np.asarray(logits)[0]).all()
  np.testing.assert_array_equal(cache["lengths"], [8, 5])


def test_check_inputs_reads_the_capacity_and_lengths_it_is_given():
  """The host-side check the rollout engine calls with its own host-side lengths."""
  positions = np.array([[3], [-1]], np.int32)
  toks = np.zeros((2, 1), np.int32)
  transformer.check_inputs(SPEC, toks, positions, lengths_b=np.array([3, 9]), capacity=8)
  # The last slot of a cache is still accepted.
  transformer.check_inputs(SPEC, toks, np.array([[7], [-1]], np.int32),
                           lengths_b=np.array([7, 0]), capacity=8)
  with pytest.raises(ValueError, match="holds 2 tokens"):
    transformer.check_inputs(SPEC, toks, positions, lengths_b=np.array([2, 9]), capacity=8)
  with pytest.raises(ValueError, match="cache capacity 3"):
    transformer.check_inputs(SPEC, toks, positions, lengths_b=np.array([3, 0]), capacity=3)
  with pytest.raises(ValueError, match=r"tokens \(2, 1\) and positions \(1, 1\)"):
    transformer.check_inputs(SPEC, toks, positions[:1])


def test_jit_callers_are_not_slowed_by_the_check():
  # Under jit the arrays are tracers: the check is skipped (callers check on the host).
  model, params = model_and_params()
  logits, _, _ = jax.jit(model.forward)(params, jnp.asarray(tokens(4)),
                                        jnp.arange(4, dtype=jnp.int32)[None])
  assert np.isfinite(np.asarray(logits)).all()
