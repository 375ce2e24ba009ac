"""The chunked read-out (rl/chunked_logprobs.py) against float64 math and the full-logits
path (`logprobs.token_logprobs` and its autodiff), and its memory against the full logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model import config as model_config_lib
from agentic_rl.model import transformer
from agentic_rl.records import sampling_mask as sm
from agentic_rl.rl import chunked_logprobs
from agentic_rl.rl import logprobs
from tests.rl import tiny_model


def _case(seed=0, b=3, t=6, d=12, v=45):
  rng = np.random.default_rng(seed)
  h = rng.normal(size=(b, t, d)).astype(np.float32)
  w = (rng.normal(size=(v, d)) * 0.6).astype(np.float32)
  targets = rng.integers(0, v, (b, t)).astype(np.int32)
  temp = rng.uniform(0.6, 1.4, b).astype(np.float32)
  keep = rng.random((b, t, v)) < 0.3
  keep[np.arange(b)[:, None], np.arange(t)[None], targets] = True  # drawn tokens are kept
  keep[0, 2] = False  # an all-zero row: no mask recorded
  return h, w, targets, temp, keep


def _float64(h, w, targets, temp, keep):
  """(logp, entropy, argmax) per position, in float64 numpy."""
  z = np.einsum("btd,vd->btv", h.astype(np.float64), w.astype(np.float64))
  z /= temp.astype(np.float64)[:, None, None]
  if keep is not None:
    row = keep | ~keep.any(-1, keepdims=True)
    z = np.where(row, z, -np.inf)
  m = z.max(-1, keepdims=True)
  logp = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
  p = np.exp(logp)
  entropy = -np.sum(p * np.where(p > 0, logp, 0.0), -1)
  target = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  return target, entropy, z.argmax(-1)


@pytest.mark.parametrize("chunk", [8, 16, 40, 64])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_float64_on_vocabularies_off_the_chunk(chunk, masked):
  h, w, targets, temp, keep = _case()
  packed = sm.pack_mask(jnp.asarray(keep)) if masked else None
  logp, ent, hit = chunked_logprobs.token_stats(jnp.asarray(h), jnp.asarray(w),
                                                jnp.asarray(targets), jnp.asarray(temp),
                                                packed, chunk=chunk)
  want_logp, want_ent, want_arg = _float64(h, w, targets, temp, keep if masked else None)
  np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(hit), (want_arg == targets).astype(np.float32))


def test_hit_takes_the_first_argmax_across_chunks():
  # Rows 3 and 11 of the read-out are equal: tied logits in two chunks of 8. The first wins,
  # as argmax's does.
  h, w, _, temp, _ = _case(seed=1, v=20)
  h = np.abs(h)
  w[11] = w[3] = 5.0  # Far above every other row's logit, at every position.
  targets = np.full(h.shape[:2], 11, np.int32)
  targets[0, 0] = 3
  _, _, hit = chunked_logprobs.token_stats(jnp.asarray(h), jnp.asarray(w), jnp.asarray(targets),
                                           jnp.asarray(temp), chunk=8)
  z = np.einsum("btd,vd->btv", h, w)
  np.testing.assert_array_equal(np.asarray(hit), (z.argmax(-1) == targets).astype(np.float32))
  assert np.asarray(hit)[0, 0] == 1.0  # 3, not the tied 11.


@pytest.mark.parametrize("masked", [False, True])
def test_gradient_matches_autodiff_of_the_full_logits(masked):
  h, w, targets, temp, keep = _case(seed=2)
  packed = sm.pack_mask(jnp.asarray(keep)) if masked else None
  rng = np.random.default_rng(3)
  g_logp = jnp.asarray(rng.normal(size=targets.shape), jnp.float32)
  g_ent = jnp.asarray(rng.normal(size=targets.shape), jnp.float32)

  def chunked(h, w):
    logp, ent, _ = chunked_logprobs.token_stats(h, w, jnp.asarray(targets), jnp.asarray(temp),
                                                packed, chunk=16)
    return jnp.sum(g_logp * logp + g_ent * ent)

  def full(h, w):
    # token_logprobs scores token t from logits t - 1: put a dummy step in front.
    logits = jnp.einsum("btd,vd->btv", h, w)
    logits = jnp.concatenate([logits, logits[:, :1]], axis=1)
    tokens = jnp.concatenate([jnp.asarray(targets[:, :1]), jnp.asarray(targets)], axis=1)
    mask = None if packed is None else jnp.concatenate([packed[:, :1], packed], axis=1)
    logp, ent = logprobs.token_logprobs(logits, tokens, jnp.asarray(temp), mask)
    return jnp.sum(g_logp * logp[:, 1:] + g_ent * ent[:, 1:])

  got = jax.grad(chunked, (0, 1))(jnp.asarray(h), jnp.asarray(w))
  want = jax.grad(full, (0, 1))(jnp.asarray(h), jnp.asarray(w))
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_without_entropy_grad_the_logp_gradient_stays_and_the_entropy_work_goes():
  """entropy_grad=False: the log-prob gradient equals the full-logits autodiff, the entropy
  sends none (as with stop_gradient), and the compiled backward does fewer FLOPs."""
  h, w, targets, temp, _ = _case(seed=6)
  args = (jnp.asarray(h), jnp.asarray(w))
  g_logp = jnp.asarray(np.random.default_rng(7).normal(size=targets.shape), jnp.float32)

  def chunked(entropy_grad, entropy_weight):
    def loss(h, w):
      logp, ent, _ = chunked_logprobs.token_stats(h, w, jnp.asarray(targets), jnp.asarray(temp),
                                                  chunk=16, entropy_grad=entropy_grad)
      return jnp.sum(g_logp * logp) + entropy_weight * jnp.sum(ent)
    return loss

  def full(h, w):
    logits = jnp.einsum("btd,vd->btv", h, w)
    logits = jnp.concatenate([logits, logits[:, :1]], axis=1)
    tokens = jnp.concatenate([jnp.asarray(targets[:, :1]), jnp.asarray(targets)], axis=1)
    logp, _ = logprobs.token_logprobs(logits, tokens, jnp.asarray(temp))
    return jnp.sum(g_logp * logp[:, 1:])

  want = jax.grad(full, (0, 1))(*args)
  for weight in (0.0, 0.7):  # The entropy term, if any, sends nothing.
    got = jax.grad(chunked(False, weight), (0, 1))(*args)
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  flops = {flag: jax.jit(jax.grad(chunked(flag, 0.0), (0, 1))).lower(*args).compile()
           .cost_analysis()["flops"] for flag in (True, False)}
  assert flops[False] < flops[True], flops


def test_a_nan_position_sends_no_gradient():
  # A bad id or position makes the model's hidden state NaN there (by contract); the loss
  # masks it out, and the read-out's gradient stays finite, as the full-logits path's does.
  h, w, targets, temp, _ = _case(seed=4)
  h[1, 3] = np.nan
  on = np.ones(targets.shape, bool)
  on[1, 3] = False

  def loss(h, w):
    logp, ent, _ = chunked_logprobs.token_stats(h, w, jnp.asarray(targets), jnp.asarray(temp),
                                                chunk=8)
    return jnp.sum(jnp.where(on, logp + 0.1 * ent, 0.0))

  logp, _, _ = chunked_logprobs.token_stats(jnp.asarray(h), jnp.asarray(w), jnp.asarray(targets),
                                            jnp.asarray(temp), chunk=8)
  assert np.isnan(np.asarray(logp)[1, 3]) and np.isfinite(np.asarray(logp)[on]).all()
  dh, dw = jax.grad(loss, (0, 1))(jnp.asarray(h), jnp.asarray(w))
  assert np.isfinite(np.asarray(dw)).all()
  assert np.isfinite(np.asarray(dh)[on]).all()


def _temp_bytes(fn, *args) -> int:
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_the_backward_never_holds_the_full_logits():
  b, t, d, v = 2, 256, 16, 8192
  btv_bytes = b * t * v * 4
  h = jnp.ones((b, t, d), jnp.float32)
  w = jnp.ones((v, d), jnp.float32)
  targets = jnp.zeros((b, t), jnp.int32)
  temp = jnp.ones((b,), jnp.float32)
  packed = jnp.zeros((b, t, v // 8), jnp.uint8)

  def chunked(h, w):
    logp, ent, _ = chunked_logprobs.token_stats(h, w, targets, temp, packed, chunk=256)
    return jnp.sum(logp) + 0.1 * jnp.sum(ent)

  def full(h, w):
    logits = jnp.einsum("btd,vd->btv", h, w)
    logp, ent = logprobs.token_logprobs(logits, targets, temp, packed)
    return jnp.sum(logp) + 0.1 * jnp.sum(ent)

  chunked_bytes = _temp_bytes(jax.value_and_grad(chunked, (0, 1)), h, w)
  full_bytes = _temp_bytes(jax.value_and_grad(full, (0, 1)), h, w)
  assert full_bytes > btv_bytes  # The check can fail: the full path holds [B, T, V] fp32.
  assert chunked_bytes < btv_bytes / 4, (chunked_bytes, btv_bytes)


def _tiny(readout_chunk, **changes):
  config = tiny_model.model_config(readout_chunk=readout_chunk, vocab_size=60, **changes)
  return transformer.Model(model_config_lib.validate(config))


@pytest.mark.parametrize("tie", [True, False])
def test_scored_forward_chunked_equals_full_logits(tie):
  full_model, chunked_model = _tiny(0, tie_embeddings=tie), _tiny(16, tie_embeddings=tie)
  params = full_model.init(jax.random.key(0))
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(0, 60, (2, 12)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
  temp = jnp.asarray([1.0, 0.8], jnp.float32)
  keep = rng.random((2, 12, 60)) < 0.5
  keep[np.arange(2)[:, None], np.arange(12)[None], np.asarray(tokens)] = True
  packed = sm.pack_mask(jnp.asarray(keep))

  def scores(model, params):
    logp, ent, hit, _ = logprobs.scored_forward(model, params, tokens, positions, temp, packed)
    return logp, ent, hit

  got, want = scores(chunked_model, params), scores(full_model, params)
  for a, b in zip(got[:2], want[:2]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  # Argmax hits agree but where the top two logits tie to rounding (fresh params: near-flat).
  logits = np.asarray(full_model.forward(params, tokens, positions)[0])[:, :-1]
  top2 = np.sort(logits, axis=-1)[..., -2:]
  near_tie = np.pad(top2[..., 1] - top2[..., 0] < 1e-5, ((0, 0), (1, 0)))
  differ = np.asarray(got[2]) != np.asarray(want[2])
  assert not (differ & ~near_tie).any()
  loss = lambda m: (lambda p: jnp.sum(scores(m, p)[0]) + 0.1 * jnp.sum(scores(m, p)[1]))
  got_g, want_g = jax.grad(loss(chunked_model))(params), jax.grad(loss(full_model))(params)
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_bad_chunk_names_the_field():
  with pytest.raises(ValueError, match="readout_chunk"):
    model_config_lib.validate(tiny_model.model_config(readout_chunk=12))
  with pytest.raises(ValueError, match="multiple of 8"):
    chunked_logprobs.check_chunk(12)
