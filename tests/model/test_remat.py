"""config.model.remat recomputes layers in the backward without changing what it computes:
values and gradients equal the model without remat, for every policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.config_schema import ConfigError
from agentic_rl.model.config import ModelSpec, MoESpec
from agentic_rl.model.transformer import Model

SPEC = ModelSpec(vocab_size=64, d_model=32, num_layers=4, layer_pattern="SSSG", num_heads=4,
                 num_kv_heads=2, head_dim=8, num_dense_layers=1, d_ff=48, sliding_window=8,
                 block_size=4, topk_tokens=8, max_seq_len=64,
                 moe=MoESpec(num_experts=4, num_experts_per_token=2, d_ff_expert=16))


def _value_and_grad(spec, params, tokens, positions):
  def loss(p):
    logits, _, aux = Model(spec).forward(p, tokens, positions)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 3]) + aux["moe_aux_loss"], logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.mark.parametrize("policy", ["full", "save_dots"])
def test_remat_equals_no_remat_in_values_and_gradients(policy):
  params = Model(SPEC).init(jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, 64)
  positions = jnp.broadcast_to(jnp.arange(20, dtype=jnp.int32), (2, 20))
  (loss, logits), grads = _value_and_grad(SPEC, params, tokens, positions)
  (loss_r, logits_r), grads_r = _value_and_grad(SPEC.replace(remat=policy), params, tokens,
                                                positions)
  np.testing.assert_allclose(logits_r, logits, atol=1e-6)
  np.testing.assert_allclose(loss_r, loss, atol=1e-7)
  for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert jax.tree.structure(grads_r) == jax.tree.structure(grads)  # Same params tree.


def test_remat_shows_in_the_backward_program():
  """'full' recomputes the layer: the backward holds more of the forward's ops."""
  params = Model(SPEC).init(jax.random.key(0))
  tokens = jnp.zeros((2, 16), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))

  def text(spec):
    fn = jax.grad(lambda p: Model(spec).forward(p, tokens, positions)[0].sum())
    return jax.jit(fn).lower(params).as_text()
  assert text(SPEC.replace(remat="full")).count("dot_general") > text(SPEC).count(
      "dot_general")


def test_an_unknown_policy_names_the_field():
  with pytest.raises(ConfigError, match="remat"):
    SPEC.replace(remat="some")
