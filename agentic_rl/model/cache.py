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

Under config.model.scan_layers (`ModelSpec.layer_scan`) "layers" holds only the unrolled
leading layers, and the scanned group's caches sit under "stack": one dict per slot, each
buffer with a leading axis of the slot's R repeats ([R, B, ...], axis letter r), which the
forward's scan slices as it slices the stacked params. `stack_layers` / `unstack_layers`
convert between the two layouts; the functions here take either.

Full caches are indexed by position. The ring stores the position held in
each slot (-1 when empty), so visibility is decided by positions alone.
Each sequence writes its own positions, so ragged lengths share one batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model.config import LAYER_KINDS, LayerScan, ModelSpec
from agentic_rl.kernels import reference


STACK = "stack"  # The scanned slots' caches, [R, B, ...] per buffer.


def init_cache(spec: ModelSpec, batch_size: int, max_len: int | None = None) -> dict:
  """An empty cache for `batch_size` sequences of up to `max_len` positions, in the
  layout of `spec` (stacked per scanned slot under scan_layers)."""
  max_len = spec.max_seq_len if max_len is None else max_len
  if max_len % spec.block_size:
    raise ValueError(f"cache max_len={max_len} must be a multiple of "
                     f"block_size={spec.block_size}.")
  scan = spec.layer_scan
  unrolled = spec.num_layers if scan is None else scan.unrolled
  layer = functools.partial(_empty_layer, spec, max_len=max_len)
  cache = {"lengths": jnp.zeros((batch_size,), jnp.int32),
           "layers": tuple(layer(i, (batch_size,)) for i in range(unrolled))}
  if scan is not None:
    # Every repeat of slot j has the kind of its first layer.
    cache[STACK] = tuple(layer(scan.layer(j, 0), (scan.repeats, batch_size))
                         for j in range(scan.period))
  return cache


def _empty_layer(spec: ModelSpec, index: int, rows: tuple[int, ...], *, max_len: int) -> dict:
  """Layer `index`'s empty buffers, with leading axes `rows` ((B,) or (R, B))."""
  dtype = jnp.dtype(spec.cache_dtype)
  kv = (spec.num_kv_heads, spec.head_dim)
  kind = LAYER_KINDS[spec.layer_types[index]]
  if kind.ring_cache:
    w = spec.sliding_window
    return {"k": jnp.zeros(rows + (w,) + kv, dtype), "v": jnp.zeros(rows + (w,) + kv, dtype),
            "pos": jnp.full(rows + (w,), -1, jnp.int32)}
  layer = {"k": jnp.zeros(rows + (max_len,) + kv, dtype),
           "v": jnp.zeros(rows + (max_len,) + kv, dtype)}
  if kind.block_summaries:
    layer["block_keys"] = jnp.zeros(rows + (max_len // spec.block_size,) + kv, dtype)
  return layer


def stack_layers(cache: dict, scan: LayerScan | None) -> dict:
  """A cache of per-layer entries (an unscanned model's) in the layout `scan` describes."""
  if scan is None:
    return cache
  layers = cache["layers"]
  return {"lengths": cache["lengths"], "layers": tuple(layers[:scan.unrolled]),
          STACK: tuple(jax.tree.map(lambda *xs: jnp.stack(xs),
                                    *[layers[scan.layer(j, r)] for r in range(scan.repeats)])
                       for j in range(scan.period))}


def unstack_layers(cache: dict, scan: LayerScan | None) -> dict:
  """A cache in the layout `scan` describes as one entry per layer; inverts stack_layers."""
  if scan is None:
    return cache
  layers = list(cache["layers"]) + [None] * (scan.period * scan.repeats)
  for j, slot in enumerate(cache[STACK]):
    for r in range(scan.repeats):
      layers[scan.layer(j, r)] = jax.tree.map(lambda x, r=r: x[r], slot)
  return {"lengths": cache["lengths"], "layers": tuple(layers)}


def map_rows(fn, *caches) -> dict:
  """`fn(batch_axis, *leaves)` over every buffer of the caches (all in one layout): the
  batch is axis 0 of a layer's buffers and of lengths, axis 1 of a stacked slot's."""
  out = {"lengths": fn(0, *[c["lengths"] for c in caches]),
         "layers": jax.tree.map(functools.partial(fn, 0), *[c["layers"] for c in caches])}
  if STACK in caches[0]:
    out[STACK] = jax.tree.map(functools.partial(fn, 1), *[c[STACK] for c in caches])
  return out


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

  def reset_leaf(axis, x):
    # Ring positions: -1 marks an empty slot; a length is 0.
    empty = -1 if x.dtype == jnp.int32 and x.ndim > axis + 1 else 0
    index = (slice(None),) * axis + (rows_b,)
    return x.at[index].set(jnp.asarray(empty, x.dtype), mode="drop")
  return map_rows(reset_leaf, cache)


def head(cache: dict, length: int) -> dict:
  """The cache with its full buffers cut to their first `length` positions (a multiple of
  the block size; ring buffers and lengths whole): a call that writes and reads only
  positions below `length` runs on it at the cost of its length, not the capacity;
  `scatter_sequences` writes such rows back."""
  full = capacity(cache)
  if full is None or length >= full:
    return cache

  def cut(axis, entry):  # `axis`: the position axis; a ring's slots are not positions.
    if "pos" in entry:
      return entry
    return {key: jax.lax.slice_in_dim(x, 0, x.shape[axis] * length // full, axis=axis)
            for key, x in entry.items()}
  out = {"lengths": cache["lengths"], "layers": tuple(cut(1, e) for e in cache["layers"])}
  if STACK in cache:
    out[STACK] = tuple(cut(2, e) for e in cache[STACK])
  return out


def capacity(cache: dict) -> int | None:
  """Positions a cache can hold (its full buffers' length, a static shape), or None
  when it has only ring buffers (S layers), which hold any position."""
  for layer in cache["layers"]:
    if "pos" not in layer:
      return int(layer["k"].shape[1])
  for slot in cache.get(STACK, ()):
    if "pos" not in slot:
      return int(slot["k"].shape[2])
  return None


def gather_sequences(cache: dict, index_b) -> dict:
  """A cache whose row i is row index_b[i] of `cache` (e.g. one prompt copied G times)."""
  return map_rows(lambda axis, x: x[(slice(None),) * axis + (index_b,)], cache)


def scatter_sequences(cache: dict, dst_b, src: dict) -> dict:
  """Writes the rows of `src` into rows `dst_b` of `cache`; `src` may be a `head` of such
  rows (full buffers cut short): only those positions are written."""
  def put(axis, x, y):
    index = (slice(None),) * axis + (dst_b,)
    if y.ndim > axis + 1 and y.shape[axis + 1] < x.shape[axis + 1]:
      index += (slice(0, y.shape[axis + 1]),)
    return x.at[index].set(y)
  return map_rows(put, cache, src)
