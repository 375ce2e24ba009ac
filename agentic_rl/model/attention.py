"""The three attention layer types, one module: S (gated sliding window),
G (block top-k sparse GQA) and F (dense causal).

Each call takes a chunk of tokens (a full sequence, a prefill chunk or one
decode token per sequence), optionally the layer's cache, and returns the
output, the updated cache and what it selected:

    y_btd, new_layer_cache, aux = Attention(spec, layer_type)(
        x_btd, positions_bt, layer_cache, lengths_b, forced_blocks_bktn)

Without a cache the chunk is the whole sequence: S and F layers take its
positions wherever they start; G layers index keys by position in a buffer
of T rounded up to a block, so their sequences start at position 0.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from agentic_rl.model import cache as cache_lib
from agentic_rl.model.config import ModelSpec
from agentic_rl.model.rope import apply_rope
from kernels import dispatch
from kernels import reference


def _round_up(n, m):
  return -(-n // m) * m


def _fan_in(in_axis, out_axis):
  return nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=in_axis,
                                          out_axis=out_axis)


class Attention(nn.Module):
  spec: ModelSpec
  layer_type: str

  @nn.compact
  def __call__(self, x_btd, positions_bt, layer_cache=None, lengths_b=None,
               forced_blocks_bktn=None):
    spec = self.spec
    dtype = jnp.dtype(spec.dtype)
    pdtype = jnp.dtype(spec.param_dtype)
    d, h, k, hd = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim
    w_q = self.param("w_q_dhk", _fan_in(0, (1, 2)), (d, h, hd), pdtype)
    w_k = self.param("w_k_dhk", _fan_in(0, (1, 2)), (d, k, hd), pdtype)
    w_v = self.param("w_v_dhk", _fan_in(0, (1, 2)), (d, k, hd), pdtype)
    w_o = self.param("w_o_hkd", _fan_in((0, 1), 2), (h, hd, d), pdtype)
    x = x_btd.astype(dtype)
    q_bthk = apply_rope(jnp.einsum("btd,dhk->bthk", x, w_q.astype(dtype)), positions_bt,
                        spec.rope_theta)
    k_btkd = apply_rope(jnp.einsum("btd,dhk->bthk", x, w_k.astype(dtype)), positions_bt,
                        spec.rope_theta)
    v_btkd = jnp.einsum("btd,dhk->bthk", x, w_v.astype(dtype))

    ops = dispatch.get_ops(spec.kernel_backend, spec.pallas_interpret)
    aux = {}
    if self.layer_type == "S":
      o_bthk, new_cache = self._sliding(ops, q_bthk, k_btkd, v_btkd, positions_bt, layer_cache)
      # Per-head sigmoid output gate computed from the layer input.
      w_gate = self.param("w_gate_dh", _fan_in(0, 1), (d, h), pdtype)
      b_gate = self.param("b_gate_h", nn.initializers.zeros, (h,), pdtype)
      gate_bth = jax.nn.sigmoid(jnp.einsum("btd,dh->bth", x, w_gate.astype(dtype)) + b_gate)
      o_bthk = o_bthk * gate_bth[..., None].astype(o_bthk.dtype)
    elif self.layer_type == "F":
      o_bthk, new_cache = self._dense(ops, q_bthk, k_btkd, v_btkd, positions_bt, layer_cache)
    elif self.layer_type == "G":
      o_bthk, new_cache, blocks = self._sparse(ops, q_bthk, k_btkd, v_btkd, positions_bt,
                                               layer_cache, lengths_b, forced_blocks_bktn)
      aux["blocks"] = blocks
    else:
      raise ValueError(f"unknown layer type {self.layer_type!r}")
    y_btd = jnp.einsum("bthk,hkd->btd", o_bthk.astype(dtype), w_o.astype(dtype))
    return y_btd, new_cache, aux

  def _sliding(self, ops, q, k, v, positions_bt, layer_cache):
    w = self.spec.sliding_window
    if layer_cache is None:
      return ops.local_window_attention(q, k, v, positions_bt, window=w), None
    # The ring holds positions before this chunk; the chunk attends to both.
    dtype = q.dtype
    k_all = jnp.concatenate([layer_cache["k"].astype(dtype), k], axis=1)
    v_all = jnp.concatenate([layer_cache["v"].astype(dtype), v], axis=1)
    pos_all = jnp.concatenate([layer_cache["pos"], positions_bt], axis=1)
    o = ops.sliding_window_attention(q, k_all, v_all, positions_bt, pos_all, window=w)
    return o, cache_lib.write_ring(layer_cache, k, v, positions_bt)

  def _dense(self, ops, q, k, v, positions_bt, layer_cache):
    if layer_cache is None:
      return ops.causal_attention(q, k, v, positions_bt, positions_bt), None
    new_cache = {"k": cache_lib.write_full(layer_cache["k"], k, positions_bt),
                 "v": cache_lib.write_full(layer_cache["v"], v, positions_bt)}
    k_pos_bs = self._buffer_positions(new_cache["k"])
    o = ops.causal_attention(q, new_cache["k"].astype(q.dtype), new_cache["v"].astype(q.dtype),
                             positions_bt, k_pos_bs)
    return o, new_cache

  def _sparse(self, ops, q, k, v, positions_bt, layer_cache, lengths_b, forced_blocks):
    spec = self.spec
    bs = spec.block_size
    if layer_cache is None:
      b, t = positions_bt.shape
      empty = jnp.zeros((b, _round_up(t, bs)) + k.shape[2:], k.dtype)
      k_buf = cache_lib.write_full(empty, k, positions_bt)
      v_buf = cache_lib.write_full(empty, v, positions_bt)
      lengths = cache_lib.new_lengths(jnp.zeros((b,), jnp.int32), positions_bt)
      block_keys = reference.block_means(k_buf, lengths, block_size=bs)
      new_cache = None
    else:
      k_buf = cache_lib.write_full(layer_cache["k"], k, positions_bt)
      v_buf = cache_lib.write_full(layer_cache["v"], v, positions_bt)
      block_keys = cache_lib.update_block_keys(layer_cache["block_keys"], k_buf, positions_bt,
                                               lengths_b, block_size=bs)
      new_cache = {"k": k_buf, "v": v_buf, "block_keys": block_keys}
      k_buf, v_buf = k_buf.astype(q.dtype), v_buf.astype(q.dtype)
    if forced_blocks is None:
      blocks = ops.select_blocks(q, block_keys, positions_bt, block_size=bs,
                                 num_selected=spec.num_selected_blocks)
    else:  # Selection replay: attend exactly where the sampler attended.
      blocks = forced_blocks.astype(jnp.int32)
    o = ops.block_sparse_attention(q, k_buf, v_buf, blocks, positions_bt, block_size=bs)
    return o, new_cache, blocks

  @staticmethod
  def _buffer_positions(buf_bskd):
    b, s = buf_bskd.shape[:2]
    return jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
