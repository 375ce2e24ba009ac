"""bfloat16 compute: the unembedding accumulates in float32, and the sampler (cached
decode) and the learner (uncached forward) agree on log-probs.

The read-out used to run in bf16 and be cast to float32 afterwards, so every logit
carried a bf16 rounding of up to 2^-9 of its size (0.03 at |logit| = 16): a noise the
two paths drew independently whenever their hidden states differed by one bf16 ulp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model.transformer import Model
from tests.model.model_fixtures import draw_params, make_spec

T, PROMPT = 24, 9


@functools.lru_cache(maxsize=None)
def harness(tie: bool, cache_dtype: str = "bfloat16"):
  spec = make_spec("SGF", 3, num_dense_layers=1, dtype="bfloat16", cache_dtype=cache_dtype,
                   tie_embeddings=tie)
  model = Model(spec)
  return model, draw_params(model, seed=8)


def tokens():
  return np.random.default_rng(4).integers(0, 64, (2, T)).astype(np.int32)


@pytest.mark.parametrize("tie", [True, False])
def test_bf16_logits_are_the_float32_sum_of_bf16_products(tie):
  """Logits vs float64 from the same bf16 hidden state and bf16 read-out weights: a
  float32 sum of 32 exact bf16 products is within ~1e-5 of it; a bf16 result is not
  (its rounding alone is up to 0.004 at |logit| >= 2, 0.03 at 16)."""
  model, params = harness(tie)
  toks, pos = tokens(), np.broadcast_to(np.arange(T, dtype=np.int32), (2, T))
  (logits, _, _), state = model.module.apply(
      {"params": params}, toks, pos, capture_intermediates=True, mutable=["intermediates"])
  h_btd = state["intermediates"]["final_norm"]["__call__"][0]
  assert h_btd.dtype == jnp.bfloat16
  if tie:
    w_dv = params["embed"]["embedding"].T
  else:
    w_dv = params["unembed"]["kernel"]
  w_dv = np.asarray(jnp.asarray(w_dv).astype(jnp.bfloat16), np.float64)
  want = np.asarray(h_btd, np.float64) @ w_dv
  # Large enough that a bf16 rounding (half an ulp: >= 2^-8 at |logit| >= 2) would show.
  assert np.abs(want).max() > 2
  np.testing.assert_allclose(np.asarray(logits), want, atol=2e-4, rtol=0)


def test_bf16_sampler_and_learner_log_probs_agree():
  """Prefill of 9 tokens then token-by-token decode through a bf16 cache (the sampler)
  vs one uncached forward (the learner) on the same tokens, model.dtype bfloat16.

  Both paths run the same bf16 arithmetic except the float32 reduction order over
  differently shaped key buffers, so most tokens agree exactly. Where that order flips
  a bf16 hidden value by one ulp (2^-8 relative, ~0.004 on a unit value), a logit moves
  by ~0.004 per flipped coordinate (read-out rows of unit scale), and the log-prob by at
  most about twice that per flip; a few flips stay below 0.03 nats. The mean over the
  46 tokens stays below 0.002 (measured: max 0.008, mean 2e-4).
  """
  model, params = harness(True)
  toks = tokens()
  pos = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T))
  fwd = jax.jit(model.forward)
  learner, _, _ = fwd(params, jnp.asarray(toks), jnp.asarray(pos))
  cache = model.init_cache(2, 32)
  sampler = []
  logits, cache, _ = fwd(params, jnp.asarray(toks[:, :PROMPT]), jnp.asarray(pos[:, :PROMPT]),
                         cache)
  sampler.append(logits)
  for p in range(PROMPT, T):
    logits, cache, _ = fwd(params, jnp.asarray(toks[:, p:p + 1]), jnp.asarray(pos[:, p:p + 1]),
                           cache)
    sampler.append(logits)
  sampler = jnp.concatenate(sampler, axis=1)

  def token_logp(logits_btv):
    logp = jax.nn.log_softmax(logits_btv[:, :-1], axis=-1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(toks)[:, 1:, None], -1)[..., 0])

  diff = np.abs(token_logp(sampler) - token_logp(learner))
  assert diff.max() < 0.03 and diff.mean() < 0.002, (diff.max(), diff.mean())


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_readout_of_the_hidden_forward_is_the_forward_s_logits(tie, dtype):
  """The engine reads out only the drawing positions (`Model.readout` of a hidden=True
  forward): bit-for-bit the logits the full forward gives there, NaN where it gives NaN."""
  spec = make_spec("SGF", 3, num_dense_layers=1, dtype=dtype, tie_embeddings=tie)
  model = Model(spec)
  params = draw_params(model, seed=8)
  toks = tokens()
  pos = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T)).copy()
  pos[1, -1] = spec.max_seq_len  # Out of range: NaN logits, and NaN hidden state.
  logits_btv, _, _ = jax.jit(model.forward)(params, toks, pos)
  h_btd, _, _ = jax.jit(functools.partial(model.forward, hidden=True))(params, toks, pos)
  got = jax.jit(model.readout)(params, h_btd[:, -3:])
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(logits_btv[:, -3:]))
  assert np.isnan(np.asarray(got[1, -1])).all() and np.isfinite(np.asarray(got[0])).all()
