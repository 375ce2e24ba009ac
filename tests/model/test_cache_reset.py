"""Non-finite values in a cache row never reach a sequence that cannot see them.

A sequence that went non-finite (an overflow, a bad token) leaves NaN in its cache row.
`reset_sequences` used to clear only the ring positions and the length, so the next
sequence in that row read the old NaN keys and values wherever attention masked them:
masked weights were 0, and 0 * NaN = NaN. Masking is now by select, and reset clears
every buffer of the row.

Each check runs one new sequence (a 13-token prefill, then 7 decode steps, crossing
blocks and wrapping the ring) in a poisoned row and in a fresh cache, and asks for the
same logits: identical arithmetic, so atol 1e-6 (logits rms ~6). Models: "SGF" and
single-layer "S", "G", "F" (W=8, B=4, 2 selected blocks, capacity 32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model import cache as cache_lib
from agentic_rl.model.transformer import Model
from tests.model.model_fixtures import draw_params, make_spec

ATOL = 1e-6
CAPACITY, PROMPT, TOTAL = 32, 13, 20
SPECS = {
    "SGF": make_spec("SGF", 3, num_dense_layers=1),
    "S": make_spec("S", 1),
    "G": make_spec("G", 1),
    "F": make_spec("F", 1),
}


@functools.lru_cache(maxsize=None)
def harness(name):
  model = Model(SPECS[name])
  return model, draw_params(model, seed=11), jax.jit(model.forward)


def run_sequence(name, cache, row, tokens):
  """Prefills PROMPT tokens into `row` then decodes to TOTAL; the other row sits out.
  Returns the logits [TOTAL, V] of `row`."""
  _, params, fwd = harness(name)
  batch = cache["lengths"].shape[0]
  pos = np.full((batch, PROMPT), -1, np.int32)
  pos[row] = np.arange(PROMPT)
  toks = np.zeros((batch, PROMPT), np.int32)
  toks[row] = tokens[:PROMPT]
  logits, cache, _ = fwd(params, jnp.asarray(toks), jnp.asarray(pos), cache)
  out = [np.asarray(logits)[row]]
  for p in range(PROMPT, TOTAL):
    pos1 = np.full((batch, 1), -1, np.int32)
    pos1[row] = p
    toks1 = np.zeros((batch, 1), np.int32)
    toks1[row] = tokens[p]
    logits, cache, _ = fwd(params, jnp.asarray(toks1), jnp.asarray(pos1), cache)
    out.append(np.asarray(logits)[row])
  return np.concatenate(out)


def poisoned(cache, row):
  """Every float buffer of `row` NaN (keys, values, block summaries); positions kept."""
  def poison(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return x.at[row].set(jnp.nan)
  return {"lengths": cache["lengths"], "layers": jax.tree.map(poison, cache["layers"])}


def new_tokens(seed):
  return np.random.default_rng(seed).integers(0, 64, TOTAL).astype(np.int32)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_nan_left_in_a_row_does_not_survive_its_reset(name):
  model, _, _ = harness(name)
  old = model.init_cache(2, CAPACITY)
  # An old sequence of 27 tokens in row 0, then its whole row goes NaN.
  _, params, fwd = harness(name)
  toks = jnp.asarray(np.stack([np.random.default_rng(1).integers(0, 64, 27),
                               np.zeros(27)]).astype(np.int32))
  pos = jnp.asarray(np.stack([np.arange(27), np.full(27, -1)]).astype(np.int32))
  _, old, _ = fwd(params, toks, pos, old)
  old = poisoned(old, 0)
  reset = cache_lib.reset_sequences(old, jnp.asarray([True, False]))
  np.testing.assert_array_equal(reset["lengths"], [0, 0])
  # Nothing the masks rely on survives: rings empty, buffers finite.
  for layer in reset["layers"]:
    for key, x in layer.items():
      x = np.asarray(x)[0]
      assert np.isfinite(x).all() if key != "pos" else (x == -1).all(), key

  tokens = new_tokens(2)
  got = run_sequence(name, reset, 0, tokens)
  want = run_sequence(name, model.init_cache(2, CAPACITY), 0, tokens)
  assert np.isfinite(want).all()
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_masked_nan_in_stale_slots_does_not_leak_without_a_reset(name):
  """Select-masking on its own: an empty row (length 0, ring positions -1) whose buffers
  hold NaN gives the same logits as a fresh one; every NaN sits in a masked slot
  (a ring slot marked empty, a position not yet written, a block not yet reached)."""
  model, _, _ = harness(name)
  tokens = new_tokens(3)
  got = run_sequence(name, poisoned(model.init_cache(2, CAPACITY), 1), 1, tokens)
  want = run_sequence(name, model.init_cache(2, CAPACITY), 1, tokens)
  np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
