"""Rotary position embedding over the last axis (half-split convention)."""

import jax.numpy as jnp


def apply_rope(x_bthk, positions_bt, theta: float):
  """Rotates pairs (i, i + D/2) of x by angle position * theta^(-2i/D), in float32."""
  d = x_bthk.shape[-1]
  inv_freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
  angle_bti = positions_bt.astype(jnp.float32)[..., None] * inv_freq
  cos = jnp.cos(angle_bti)[:, :, None, :]
  sin = jnp.sin(angle_bti)[:, :, None, :]
  x = x_bthk.astype(jnp.float32)
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_bthk.dtype)
