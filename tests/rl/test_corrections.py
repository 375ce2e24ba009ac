"""TIS, MIS and IcePop on constructed ratios, against the formulas of their papers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.rl import config as rl_config_lib
from agentic_rl.rl import corrections
from agentic_rl.rl import objectives

RATIOS = np.array([0.1, 0.5, 1.0, 1.9, 2.0, 2.5, 4.9, 5.5])


def _spec(kind, **changes):
  c = rl_config_lib.default_rl_config()
  c.correction.type = kind
  for k, v in changes.items():
    c.correction[k] = v
  return rl_config_lib.validate(c)


def _weights(kind, ratios=RATIOS, mask=None, **changes):
  ratios = np.atleast_2d(ratios)
  mask = np.ones(ratios.shape) if mask is None else np.atleast_2d(mask)
  sampler = np.log(np.full(ratios.shape, 0.3))
  learner = sampler + np.log(ratios)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  w, stats = corrections.correction_weights(_spec(kind, **changes), f32(learner), f32(sampler),
                                            f32(mask))
  return np.asarray(w), {k: float(v) for k, v in stats.items()}


def test_tis_is_min_ratio_cap():
  # Yao et al.: weight each token by min(pi_learner / pi_sampler, C), C = 2.
  w, stats = _weights("tis")
  np.testing.assert_allclose(w[0], np.minimum(RATIOS, 2.0), rtol=1e-5)
  assert stats["corr_rejected_count"] == 3  # 2.5, 4.9, 5.5 truncated


def test_mis_token_keeps_ratio_inside_bounds_and_drops_outside():
  # Liu, Li et al.: rho_t * 1[lo <= rho_t <= hi]; bounds [0.5, 2].
  w, stats = _weights("mis_token")
  np.testing.assert_allclose(w[0], [0, 0.5, 1.0, 1.9, 2.0, 0, 0, 0], rtol=1e-5, atol=1e-7)
  assert stats["corr_rejected_count"] == 4


def test_icepop_masks_outside_alpha_beta():
  # Ring-1T: M(k) = k if alpha <= k <= beta else 0, with [alpha, beta] = [0.5, 5].
  w, stats = _weights("icepop")
  np.testing.assert_allclose(w[0], [0, 0.5, 1.0, 1.9, 2.0, 2.5, 4.9, 0], rtol=1e-5, atol=1e-7)
  assert stats["corr_rejected_count"] == 2
  w, _ = _weights("icepop", icepop_low=0.9, icepop_high=2.0)
  np.testing.assert_allclose(w[0], [0, 0, 1.0, 1.9, 2.0, 0, 0, 0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("how", ["product", "geometric_mean"])
def test_mis_sequence_product_and_geometric_mean(how):
  ratios = np.array([[1.0, 1.2, 1.5, 1.0],    # product 1.8, geo 1.8^(1/3) (3 tokens)
                     [1.0, 0.9, 0.8, 0.5],    # product 0.36, geo 0.36^(1/3)
                     [1.0, 3.0, 1.0, 1.0]])   # product 3 (2 tokens), geo sqrt(3)
  mask = np.array([[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 0, 1]], np.float64)
  w, stats = _weights("mis_sequence", ratios=ratios, mask=mask, mis_sequence_ratio=how,
                      mis_low=0.5, mis_high=1.5)
  n = mask.sum(1)
  prod = np.array([1.8, 0.36, 3.0])
  rho = prod if how == "product" else prod ** (1 / n)
  keep = (rho >= 0.5) & (rho <= 1.5)
  np.testing.assert_allclose(w, np.where(keep, rho, 0)[:, None] * mask, rtol=1e-5, atol=1e-7)
  if how == "product":
    assert keep.tolist() == [False, False, False]
  else:  # 1.216, 0.711, 1.732
    assert keep.tolist() == [True, True, False]
  assert stats["corr_rejected_sequences"] == (~keep).sum()
  assert stats["corr_rejected_count"] == ((~keep)[:, None] * mask).sum()


def test_weights_are_zero_off_mask_and_constant_under_gradient():
  mask = np.array([0, 1, 1, 1, 0, 1, 1, 1], np.float64)
  w, _ = _weights("tis", mask=mask)
  assert (w[0][mask == 0] == 0).all()
  # The weight is a constant factor: grad of w * l equals w * grad of l.
  spec = _spec("tis")
  sampler = jnp.log(jnp.full((1, 8), 0.3))
  adv = jnp.ones((1, 8))
  m = jnp.asarray(mask, jnp.float32)[None]

  def loss(logp):
    w, _ = corrections.correction_weights(spec, logp, sampler, m)
    pg, _ = objectives.ppo_clip_loss(logp, jax.lax.stop_gradient(logp), adv, 0.2, 0.28)
    return jnp.sum(w * pg * m)

  logp = sampler + jnp.log(jnp.asarray(RATIOS, jnp.float32))[None]
  g = np.asarray(jax.grad(loss)(logp))
  # Unweighted: d/dlogp of -exp(logp - sg(logp)) A = -A = -1 per token.
  np.testing.assert_allclose(g[0], -np.minimum(RATIOS, 2.0) * mask, rtol=1e-5)
