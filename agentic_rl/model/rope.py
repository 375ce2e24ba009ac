"""Rotary position embedding over the last axis (half-split convention)."""

import jax.numpy as jnp


def apply_rope(x, positions_bt, theta: float):
  """Rotates pairs (i, i + H/2) of x by angle position * theta^(-2i/H), in float32.

  x: [B, T, heads, H], queries (q_btnh) or keys (k_btkh); i indexes the H/2 pairs.
  """
  h = x.shape[-1]
  inv_freq_i = theta ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2.0 / h)
  angle_bti = positions_bt.astype(jnp.float32)[..., None] * inv_freq_i
  cos = jnp.cos(angle_bti)[:, :, None, :]
  sin = jnp.sin(angle_bti)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : h // 2], x32[..., h // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
