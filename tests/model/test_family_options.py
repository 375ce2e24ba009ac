"""The architecture options the Hugging Face families need, checked on our model alone (the
parity with transformers is tests/hf/test_parity.py): the S gate's pass-through start, and
the params a dense base lacks."""

import jax
import numpy as np

from agentic_rl.model.config import ModelSpec
from agentic_rl.model.transformer import Model


def _spec(**kw):
  return ModelSpec(vocab_size=64, d_model=32, num_layers=4, layer_pattern="SSSF", num_heads=4,
                   num_kv_heads=2, head_dim=8, num_dense_layers=4, d_ff=48,
                   sliding_window=6, **kw)


def test_the_unit_sigmoid_gate_starts_exactly_as_no_gate():
  gated, plain = Model(_spec(s_gate="unit_sigmoid")), Model(_spec(s_gate="none"))
  params = gated.init(jax.random.key(0))
  no_gates = jax.tree_util.tree_map_with_path(lambda p, x: x, params)
  for i in range(3):
    attn = dict(no_gates[f"layer_{i}"]["attn"])
    assert not np.any(np.asarray(attn.pop("w_gate_dn"))) and not np.any(attn.pop("b_gate_n"))
    no_gates[f"layer_{i}"] = dict(no_gates[f"layer_{i}"], attn=attn)
  assert jax.tree.structure(no_gates) == jax.tree.structure(plain.init(jax.random.key(0)))
  tokens = np.random.default_rng(0).integers(0, 64, (2, 20), dtype=np.int32)
  positions = np.broadcast_to(np.arange(20, dtype=np.int32), tokens.shape)
  np.testing.assert_array_equal(np.asarray(gated.forward(params, tokens, positions)[0]),
                                np.asarray(plain.forward(no_gates, tokens, positions)[0]))


def test_params_started_fresh_name_the_gates_of_s_layers_only():
  assert _spec(s_gate="unit_sigmoid").params_started_fresh() == ("value_head/",) + tuple(
      f"layer_{i}/attn/{n}" for i in range(3) for n in ("w_gate_dn", "b_gate_n"))
  assert _spec().params_started_fresh() == ("value_head/",)


def test_moe_layers_follow_num_dense_layers_dense_layers_and_the_step():
  spec = ModelSpec(num_layers=6, layer_pattern="F", num_dense_layers=1, dense_layers=(3,),
                   moe_layer_step=2)
  assert [spec.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
