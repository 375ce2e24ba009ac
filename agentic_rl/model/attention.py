"""The three attention layer types, one module: S (gated sliding window),
G (block top-k sparse GQA) and F (dense causal).

Each call takes a chunk of tokens (a full sequence, a prefill chunk or one
decode token per sequence), optionally the layer's cache, and returns the
output, the updated cache and what it selected:

    y_btd, new_layer_cache, aux = Attention(spec, layer_type)(
        x_btd, positions_bt, layer_cache, lengths_b, forced_blocks_bktj)

Without a cache the chunk is the whole sequence: S and F layers take its
positions wherever they start; G layers index keys by position in a buffer
of T rounded up to a block, so their sequences start at position 0.

Axis letters (one per axis, here, in cache.py and in agentic_rl/kernels/): b batch, t query
time, s key/cache slot, d d_model, n query heads, k kv heads, g query heads per kv
head (n = k * g), h head_dim, c key blocks, j selected-block slot, l token within a
block. Params: w_q_dnh [d, n, h], w_k_dkh / w_v_dkh [d, k, h], w_o_nhd [n, h, d]; on S
layers, w_gate_dn [d, n], b_gate_n [n] (unless s_gate='none'); with attention_bias, b_q_nh,
b_k_kh, b_v_kh, b_o_d; with qk_norm, q_norm/scale and k_norm/scale [h]. (Files saved before this naming hold
w_q_dhk, w_k_dhk, w_v_dhk, w_o_hkd, w_gate_dh, b_gate_h: agentic_rl/train/params_file.py
renames them on load.)
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from agentic_rl.model import cache as cache_lib
from agentic_rl.model.config import ModelSpec
from agentic_rl.model.rope import apply_rope, inverse_frequencies
from agentic_rl.kernels import dispatch
from agentic_rl.kernels import reference


def _round_up(n, m):
  return -(-n // m) * m


def _fan_in(in_axis, out_axis):
  return nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=in_axis,
                                          out_axis=out_axis)


class Attention(nn.Module):
  spec: ModelSpec
  layer_type: str
  kv_len: int | None = None  # Cached calls: attend over the first kv_len positions only.

  @nn.compact
  def __call__(self, x_btd, positions_bt, layer_cache=None, lengths_b=None,
               forced_blocks_bktj=None):
    spec = self.spec
    dtype = jnp.dtype(spec.dtype)
    pdtype = jnp.dtype(spec.param_dtype)
    d, n, k, h = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim
    w_q_dnh = self.param("w_q_dnh", _fan_in(0, (1, 2)), (d, n, h), pdtype).astype(dtype)
    w_k_dkh = self.param("w_k_dkh", _fan_in(0, (1, 2)), (d, k, h), pdtype).astype(dtype)
    w_v_dkh = self.param("w_v_dkh", _fan_in(0, (1, 2)), (d, k, h), pdtype).astype(dtype)
    w_o_nhd = self.param("w_o_nhd", _fan_in((0, 1), 2), (n, h, d), pdtype).astype(dtype)
    x_btd = x_btd.astype(dtype)
    q_btnh = jnp.einsum("btd,dnh->btnh", x_btd, w_q_dnh)
    k_btkh = jnp.einsum("btd,dkh->btkh", x_btd, w_k_dkh)
    v_btkh = jnp.einsum("btd,dkh->btkh", x_btd, w_v_dkh)
    if spec.attention_bias:
      q_btnh = q_btnh + self._bias("b_q_nh", (n, h))
      k_btkh = k_btkh + self._bias("b_k_kh", (k, h))
      v_btkh = v_btkh + self._bias("b_v_kh", (k, h))
    if spec.qk_norm:  # Qwen3: each head's query and key RMS-normalised before RoPE.
      q_btnh = self._rms_norm("q_norm")(q_btnh)
      k_btkh = self._rms_norm("k_norm")(k_btkh)
    inv_freq_i = inverse_frequencies(h, spec.rope_theta, spec.rope_scaling)
    q_btnh = apply_rope(q_btnh, positions_bt, inv_freq_i)
    k_btkh = apply_rope(k_btkh, positions_bt, inv_freq_i)
    # Recorded only when a caller makes "intermediates" mutable (quantify/sparse_coverage:
    # the indexer's coverage on real queries and keys); free otherwise.
    self.sow("intermediates", "q_btnh", q_btnh)
    self.sow("intermediates", "k_btkh", k_btkh)

    ops = dispatch.get_ops(spec.kernel_backend, spec.pallas_interpret)
    aux = {}
    if self.layer_type == "S":
      o_btnh, new_cache = self._sliding(ops, q_btnh, k_btkh, v_btkh, positions_bt, layer_cache)
      o_btnh = o_btnh * self._s_gate(x_btd)[..., None].astype(o_btnh.dtype)
    elif self.layer_type == "F":
      o_btnh, new_cache = self._dense(ops, q_btnh, k_btkh, v_btkh, positions_bt, layer_cache)
    elif self.layer_type == "G":
      o_btnh, new_cache, blocks_bktj = self._sparse(ops, q_btnh, k_btkh, v_btkh, positions_bt,
                                                    layer_cache, lengths_b, forced_blocks_bktj)
      aux["blocks"] = blocks_bktj
    else:
      raise ValueError(f"unknown layer type {self.layer_type!r}")
    y_btd = jnp.einsum("btnh,nhd->btd", o_btnh.astype(dtype), w_o_nhd)
    if spec.attention_bias:
      y_btd = y_btd + self._bias("b_o_d", (d,))
    return y_btd, new_cache, aux

  def _bias(self, name, shape):
    spec = self.spec
    return self.param(name, nn.initializers.zeros, shape,
                      jnp.dtype(spec.param_dtype)).astype(spec.dtype)

  def _rms_norm(self, name):
    spec = self.spec
    return nn.RMSNorm(epsilon=spec.norm_eps, dtype=spec.dtype, param_dtype=spec.param_dtype,
                      name=name)

  def _s_gate(self, x_btd):
    """The S layer's per-head output gate [B, T, N] from the layer input (config.model.s_gate):
    sigmoid(x W + b); 2 sigmoid(x W + b) with W, b starting at zero, exactly 1 (pass-through)
    until trained; or 1 with no parameters."""
    spec = self.spec
    d, n = spec.d_model, spec.num_heads
    if spec.s_gate == "none":
      return jnp.ones(x_btd.shape[:2] + (n,), x_btd.dtype)
    pdtype = jnp.dtype(spec.param_dtype)
    init = _fan_in(0, 1) if spec.s_gate == "sigmoid" else nn.initializers.zeros
    w_gate_dn = self.param("w_gate_dn", init, (d, n), pdtype).astype(x_btd.dtype)
    b_gate_n = self.param("b_gate_n", nn.initializers.zeros, (n,), pdtype)
    gate_btn = jax.nn.sigmoid(jnp.einsum("btd,dn->btn", x_btd, w_gate_dn) + b_gate_n)
    return 2 * gate_btn if spec.s_gate == "unit_sigmoid" else gate_btn

  def _sliding(self, ops, q_btnh, k_btkh, v_btkh, positions_bt, layer_cache):
    w = self.spec.sliding_window
    if layer_cache is None:
      return ops.local_window_attention(q_btnh, k_btkh, v_btkh, positions_bt, window=w), None
    # The ring holds positions before this chunk; the chunk attends to both.
    dtype = q_btnh.dtype
    k_bskh = jnp.concatenate([layer_cache["k"].astype(dtype), k_btkh], axis=1)
    v_bskh = jnp.concatenate([layer_cache["v"].astype(dtype), v_btkh], axis=1)
    pos_bs = jnp.concatenate([layer_cache["pos"], positions_bt], axis=1)
    o_btnh = ops.sliding_window_attention(q_btnh, k_bskh, v_bskh, positions_bt, pos_bs,
                                          window=w)
    return o_btnh, cache_lib.write_ring(layer_cache, k_btkh, v_btkh, positions_bt)

  def _dense(self, ops, q_btnh, k_btkh, v_btkh, positions_bt, layer_cache):
    if layer_cache is None:
      return ops.causal_attention(q_btnh, k_btkh, v_btkh, positions_bt, positions_bt), None
    new_cache = {"k": cache_lib.write_full(layer_cache["k"], k_btkh, positions_bt),
                 "v": cache_lib.write_full(layer_cache["v"], v_btkh, positions_bt)}
    k_bskh, v_bskh = self._filled(new_cache["k"]), self._filled(new_cache["v"])
    o_btnh = ops.causal_attention(q_btnh, k_bskh.astype(q_btnh.dtype),
                                  v_bskh.astype(q_btnh.dtype), positions_bt,
                                  self._buffer_positions(k_bskh))
    return o_btnh, new_cache

  def _filled(self, buf_bs__, per: int = 1):
    """A full buffer's first kv_len positions (kv_len / per rows: per = block size for
    the block summaries); the whole buffer when kv_len is None."""
    if self.kv_len is None:
      return buf_bs__
    return buf_bs__[:, :self.kv_len // per]

  def _sparse(self, ops, q_btnh, k_btkh, v_btkh, positions_bt, layer_cache, lengths_b,
              forced_blocks_bktj):
    spec = self.spec
    bs = spec.block_size
    if layer_cache is None:
      b, t = positions_bt.shape
      empty_bskh = jnp.zeros((b, _round_up(t, bs)) + k_btkh.shape[2:], k_btkh.dtype)
      k_bskh = cache_lib.write_full(empty_bskh, k_btkh, positions_bt)
      v_bskh = cache_lib.write_full(empty_bskh, v_btkh, positions_bt)
      lengths = cache_lib.new_lengths(jnp.zeros((b,), jnp.int32), positions_bt)
      block_keys_bckh = reference.block_means(k_bskh, lengths, block_size=bs)
      new_cache = None
    else:
      k_bskh = cache_lib.write_full(layer_cache["k"], k_btkh, positions_bt)
      v_bskh = cache_lib.write_full(layer_cache["v"], v_btkh, positions_bt)
      block_keys_bckh = cache_lib.update_block_keys(layer_cache["block_keys"], k_bskh,
                                                    positions_bt, lengths_b, block_size=bs)
      new_cache = {"k": k_bskh, "v": v_bskh, "block_keys": block_keys_bckh}
      k_bskh = self._filled(k_bskh).astype(q_btnh.dtype)
      v_bskh = self._filled(v_bskh).astype(q_btnh.dtype)
      block_keys_bckh = self._filled(block_keys_bckh, bs)
    if forced_blocks_bktj is None:
      blocks_bktj = ops.select_blocks(q_btnh, block_keys_bckh, positions_bt, block_size=bs,
                                      num_selected=spec.num_selected_blocks)
    else:  # Selection replay: attend exactly where the sampler attended.
      blocks_bktj = forced_blocks_bktj.astype(jnp.int32)
    o_btnh = ops.block_sparse_attention(q_btnh, k_bskh, v_bskh, blocks_bktj, positions_bt,
                                        block_size=bs)
    return o_btnh, new_cache, blocks_bktj

  @staticmethod
  def _buffer_positions(buf_bskh):
    b, s = buf_bskh.shape[:2]
    return jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
