"""Rotary position embedding over the last axis (half-split convention), with the frequency
scalings of the Hugging Face families (`config.model.rope_scaling`)."""

import math

import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling=None) -> np.ndarray:
  """float32 [H/2]: theta^(-2i/H) per rotated pair i, stretched by `scaling` (a
  RopeScalingSpec; None or kind 'none' leaves them). Computed once on the host, in float32
  as Hugging Face does, so both sides rotate by the same angles."""
  exponents_i = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
  inv_freq_i = (1.0 / (np.float32(theta) ** exponents_i)).astype(np.float32)
  if scaling is None or scaling.kind == "none":
    return inv_freq_i
  if scaling.kind == "llama3":
    return _llama3(inv_freq_i, scaling)
  raise ValueError(f"rope_scaling.kind={scaling.kind!r}: expected 'none' or 'llama3'.")


def _llama3(inv_freq_i: np.ndarray, s) -> np.ndarray:
  """Llama 3.1's scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
  interpolation in between."""
  low_freq_wavelen = s.original_max_len / s.low_freq_factor
  high_freq_wavelen = s.original_max_len / s.high_freq_factor
  wavelen_i = 2 * math.pi / inv_freq_i
  scaled_i = np.where(wavelen_i > low_freq_wavelen, inv_freq_i / s.factor, inv_freq_i)
  smooth_i = ((s.original_max_len / wavelen_i - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
  smoothed_i = (1 - smooth_i) * scaled_i / s.factor + smooth_i * scaled_i
  medium_i = ~(wavelen_i < high_freq_wavelen) & ~(wavelen_i > low_freq_wavelen)
  return np.where(medium_i, smoothed_i, scaled_i).astype(np.float32)


def apply_rope(x, positions_bt, inv_freq_i):
  """Rotates pairs (i, i + H/2) of x by angle position * inv_freq_i[i], in float32.

  x: [B, T, heads, H], queries (q_btnh) or keys (k_btkh); i indexes the H/2 pairs.
  inv_freq_i: `inverse_frequencies(H, theta, scaling)`, or a float theta for the unscaled
  theta^(-2i/H).
  """
  h = x.shape[-1]
  if isinstance(inv_freq_i, (int, float)):
    inv_freq_i = inverse_frequencies(h, inv_freq_i)
  angle_bti = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_i)
  cos = jnp.cos(angle_bti)[:, :, None, :]
  sin = jnp.sin(angle_bti)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : h // 2], x32[..., h // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
