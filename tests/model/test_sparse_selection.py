"""G-layer block selection: the query's own block is always selected, whatever the past
blocks score, and the rest is the top past blocks by score (naive numpy reference).

The own block used to be selected only by scoring +inf in `lax.top_k`, which ranks NaN
above +inf and breaks a tie with a past +inf by the lower index: a past block whose
summary was NaN (a poisoned key) or whose score overflowed pushed the own block out,
and the query then did not attend to itself. A position past the cache's blocks had no
own block at all; the forward now rejects it (and under jit marks its logits NaN).

Naive reference: own block first, then the visible past blocks by descending score
(NaN counts as -inf, ties to the lower index), -1 in the slots left. Scores are the op's
own float32 `block_scores`, so the comparison is exact (the scoring rule itself is
checked against float64 in tests/kernels/test_block_selection.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model.transformer import Model
from agentic_rl.kernels import reference
from tests.model.model_fixtures import draw_params, make_spec

H, K, D, BLOCK = 4, 2, 8, 4
select_blocks = jax.jit(reference.select_blocks, static_argnames=("block_size", "num_selected"))
block_scores = jax.jit(reference.block_scores, static_argnames="block_size")
# Own blocks 0, 0, 1, 3, 5, 7 and padding: fewer visible blocks than n, exactly n, more.
Q_POS = jnp.asarray([[0, 3, 4, 13, 22, 31, -1], [7, 8, 20, 21, 23, 30, 29]], jnp.int32)


def naive_select(scores_bktn, q_pos_bt, block_size, num_selected):
  scores = np.asarray(scores_bktn, np.float64)
  q_pos = np.asarray(q_pos_bt)
  b, k, t, _ = scores.shape
  out = np.full((b, k, t, num_selected), -1, np.int32)
  for bi in range(b):
    for ki in range(k):
      for ti in range(t):
        if q_pos[bi, ti] < 0:
          continue
        own = q_pos[bi, ti] // block_size
        past = [(-(s if not np.isnan(s) else -np.inf), blk)
                for blk, s in enumerate(scores[bi, ki, ti, :own])]
        chosen = [own] + [blk for _, blk in sorted(past)][:num_selected - 1]
        out[bi, ki, ti, :len(chosen)] = chosen
  return out


def inputs(seed, num_blocks=8):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((2, Q_POS.shape[1], H, D)).astype(np.float32)
  block_keys = rng.standard_normal((2, num_blocks, K, D)).astype(np.float32)
  return q, block_keys


@pytest.mark.parametrize("num_selected", [1, 2, 3, 8])
def test_selection_matches_the_naive_reference(num_selected):
  q, bk = inputs(num_selected)
  got = np.asarray(select_blocks(q, bk, Q_POS, block_size=BLOCK, num_selected=num_selected))
  scores = block_scores(q, bk, Q_POS, block_size=BLOCK)
  np.testing.assert_array_equal(got, naive_select(scores, Q_POS, BLOCK, num_selected))


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("num_selected", [1, 2])
def test_own_block_is_selected_whatever_the_past_blocks_score(poison, num_selected):
  """Past blocks 0..5 of batch row 0 get NaN summaries (a poisoned key) or summaries
  whose score overflows to +inf: the own block must still hold the first slot."""
  q, bk = inputs(7)
  if poison == "nan":
    bk[0, :6] = np.nan
  else:  # Aligned with position 31's group mean queries and huge: the dot overflows.
    q_mean = q[0].reshape(q.shape[1], K, H // K, D).mean(2)  # [T, K, D]
    bk[0, :6] = np.sign(q_mean[5])[None] * 3e38
  scores = np.asarray(block_scores(q, bk, Q_POS, block_size=BLOCK))
  if poison == "inf":
    assert np.isposinf(scores[0, :, 5, :6]).all()  # position 31 (own block 7) sees them
  got = np.asarray(select_blocks(q, bk, Q_POS, block_size=BLOCK, num_selected=num_selected))
  own = np.where(np.asarray(Q_POS) >= 0, np.asarray(Q_POS) // BLOCK, -1)
  np.testing.assert_array_equal(got[..., 0], np.broadcast_to(own[:, None], got.shape[:3]))
  np.testing.assert_array_equal(got, naive_select(scores, Q_POS, BLOCK, num_selected))


def test_a_past_capacity_position_under_jit_gives_nan_logits_not_a_silent_answer():
  """Under jit the host check cannot run: a token at or past the cache capacity (not
  stored, no own block) must not come back with plausible logits."""
  spec = make_spec("G", 1)
  model = Model(spec)
  params = draw_params(model, seed=5)
  fwd = jax.jit(model.forward)
  cache = model.init_cache(2, 16)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)
  _, cache, _ = fwd(params, tokens, jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16)),
                    cache)
  logits, cache, aux = fwd(params, tokens[:, :1], jnp.asarray([[16], [15]], jnp.int32),
                           dict(cache, lengths=jnp.asarray([16, 15], jnp.int32)))
  logits = np.asarray(logits)
  assert np.isnan(logits[0]).all(), "position 16 of a 16-position cache must be flagged"
  assert np.isfinite(logits[1]).all()  # position 15, the last slot, is fine
  np.testing.assert_array_equal(np.asarray(aux["layers"][0]["blocks"])[1, :, 0, 0], 3)
