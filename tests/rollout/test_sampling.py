"""The sampler against a float64 numpy reference of temperature, top-k and top-p."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.records import sampling_mask as sampling_mask_lib
from agentic_rl.rollout import sampling

V = 50


def reference_distribution(logits_v, temperature, top_k, top_p):
  """float64 log-probs (-inf outside the support) of a top-k then top-p sampler."""
  scaled = np.asarray(logits_v, np.float64) / temperature
  order = np.argsort(-scaled, kind="stable")
  keep_sorted = np.ones(len(scaled), bool)
  if top_k:
    keep_sorted[top_k:] = False
  sorted_logits = np.where(keep_sorted, scaled[order], -np.inf)
  probs = np.exp(sorted_logits - sorted_logits.max())
  probs /= probs.sum()
  mass_before = np.cumsum(probs) - probs
  if top_p < 1.0:
    keep_sorted &= (mass_before < top_p) | (np.arange(len(scaled)) == 0)
  keep = np.zeros(len(scaled), bool)
  keep[order[keep_sorted]] = True
  kept = scaled[keep]
  logz = kept.max() + np.log(np.exp(kept - kept.max()).sum())
  return np.where(keep, scaled - logz, -np.inf), keep


@jax.jit
def _keys(seeds, positions):
  return sampling.trajectory_keys(seeds, positions)


_sample = jax.jit(sampling.sample, static_argnums=(2,))


def draw(logits_bv, seeds, positions, params, forced=None):
  keys = _keys(jnp.asarray(seeds, jnp.uint32), jnp.asarray(positions, jnp.int32))
  out = _sample(jnp.asarray(logits_bv, jnp.float32), keys, params,
                None if forced is None else jnp.asarray(forced, jnp.int32))
  return jax.device_get(out)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.6), (1.0, 1, 1.0)])
def test_logp_and_mask_match_reference(temperature, top_k, top_p):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(16, V)) * 2.0
  params = sampling.SamplingParams(temperature, top_k, top_p)
  out = draw(logits, np.arange(16), np.full(16, 5), params)
  keep = np.asarray(sampling_mask_lib.unpack_mask(jnp.asarray(out.mask_bw), V))
  for b in range(16):
    ref_logp, ref_keep = reference_distribution(logits[b], temperature, top_k, top_p)
    np.testing.assert_array_equal(keep[b], ref_keep)
    assert ref_keep[out.tokens_b[b]], "drew a token outside the support"
    np.testing.assert_allclose(out.logp_b[b], ref_logp[out.tokens_b[b]], atol=1e-5)


def test_draw_frequencies_follow_the_truncated_distribution():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=V) * 1.5
  params = sampling.SamplingParams(0.8, 12, 0.85)
  n = 6000
  out = draw(np.broadcast_to(logits, (n, V)), np.full(n, 7), np.arange(n), params)
  ref_logp, ref_keep = reference_distribution(logits, 0.8, 12, 0.85)
  freq = np.bincount(out.tokens_b, minlength=V) / n
  assert (freq[~ref_keep] == 0).all()
  # 6000 draws: the standard error of a frequency is at most 0.0065.
  np.testing.assert_allclose(freq, np.exp(ref_logp), atol=0.03)


def test_greedy_is_the_argmax_point_mass():
  logits = np.random.default_rng(2).normal(size=(4, V))
  logits[3, [5, 9]] = logits[3].max() + 1.0  # A tie: argmax takes the lower id.
  out = draw(logits, np.arange(4), np.zeros(4), sampling.SamplingParams(0.0))
  np.testing.assert_array_equal(out.tokens_b, logits.argmax(-1))
  assert out.tokens_b[3] == 5
  np.testing.assert_array_equal(out.logp_b, 0.0)
  keep = np.asarray(sampling_mask_lib.unpack_mask(jnp.asarray(out.mask_bw), V))
  np.testing.assert_array_equal(keep, np.eye(V, dtype=bool)[logits.argmax(-1)])


def test_forced_tokens_record_their_logp_under_the_same_distribution():
  logits = np.random.default_rng(3).normal(size=(3, V))
  params = sampling.SamplingParams(1.0, 5, 1.0)
  order = np.argsort(-logits, axis=-1)
  forced = np.array([order[0, 3], order[1, 30], -1])  # In the top 5; outside; draw.
  out = draw(logits, np.arange(3), np.zeros(3), params, forced)
  assert out.tokens_b[0] == forced[0] and out.tokens_b[1] == forced[1]
  ref0, _ = reference_distribution(logits[0], 1.0, 5, 1.0)
  np.testing.assert_allclose(out.logp_b[0], ref0[forced[0]], atol=1e-5)
  assert out.logp_b[1] == -np.inf
  assert out.tokens_b[2] in order[2, :5]


def test_a_row_draws_the_same_token_whatever_its_batch():
  rng = np.random.default_rng(4)
  logits = rng.normal(size=(5, V))
  params = sampling.SamplingParams(1.0, 0, 0.95)
  seeds, positions = np.array([11, 12, 13, 14, 15]), np.array([3, 9, 4, 4, 100])
  whole = draw(logits, seeds, positions, params)
  perm = np.array([4, 2, 0])
  part = draw(logits[perm], seeds[perm], positions[perm], params)
  np.testing.assert_array_equal(part.tokens_b, whole.tokens_b[perm])
  np.testing.assert_array_equal(part.logp_b, whole.logp_b[perm])


def test_keys_differ_by_seed_and_by_position():
  keys = sampling.trajectory_keys(jnp.asarray([1, 1, 2], jnp.uint32), jnp.asarray([0, 1, 0]))
  data = np.asarray(jax.random.key_data(keys))
  assert len({tuple(r) for r in data}) == 3


def test_bad_sampling_params_are_refused():
  with pytest.raises(ValueError, match="temperature"):
    sampling.SamplingParams(-1.0)
  with pytest.raises(ValueError, match="top_p"):
    sampling.SamplingParams(1.0, 0, 0.0)
  with pytest.raises(ValueError, match="top_k"):
    sampling.SamplingParams(1.0, -2)


def test_full_vocabulary_sampling_builds_no_mask_and_the_replayed_mask_is_the_samplers():
  """top_k=0, top_p=1: the sampler skips the mask (no sort, no top_k, no masking where);
  its recorded support is every token. With or without truncation the mask the learner
  replays is bit for bit the support the sampler drew from, and the learner's log-probs of
  the drawn tokens agree with the sampler's to float32 rounding (two compiled programs)."""
  from agentic_rl.rl import logprobs as logprobs_lib
  logits = jax.random.normal(jax.random.key(0), (6, 40)) * 3
  keys = sampling.trajectory_keys(jnp.arange(6, dtype=jnp.uint32), jnp.arange(6))
  for params in (sampling.SamplingParams(0.7, 0, 1.0), sampling.SamplingParams(0.7, 5, 0.9),
                 sampling.SamplingParams(0.7, 0, 0.8)):
    out = jax.jit(sampling.sample, static_argnums=2)(logits, keys, params)
    jaxpr = str(jax.make_jaxpr(lambda x: sampling.sampling_distribution(x, params))(logits))
    truncated = params.top_k > 0 or params.top_p < 1
    assert (" sort[" in jaxpr or "top_k[" in jaxpr) == truncated
    if not truncated:
      assert np.asarray(out.mask_bw == 255).all()  # 40 ids: five full bytes.
      np.testing.assert_allclose(  # Eager against jitted: float32 rounding apart.
          np.asarray(out.logp_b),
          np.asarray(jnp.take_along_axis(jax.nn.log_softmax(logits / 0.7), out.tokens_b[:, None],
                                         axis=-1)[:, 0]), rtol=0, atol=1e-6)
    # The learner's view: token t drawn from the logits at t - 1, mask target aligned.
    logits_btv = jnp.stack([logits, logits], axis=1)
    tokens_bt = jnp.stack([jnp.zeros(6, jnp.int32), out.tokens_b], axis=1)
    mask_btw = jnp.stack([jnp.zeros_like(out.mask_bw), out.mask_bw], axis=1)
    learner_bt, _ = jax.jit(logprobs_lib.token_logprobs)(
        logits_btv, tokens_bt, jnp.full((6,), 0.7), mask_btw)
    np.testing.assert_allclose(np.asarray(learner_bt[:, 1]), np.asarray(out.logp_b), rtol=0,
                               atol=1e-6)
    _, keep_bv = jax.jit(sampling.sampling_distribution, static_argnums=1)(logits, params)
    np.testing.assert_array_equal(
        np.asarray(sampling_mask_lib.unpack_mask(out.mask_bw, 40)), np.asarray(keep_bv))
