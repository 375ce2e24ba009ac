"""Small model specs and numpy-drawn params shared by the model tests.

Params are drawn in numpy from the param shapes (`jax.eval_shape` of the init), so
tests compile no flax init (seconds on CPU) and do not depend on jax's PRNG:
weights with std 1/sqrt(fan_in), embeddings with std 1, norm scales 1 + 0.1 N(0, 1),
S-gate biases 0.5 N(0, 1) (so the gate is not a constant), routing biases 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model.config import ModelSpec, default_model_config, validate

# Weights whose fan-in is their first axis ([D, ...] projections); w_o_nhd has fan-in N*H;
# everything else ([.., in, out] dense and stacked expert weights) uses its second-last axis.
_FAN_IN_FIRST_AXIS = ("w_q_dnh", "w_k_dkh", "w_v_dkh", "w_gate_dn", "w_router_de")


def make_spec(pattern: str, num_layers: int, num_dense_layers: int = 0,
              **overrides) -> ModelSpec:
  """A tiny model: V=64, d_model=32, 4 query heads over 2 KV heads of dim 8,
  W=8, B=4, k=8 (2 blocks), max_seq_len=64, 4 experts top-2 plus one shared expert.

  overrides: top-level config.model fields, or "moe.<field>" for the MoE section.
  """
  c = default_model_config()
  c.vocab_size, c.d_model, c.num_layers, c.layer_pattern = 64, 32, num_layers, pattern
  c.num_heads, c.num_kv_heads, c.head_dim = 4, 2, 8
  c.max_seq_len, c.sliding_window, c.block_size, c.topk_tokens = 64, 8, 4, 8
  c.d_ff, c.num_dense_layers = 32, num_dense_layers
  c.moe.num_experts, c.moe.num_experts_per_token, c.moe.d_ff_expert = 4, 2, 16
  for key, value in overrides.items():
    if key.startswith("moe."):
      c.moe[key[4:]] = value
    else:
      c[key] = value
  return validate(c)


def draw_like(shapes, seed: int):
  """Numpy-drawn params for a pytree of ShapeDtypeStructs (see the module docstring)."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = path[-1].key
    shape = leaf.shape
    if name == "scale":
      w = 1.0 + 0.1 * rng.standard_normal(shape)
    elif name == "embedding":
      w = rng.standard_normal(shape)
    elif name == "b_gate_n":
      w = 0.5 * rng.standard_normal(shape)
    elif name == "routing_bias_e":
      w = np.zeros(shape)
    else:
      if name == "w_o_nhd":
        fan_in = shape[0] * shape[1]
      elif name in _FAN_IN_FIRST_AXIS:
        fan_in = shape[0]
      else:
        fan_in = shape[-2] if len(shape) > 1 else 1  # A bias (value head): unit std.
      w = rng.standard_normal(shape) / np.sqrt(fan_in)
    return jnp.asarray(w, leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def draw_params(model, seed: int):
  """Params for a `Model`, drawn in numpy (no init compiled)."""
  return draw_like(model.param_shapes(), seed)


def padded_positions(lengths, total: int) -> np.ndarray:
  """int32 [B, total]: 0..n-1 then -1 (padding) for each row length n."""
  pos = np.full((len(lengths), total), -1, np.int32)
  for b, n in enumerate(lengths):
    pos[b, :n] = np.arange(n)
  return pos


def check_block_causality(spec: ModelSpec, aux: dict, positions_bt) -> int:
  """Asserts every sparse layer's aux["blocks"] [B, K, T, n] is causal and complete: the
  own block (position // B) is selected, no block past it, exactly min(n, own + 1) slots
  are used (so -1 only when fewer than n blocks are visible), and padding queries
  (position -1) select nothing. Returns how many layers were checked."""
  n = spec.num_selected_blocks
  positions_bt = np.asarray(positions_bt)
  own = np.where(positions_bt >= 0, positions_bt // spec.block_size, -1)[:, None, :, None]
  checked = 0
  for i, layer_aux in enumerate(aux["layers"]):
    if "blocks" not in layer_aux:
      continue
    checked += 1
    blocks = np.asarray(layer_aux["blocks"])
    assert blocks.shape[-1] == n, (i, blocks.shape)
    assert np.all(blocks <= own), f"layer {i}: a selected block lies in the future"
    live = np.broadcast_to(own[..., 0] >= 0, blocks.shape[:-1])
    assert np.all(np.any(blocks == own, axis=-1)[live]), f"layer {i}: own block missing"
    want_used = np.broadcast_to(np.minimum(n, own + 1)[..., 0], blocks.shape[:-1])
    np.testing.assert_array_equal((blocks >= 0).sum(-1), want_used,
                                  err_msg=f"layer {i}: -1 slots where blocks were visible")
  return checked
