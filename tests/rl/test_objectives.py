"""Objectives, aggregation, KL, value loss and token log-probs against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.rl import logprobs
from agentic_rl.rl import objectives as obj
from agentic_rl.records import sampling_mask as sm


def test_ppo_clip_hand_example():
  # Asymmetric bounds [0.8, 1.28].
  ratio = np.array([1.5, 1.5, 0.5, 0.5, 1.1, 1.0])
  adv = np.array([1.0, -1.0, 1.0, -1.0, 2.0, -3.0])
  logp = jnp.log(jnp.asarray(ratio, jnp.float32))[None]
  loss, clipped = obj.ppo_clip_loss(logp, jnp.zeros_like(logp), jnp.asarray(adv, jnp.float32)[None],
                                    0.2, 0.28)
  # -min(rA, clip(r)A): 1.5*1 -> clip 1.28; 1.5*-1 unclipped; 0.5*1 unclipped;
  # 0.5*-1 -> clip 0.8; inside the bounds nothing clips.
  np.testing.assert_allclose(np.asarray(loss)[0], [-1.28, 1.5, -0.5, 0.8, -2.2, 3.0], rtol=1e-6)
  assert np.asarray(clipped)[0].tolist() == [True, False, False, True, False, False]


def test_ppo_clip_gradient_is_zero_on_clipped_tokens():
  ratio = jnp.asarray([[1.5, 1.5, 0.5, 0.5, 1.1]], jnp.float32)
  adv = jnp.asarray([[1.0, -1.0, 1.0, -1.0, 2.0]], jnp.float32)
  grad = jax.grad(lambda lp: obj.ppo_clip_loss(lp, jnp.zeros_like(lp), adv, 0.2, 0.28)[0].sum())(
      jnp.log(ratio))
  # d/dlogp of -r A is -r A where unclipped, 0 where the clipped branch is active.
  np.testing.assert_allclose(np.asarray(grad)[0], [0.0, 1.5, -0.5, 0.0, -2.2], rtol=1e-6)


def test_gspo_value_and_gradient_hand_example():
  # Two sequences; the sequence ratio is the geometric mean of token ratios.
  logp = jnp.asarray([[0.0, 0.1, 0.3, 0.2], [0.0, -0.2, 0.0, 0.0]], jnp.float32)
  old = jnp.zeros_like(logp)
  mask = jnp.asarray([[0, 1, 1, 1], [0, 1, 1, 0]], jnp.float32)
  adv = jnp.asarray([[0, 1, 1, 1], [0, 1, 1, 0]], jnp.float32) * jnp.asarray([[1.0], [-2.0]])
  s1, s2 = np.exp(0.6 / 3), np.exp(-0.2 / 2)  # 1.2214, 0.9048
  loss, clipped = obj.gspo_loss(logp, old, adv, mask, 0.2, 0.28)
  # Seq 1: s = 1.2214 inside [0.8, 1.28] -> -s A = -1.2214 per token.
  # Seq 2: s = 0.9048, A = -2 -> -min(-1.8097, -2 clip(s)) = 1.8097.
  np.testing.assert_allclose(np.asarray(loss * mask), [[0, -s1, -s1, -s1], [0, 2 * s2, 2 * s2, 0]],
                             rtol=1e-5)
  assert not np.asarray(clipped * mask).any()
  # Under 'sequence' aggregation the gradient is GSPO's: -A s_i / |y_i| per token.
  norms = obj.loss_normalizers(mask)
  grad = jax.grad(lambda lp: obj.aggregate(obj.gspo_loss(lp, old, adv, mask, 0.2, 0.28)[0], mask,
                                           "sequence", norms))(logp)
  want = np.array([[0, -s1 / 3, -s1 / 3, -s1 / 3], [0, 2 * s2 / 2, 2 * s2 / 2, 0]]) / 2
  np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5)


def test_gspo_clips_whole_sequences():
  logp = jnp.asarray([[0.0, 0.5, 0.5]], jnp.float32)  # s = e^0.5 = 1.65 > 1 + 4e-4
  mask = jnp.asarray([[0, 1, 1]], jnp.float32)
  adv = mask * 1.0
  loss, clipped = obj.gspo_loss(logp, jnp.zeros_like(logp), adv, mask, 3e-4, 4e-4)
  np.testing.assert_allclose(np.asarray(loss)[0, 1:], [-(1 + 4e-4)] * 2, rtol=1e-6)
  assert np.asarray(clipped)[0, 1:].all()


def test_aggregation_hand_example_and_micro_batch_additivity():
  loss = jnp.asarray([[9, 1, 2, 3], [9, 4, 0, 0], [9, 0, 0, 0]], jnp.float32)
  mask = jnp.asarray([[0, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]], jnp.float32)
  norms = obj.loss_normalizers(mask)
  assert float(obj.aggregate(loss, mask, "token", norms)) == pytest.approx((1 + 2 + 3 + 4) / 4)
  # Per-sequence means (2 and 4) over the two sequences that have tokens.
  assert float(obj.aggregate(loss, mask, "sequence", norms)) == pytest.approx(3.0)
  # Dr. GRPO: sum / (num_sequences * T) and / (num_sequences * L) with a given L.
  assert float(obj.aggregate(loss, mask, "constant", norms)) == pytest.approx(10 / (3 * 4))
  norms_l = obj.loss_normalizers(mask, constant_normalizer=10)
  assert float(obj.aggregate(loss, mask, "constant", norms_l)) == pytest.approx(10 / 30)
  for mode in ("token", "sequence", "constant"):
    whole = obj.aggregate(loss, mask, mode, norms)
    parts = obj.aggregate(loss[:2], mask[:2], mode, norms) + obj.aggregate(loss[2:], mask[2:],
                                                                           mode, norms)
    assert float(parts) == pytest.approx(float(whole))


def test_kl_estimators_hand_example():
  logp = jnp.log(jnp.asarray([0.5, 0.2]))
  ref = jnp.log(jnp.asarray([0.25, 0.4]))
  lr = np.log([2.0, 0.5])  # log pi / pi_ref
  np.testing.assert_allclose(obj.kl_to_reference(logp, ref, "k1"), lr, rtol=1e-6)
  np.testing.assert_allclose(obj.kl_to_reference(logp, ref, "k2"), 0.5 * lr ** 2, rtol=1e-6)
  # k3 = pi_ref/pi - 1 - log(pi_ref/pi): 0.5 - 1 + log 2, 2 - 1 - log 2.
  np.testing.assert_allclose(obj.kl_to_reference(logp, ref, "k3"),
                             [0.5 - 1 + np.log(2), 1 - np.log(2)], rtol=1e-6)
  with pytest.raises(ValueError, match="kl_estimator"):
    obj.kl_to_reference(logp, ref, "k5")


def test_value_loss_hand_example():
  v = jnp.asarray([1.0, 0.0, 2.4])
  g = jnp.asarray([0.0, 0.5, 2.5])
  np.testing.assert_allclose(obj.value_loss(v, g), [0.5, 0.125, 0.005], rtol=1e-5)
  old = jnp.asarray([0.5, 0.0, 2.0])
  # Clip 0.2: V_clip = old + clip(V - old) = [0.7, 0.0, 2.2]; squared errors clipped
  # [0.245, 0.125, 0.045]; the loss is the larger of the two.
  np.testing.assert_allclose(obj.value_loss(v, g, old, 0.2), [0.5, 0.125, 0.045], rtol=1e-5)


def _np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_token_logprobs_temperature_mask_and_entropy():
  rng = np.random.default_rng(0)
  b, t, v = 2, 5, 11
  logits = rng.normal(size=(b, t, v)).astype(np.float32) * 3
  tokens = rng.integers(0, v, (b, t))
  temp = np.array([0.7, 1.3], np.float32)
  keep = rng.random((b, t, v)) < 0.5
  keep[np.arange(b)[:, None], np.arange(t)[None], tokens] = True  # drawn tokens are kept
  keep[0, 3] = False  # an all-zero row means "no mask recorded"
  packed = sm.pack_mask(jnp.asarray(keep))
  logp, ent = logprobs.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens, jnp.int32),
                                      jnp.asarray(temp), packed)
  want_logp = np.zeros((b, t))
  want_ent = np.zeros((b, t))
  for i in range(b):
    for j in range(1, t):
      z = logits[i, j - 1].astype(np.float64) / temp[i]
      row = keep[i, j] if keep[i, j].any() else np.ones(v, bool)
      lp = _np_log_softmax(np.where(row, z, -np.inf))
      want_logp[i, j] = lp[tokens[i, j]]
      p = np.exp(lp)
      want_ent[i, j] = -np.sum(p[row] * lp[row])
  np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=1e-5)
  assert np.isfinite(np.asarray(ent)).all()


def test_token_logprobs_gradient_is_finite_under_a_sampling_mask():
  # A top-k / top-p sampler's mask puts -inf logits in every row; the loss's gradient must
  # stay finite (it was NaN through the entropy term, even at entropy_coef 0), and match
  # float64 finite differences of the masked log-softmax.
  rng = np.random.default_rng(1)
  b, t, v = 2, 4, 9
  logits = rng.normal(size=(b, t, v)).astype(np.float32)
  tokens = rng.integers(0, v, (b, t))
  keep = rng.random((b, t, v)) < 0.4
  keep[np.arange(b)[:, None], np.arange(t)[None], tokens] = True
  packed = sm.pack_mask(jnp.asarray(keep))

  def loss(x, entropy_coef):
    logp, ent = logprobs.token_logprobs(x, jnp.asarray(tokens, jnp.int32), jnp.ones(b),
                                        packed)
    return logp.sum() + entropy_coef * ent.sum()

  for coef in (0.0, 0.1):
    grad = np.asarray(jax.grad(loss)(jnp.asarray(logits), coef))
    assert np.isfinite(grad).all(), coef
  # Against float64 math for the log-prob part: d/dz of sum_j logp(token_j).
  grad = np.asarray(jax.grad(loss)(jnp.asarray(logits), 0.0))
  want = np.zeros((b, t, v))
  for i in range(b):
    for j in range(1, t):
      row = keep[i, j]
      p = np.exp(_np_log_softmax(np.where(row, logits[i, j - 1].astype(np.float64), -np.inf)))
      want[i, j - 1] = np.where(row, np.eye(v)[tokens[i, j]] - p, 0.0)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


def test_shift_to_targets():
  x = jnp.asarray([[1.0, 2.0, 3.0]])
  np.testing.assert_array_equal(logprobs.shift_to_targets(x), [[0.0, 1.0, 2.0]])
