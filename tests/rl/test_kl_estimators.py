"""The in-loss KL term's gradient on a small categorical, against float64 calculus.

The loss averages an estimator over tokens drawn from the policy: its expected gradient is
sum_y pi(y) grad k(log pi(y) - log pi_ref(y)), the sampling weights held fixed. For k2 that
is the gradient of the reverse KL(pi || pi_ref), the KL the loss means; for k3 it is the
gradient of the forward KL(pi_ref || pi).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.rl import objectives


def _expected_gradient(estimator, z, ref_logp):
  def loss(z):
    logp = jax.nn.log_softmax(z)
    weights = jax.lax.stop_gradient(jnp.exp(logp))  # tokens sampled from pi
    return jnp.sum(weights * objectives.kl_to_reference(logp, ref_logp, estimator))
  return np.asarray(jax.grad(loss)(z), np.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k2_gradient_is_the_reverse_kl_gradient_and_k3_the_forward(seed):
  rng = np.random.default_rng(seed)
  z = rng.normal(size=7) * 1.5
  ref = rng.normal(size=7) * 1.5
  p = np.exp(z - np.logaddexp.reduce(z))
  q = np.exp(ref - np.logaddexp.reduce(ref))
  reverse_kl = np.sum(p * np.log(p / q))
  # d/dz KL(p || q) = p * (log p/q - KL(p || q)); d/dz KL(q || p) = p - q.
  want_reverse = p * (np.log(p / q) - reverse_kl)
  want_forward = p - q
  with jax.enable_x64():
    zz = jnp.asarray(z, jnp.float64)
    ref_logp = jnp.asarray(np.log(q), jnp.float64)
    k2 = _expected_gradient("k2", zz, ref_logp)
    k3 = _expected_gradient("k3", zz, ref_logp)
  np.testing.assert_allclose(k2, want_reverse, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(k3, want_forward, rtol=1e-10, atol=1e-12)
  # The two differ: the test can tell them apart.
  assert np.max(np.abs(want_reverse - want_forward)) > 1e-2
