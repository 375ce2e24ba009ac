"""The dense SwiGLU feed-forward: y = (silu(x @ W_gate) * (x @ W_up)) @ W_down.

Used for the first `num_dense_layers` layers and, with d_ff = num_shared_experts *
d_ff_expert, as the shared experts of an MoE layer.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

# Fan-in scaled truncated normal (std 1/sqrt(fan_in)); keeps activations O(1) per layer.
fan_in_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class DenseFeedForward(nn.Module):
  """SwiGLU FFN over the last axis. Params: w_gate_df, w_up_df [D, F]; w_down_fd [F, D]; with
  use_bias (Llama's mlp_bias), b_gate_f, b_up_f [F] and b_down_d [D]."""

  d_ff: int
  dtype: Any = jnp.float32  # Compute dtype (a jnp dtype or its name, e.g. "bfloat16").
  param_dtype: Any = jnp.float32
  use_bias: bool = False

  @nn.compact
  def __call__(self, x_btd: jax.Array) -> jax.Array:
    if self.d_ff <= 0:
      raise ValueError(f"DenseFeedForward.d_ff={self.d_ff!r}: expected a positive integer.")
    d_model = x_btd.shape[-1]
    dtype, param_dtype = jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)
    w_gate_df = self.param("w_gate_df", fan_in_init, (d_model, self.d_ff), param_dtype)
    w_up_df = self.param("w_up_df", fan_in_init, (d_model, self.d_ff), param_dtype)
    w_down_fd = self.param("w_down_fd", fan_in_init, (self.d_ff, d_model), param_dtype)
    x = x_btd.astype(dtype)
    gate = jnp.einsum("...d,df->...f", x, w_gate_df.astype(dtype))
    up = jnp.einsum("...d,df->...f", x, w_up_df.astype(dtype))
    if self.use_bias:
      gate = gate + self._bias("b_gate_f", self.d_ff)
      up = up + self._bias("b_up_f", self.d_ff)
    y = jnp.einsum("...f,fd->...d", jax.nn.silu(gate) * up, w_down_fd.astype(dtype))
    if self.use_bias:
      y = y + self._bias("b_down_d", d_model)
    return y

  def _bias(self, name, size):
    return self.param(name, nn.initializers.zeros, (size,),
                      jnp.dtype(self.param_dtype)).astype(self.dtype)
