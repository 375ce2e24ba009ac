"""KV caches as plain pytrees, passed into `Model.forward` and returned by it.

Layout (B sequences, K kv heads, H head dim, W window, S capacity, C = S / block_size
blocks; the axis letters of attention.py):

    cache = {
      "lengths": int32 [B],                 # tokens written per sequence
      "layers": (one dict per layer,)
    }
    S layer: {"k": [B, W, K, H], "v": [B, W, K, H], "pos": int32 [B, W]}  # ring buffer
    G layer: {"k": [B, S, K, H], "v": [B, S, K, H], "block_keys": [B, C, K, H]}
    F layer: {"k": [B, S, K, H], "v": [B, S, K, H]}

Full caches are indexed by position. The ring stores the position held in
each slot (-1 when empty), so visibility is decided by positions alone.
Each sequence writes its own positions, so ragged lengths share one batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model.config import LAYER_KINDS, ModelSpec
from agentic_rl.kernels import reference


def init_cache(spec: ModelSpec, batch_size: int, max_len: int | None = None) -> dict:
  """An empty cache for `batch_size` sequences of up to `max_len` positions."""
  max_len = spec.max_seq_len if max_len is None else max_len
  if max_len % spec.block_size:
    raise ValueError(f"cache max_len={max_len} must be a multiple of "
                     f"block_size={spec.block_size}.")
  dtype = jnp.dtype(spec.cache_dtype)
  kv = (spec.num_kv_heads, spec.head_dim)
  layers = []
  for layer_type in spec.layer_types:
    kind = LAYER_KINDS[layer_type]
    if kind.ring_cache:
      w = spec.sliding_window
      layers.append({"k": jnp.zeros((batch_size, w) + kv, dtype),
                     "v": jnp.zeros((batch_size, w) + kv, dtype),
                     "pos": jnp.full((batch_size, w), -1, jnp.int32)})
    else:
      layer = {"k": jnp.zeros((batch_size, max_len) + kv, dtype),
               "v": jnp.zeros((batch_size, max_len) + kv, dtype)}
      if kind.block_summaries:
        layer["block_keys"] = jnp.zeros(
            (batch_size, max_len // spec.block_size) + kv, dtype)
      layers.append(layer)
  return {"lengths": jnp.zeros((batch_size,), jnp.int32), "layers": tuple(layers)}


def cache_bytes_per_sequence(spec: ModelSpec, length: int) -> int:
  """Bytes one sequence's cache needs to hold `length` tokens.

  Full layers grow with the length; ring buffers stop at the window.
  """
  itemsize = np.dtype(spec.cache_dtype).itemsize
  kv_token = spec.num_kv_heads * spec.head_dim * itemsize
  total = 4  # the length counter
  for layer_type in spec.layer_types:
    kind = LAYER_KINDS[layer_type]
    if kind.ring_cache:
      slots = min(spec.sliding_window, length)
      total += slots * (2 * kv_token + 4)
    else:
      total += length * 2 * kv_token
      if kind.block_summaries:
        total += -(-length // spec.block_size) * kv_token
  return total


def new_lengths(lengths_b, positions_bt):
  return jnp.maximum(lengths_b, jnp.max(positions_bt, axis=1) + 1).astype(jnp.int32)


def _drop_invalid(index_bt, valid_bt, size):
  # Negative indices would wrap; out-of-range ones are dropped by mode="drop".
  return jnp.where(valid_bt, index_bt, size)


def write_full(buf_bskh, new_btkh, positions_bt):
  """Scatters new keys or values into a position-indexed buffer."""
  b = buf_bskh.shape[0]
  size = buf_bskh.shape[1]
  idx = _drop_invalid(positions_bt, (positions_bt >= 0) & (positions_bt < size), size)
  rows = jnp.arange(b)[:, None]
  return buf_bskh.at[rows, idx].set(new_btkh.astype(buf_bskh.dtype), mode="drop")


def write_ring(layer: dict, k_btkh, v_btkh, positions_bt) -> dict:
  """Writes a chunk into a ring buffer; only the chunk's last W tokens land."""
  b, w = layer["pos"].shape
  last_b = jnp.max(positions_bt, axis=1, keepdims=True)
  valid = (positions_bt >= 0) & (positions_bt > last_b - w)
  idx = _drop_invalid(positions_bt % w, valid, w)
  rows = jnp.arange(b)[:, None]
  return {
      "k": layer["k"].at[rows, idx].set(k_btkh.astype(layer["k"].dtype), mode="drop"),
      "v": layer["v"].at[rows, idx].set(v_btkh.astype(layer["v"].dtype), mode="drop"),
      "pos": layer["pos"].at[rows, idx].set(positions_bt, mode="drop"),
  }


def update_block_keys(block_keys_bckh, k_bskh, positions_bt, lengths_b, *, block_size):
  """Recomputes the mean key of every block the chunk's tokens touched.

  Uses the same masked mean as `reference.block_means`, so a cache built
  token by token holds the summaries a full forward computes.
  """
  b, t = positions_bt.shape
  valid_bt = positions_bt >= 0
  blk_bt = jnp.where(valid_bt, positions_bt // block_size, 0)
  tok_btl = blk_bt[..., None] * block_size + jnp.arange(block_size)
  rows = jnp.arange(b)[:, None, None]
  k_btlkh = k_bskh[rows, tok_btl]
  mean_btkh = reference._masked_block_mean(k_btlkh, tok_btl < lengths_b[:, None, None])
  num_blocks = block_keys_bckh.shape[1]
  idx = _drop_invalid(blk_bt, valid_bt, num_blocks)
  return block_keys_bckh.at[jnp.arange(b)[:, None], idx].set(
      mean_btkh.astype(block_keys_bckh.dtype), mode="drop")


def reset_sequences(cache: dict, reset_b) -> dict:
  """Empties the sequences where `reset_b` is True (a slot taking a new task).

  Clears every buffer of those rows, not only what the masks read (lengths, ring
  positions): a NaN or inf the old sequence left in a key, value or block summary
  must not outlive it, whatever a kernel does with masked slots.
  """
  b = reset_b.shape[0]
  # Rows kept point past the end and are dropped: only the reset rows are written,
  # not a pass over the whole cache.
  rows_b = jnp.where(reset_b, jnp.arange(b), b)

  def reset_leaf(x):
    empty = -1 if x.dtype == jnp.int32 else 0  # Ring positions: -1 marks an empty slot.
    return x.at[rows_b].set(jnp.asarray(empty, x.dtype), mode="drop")
  return {"lengths": jnp.where(reset_b, 0, cache["lengths"]),
          "layers": jax.tree.map(reset_leaf, cache["layers"])}


def capacity(cache: dict) -> int | None:
  """Positions a cache can hold (its full buffers' length, a static shape), or None
  when it has only ring buffers (S layers), which hold any position."""
  for layer in cache["layers"]:
    if "pos" not in layer:
      return int(layer["k"].shape[1])
  return None


def gather_sequences(cache: dict, index_b) -> dict:
  """A cache whose row i is row index_b[i] of `cache` (e.g. one prompt copied G times)."""
  return jax.tree.map(lambda x: x[index_b], cache)


def scatter_sequences(cache: dict, dst_b, src: dict) -> dict:
  """Writes the rows of `src` into rows `dst_b` of `cache`."""
  return jax.tree.map(lambda x, y: x.at[dst_b].set(y), cache, src)
