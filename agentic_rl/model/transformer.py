"""The decoder and its one forward, shared by training, prefill and decode.

    model = Model(spec)
    params = model.init(rng)
    logits_btv, new_cache, aux = model.forward(params, tokens_bt, positions_bt,
                                               cache=None, replay=None)

* Training: full sequences, `cache=None`, positions 0..T-1 (-1 on padding).
* Prefill: a chunk of each sequence's next positions into `cache`.
* Decode: one token per sequence, at position `cache["lengths"]`
  (-1 for a slot that sits this step out).

Ids must lie in [0, vocab_size) and positions in [0, capacity) or be -1;
a cached call feeds each row exactly its next positions. `Model.forward`
checks this on the host when its inputs are concrete (`check_inputs`), and
raises a ValueError naming the bad entry. Under jit the arrays are tracers:
callers check on the host before dispatch (rollout/device_steps.py), and the
forward marks the logits of a bad id or position NaN rather than answer.

`aux["layers"][i]` holds what layer i chose: "experts" [B, T, P] for MoE
layers (P = num_experts_per_token) and "blocks" [B, K, T, J] for sparse layers
(K kv heads, J = num_selected_blocks). Passed back as `replay`
(the same tuple, any subset of entries), they force the same routing and
block selection.

config.model.scan_layers runs the repeating group of layers (`ModelSpec.layer_scan`) as
one `nn.scan` over params stacked per slot (model/layer_stack.py), remat inside the scanned
body, so the traced program does not grow with num_layers: training, prefill and decode
alike. Replay and aux["layers"] keep their per-layer form, tuples of L dicts (stacked per
slot into the scan and back). The cache is stacked per slot as the params are
(model/cache.py, "stack"), so a cached call scans params and cache together. Under
scan_layers a replay gives every layer of a slot the same entries.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model import cache as cache_lib
from agentic_rl.model import layer_stack
from agentic_rl.model import moe as moe_lib
from agentic_rl.model.attention import Attention
from agentic_rl.model.config import ModelSpec
from agentic_rl.model.feedforward import DenseFeedForward

Replay = tuple[dict[str, jax.Array], ...]

# The read-out accumulates in float32 whatever the compute dtype: a bf16 result would
# round every logit by up to 2^-9 of its size before the cast.
_dot_general_f32 = functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def position_capacity(spec: ModelSpec, cache, num_tokens: int,
                      kv_len: int | None = None) -> int | None:
  """Positions a call can hold: the cache's capacity (or the kv_len it reads); without a
  cache, the key buffer of the G layers (the chunk rounded up to a block); None when
  nothing bounds them."""
  if cache is not None:
    capacity = cache_lib.capacity(cache)
    return capacity if kv_len is None or capacity is None else min(capacity, kv_len)
  if "G" in spec.layer_types:
    return _round_up(num_tokens, spec.block_size)
  return None


def _at(index) -> str:
  b, t = (int(i) for i in index)
  return f"at row {b}, index {t}"


def check_inputs(spec: ModelSpec, tokens_bt, positions_bt, *, lengths_b=None,
                 capacity: int | None = None, cached: bool = True) -> None:
  """Raises ValueError for ids or positions the forward would silently mishandle.

  Host-side, on concrete int arrays (pass host copies: a device array is read back).
  * every id, padding included, lies in [0, vocab_size);
  * every position is >= 0, or -1 (padding), and below `capacity`;
  * a row holds each position once;
  * with `lengths_b` (what each cache row holds), a row that feeds tokens feeds
    exactly its next positions lengths_b[b], lengths_b[b] + 1, ... in any order.
  cached=False words the capacity error for an uncached call (the G key buffer).
  """
  tokens = np.asarray(tokens_bt)
  positions = np.asarray(positions_bt)
  if tokens.ndim != 2 or tokens.shape != positions.shape:
    raise ValueError(f"tokens {tokens.shape} and positions {positions.shape} must have the "
                     "same [B, T] shape.")
  bad = (tokens < 0) | (tokens >= spec.vocab_size)
  if bad.any():
    i = np.argwhere(bad)[0]
    raise ValueError(f"token id {tokens[tuple(i)]} {_at(i)} is outside the vocabulary "
                     f"[0, {spec.vocab_size}) (config.model.vocab_size).")
  bad = positions < -1
  if bad.any():
    i = np.argwhere(bad)[0]
    raise ValueError(f"position {positions[tuple(i)]} {_at(i)} is invalid: positions are "
                     ">= 0, and -1 marks padding.")
  if capacity is not None and (positions >= capacity).any():
    i = np.argwhere(positions >= capacity)[0]
    p = positions[tuple(i)]
    if cached:
      raise ValueError(f"position {p} {_at(i)} is at or past the cache capacity {capacity} "
                       f"(positions 0..{capacity - 1}): the token would not be stored. "
                       "Allocate a longer cache (init_cache max_len) or end the sequence.")
    raise ValueError(f"position {p} {_at(i)} is past the uncached sparse (G) layers' key "
                     f"buffer of {capacity} positions (T={positions.shape[1]} rounded up to "
                     f"block_size {spec.block_size}): without a cache, a model with G "
                     "layers takes sequences from position 0.")
  t = positions.shape[1]
  valid = positions >= 0
  never = np.iinfo(np.int64).max
  sorted_bt = np.sort(np.where(valid, positions.astype(np.int64), never), axis=1)
  if lengths_b is None:
    repeat = (sorted_bt[:, 1:] == sorted_bt[:, :-1]) & (sorted_bt[:, 1:] != never)
    if repeat.any():
      b, i = np.argwhere(repeat)[0]
      raise ValueError(f"row {b} holds position {sorted_bt[b, i]} twice; a row holds each "
                       "position once.")
    return
  lengths = np.asarray(lengths_b).astype(np.int64)
  if lengths.shape != (positions.shape[0],):
    raise ValueError(f"lengths {lengths.shape} do not match the batch of positions "
                     f"{positions.shape}.")
  n_b = valid.sum(axis=1)
  follows = (sorted_bt == lengths[:, None] + np.arange(t)) | (np.arange(t) >= n_b[:, None])
  for b in np.nonzero(~follows.all(axis=1))[0]:
    fed = positions[b][valid[b]]
    shown = ", ".join(str(p) for p in fed[:8]) + (", ..." if len(fed) > 8 else "")
    n = lengths[b]
    raise ValueError(f"row {b} feeds position{'s' if len(fed) > 1 else ''} {shown} but its "
                     f"cache holds {n} tokens: a cached call feeds a row its next positions "
                     f"{n}, {n + 1}, {n + 2}, ... once each (no gap, no rewind); -1 sits a "
                     "row out.")


class Block(nn.Module):
  spec: ModelSpec
  index: int
  kv_len: int | None = None  # Cached calls: read only the cache's first kv_len positions.

  @nn.compact
  def __call__(self, x_btd, positions_bt, layer_cache, lengths_b, replay):
    spec = self.spec
    layer_type = spec.layer_types[self.index]
    replay = replay or {}
    h = nn.RMSNorm(epsilon=spec.norm_eps, dtype=spec.dtype, param_dtype=spec.param_dtype,
                   name="attn_norm")(x_btd)
    attn_out, new_cache, aux = Attention(spec, layer_type, self.kv_len, name="attn")(
        h, positions_bt, layer_cache, lengths_b, replay.get("blocks"))
    x_btd = x_btd + attn_out
    h = nn.RMSNorm(epsilon=spec.norm_eps, dtype=spec.dtype, param_dtype=spec.param_dtype,
                   name="ffn_norm")(x_btd)
    moe_loss = jnp.float32(0.0)
    if spec.is_moe_layer(self.index):
      ffn_out, moe_aux = moe_lib.MoEFeedForward(spec, name="moe")(
          h, positions_bt >= 0, replay.get("experts"))
      aux["experts"] = moe_aux["experts"]
      aux["expert_load"] = moe_aux["expert_load"]
      for key in ("dropped_assignments", "routed_assignments"):  # Expert parallel only.
        if key in moe_aux:
          aux[key] = moe_aux[key]
      moe_loss = moe_aux["aux_loss"]
    else:
      ffn_out = DenseFeedForward(spec.d_ff, spec.dtype, spec.param_dtype,
                                 use_bias=spec.mlp_bias, name="ffn")(h)
    return x_btd + ffn_out, new_cache, aux, moe_loss


def _remat(block_cls, policy: str, *, scanned: bool = False):
  """The layer as config.model.remat asks: recomputed in the backward from its input
  ('full'), or from its input and matmul outputs ('save_dots'); the forward is unchanged.
  Inside a scan the loop already keeps XLA from merging the recomputation into the
  forward, so CSE prevention (which costs fusions) is off there, as jax.checkpoint advises."""
  if policy == "none":
    return block_cls
  policies = {"full": None,
              "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
  return nn.remat(block_cls, policy=policies[policy], prevent_cse=not scanned)


class LayerGroup(nn.Module):
  """One repeat of the scanned group (config.model.scan_layers): a Block per slot, named
  `slot_{j}`. The body of the nn.scan; `carry` is (x_btd, the MoE loss so far), summed in
  layer order as the unrolled stack sums it. A cached call scans each slot's stacked cache
  (cache["stack"]) with the params and returns the new one the same way."""
  spec: ModelSpec
  kv_len: int | None = None

  @nn.compact
  def __call__(self, carry, positions_bt, replay_slots, cache_slots, lengths_b):
    x_btd, moe_loss = carry
    scan = self.spec.layer_scan
    block_cls = _remat(Block, self.spec.remat, scanned=True)
    slot_aux, slot_caches = [], []
    for j in range(scan.period):
      # Every repeat of slot j has the kind of its first layer: that index picks the kind.
      block = block_cls(self.spec, scan.layer(j, 0), self.kv_len,
                        name=layer_stack.slot_name(j))
      x_btd, new_cache, aux, loss = block(
          x_btd, positions_bt, None if cache_slots is None else cache_slots[j], lengths_b,
          replay_slots[j])
      moe_loss = moe_loss + loss
      slot_aux.append(aux)
      slot_caches.append(new_cache)
    return (x_btd, moe_loss), (tuple(slot_aux), tuple(slot_caches))


def _replay_by_slot(replay, scan) -> tuple[dict, ...]:
  """Per slot, each replay entry stacked over the repeats: the scan's xs."""
  out = []
  for j in range(scan.period):
    layers = [scan.layer(j, r) for r in range(scan.repeats)]
    entries = [(replay[i] or {}) if replay is not None else {} for i in layers]
    keys = set(entries[0])
    for i, entry in zip(layers, entries):
      if set(entry) != keys:
        raise ValueError(
            f"replay gives layer {layers[0]} {sorted(keys)} but layer {i} {sorted(entry)}: "
            "under config.model.scan_layers the layers of one scanned slot are replayed "
            "together, so they take the same entries.")
    out.append({k: jnp.stack([e[k] for e in entries]) for k in sorted(keys)})
  return tuple(out)


class Transformer(nn.Module):
  spec: ModelSpec
  kv_len: int | None = None  # See Model.forward.
  hidden: bool = False  # See Model.forward.

  @nn.compact
  def __call__(self, tokens_bt, positions_bt, cache=None, replay=None):
    spec = self.spec
    embed = nn.Embed(spec.vocab_size, spec.d_model, dtype=spec.dtype,
                     param_dtype=spec.param_dtype,
                     # 1/sqrt(d): tied read-out logits start at unit scale.
                     embedding_init=nn.initializers.normal(stddev=spec.d_model ** -0.5),
                     name="embed")
    x_btd = embed(tokens_bt)
    # Under jit the host check cannot run: a bad id or position gives NaN, not an answer.
    # (take already fills ids >= vocab with NaN; a negative one would wrap.)
    x_btd = jnp.where((tokens_bt < 0)[..., None], jnp.nan, x_btd)
    capacity = position_capacity(spec, cache, tokens_bt.shape[1], self.kv_len)
    bad_pos_bt = positions_bt < -1
    if capacity is not None:
      bad_pos_bt |= positions_bt >= capacity
    lengths_b = None
    if cache is not None:
      lengths_b = cache_lib.new_lengths(cache["lengths"], positions_bt)
    num_layers = spec.num_layers
    new_layer_caches, layer_aux = [None] * num_layers, [None] * num_layers
    moe_loss = jnp.float32(0.0)
    scan = spec.layer_scan
    unrolled = num_layers if scan is None else scan.unrolled
    block_cls = _remat(Block, spec.remat)

    def layer_inputs(i):
      return (None if cache is None else cache["layers"][i], lengths_b,
              None if replay is None else replay[i])

    for i in range(unrolled):
      x_btd, new_layer_caches[i], layer_aux[i], loss = block_cls(
          spec, i, self.kv_len, name=layer_stack.layer_name(i))(x_btd, positions_bt, *layer_inputs(i))
      moe_loss = moe_loss + loss
    stack_cache = None
    if scan is not None:
      group = nn.scan(LayerGroup, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, 0, 0, nn.broadcast), length=scan.repeats)
      (x_btd, moe_loss), (slot_aux, stack_cache) = group(spec, self.kv_len,
                                                         name=layer_stack.STACK)(
          (x_btd, moe_loss), positions_bt, _replay_by_slot(replay, scan),
          None if cache is None else cache[cache_lib.STACK], lengths_b)
      for j, aux in enumerate(slot_aux):  # [R, ...] per entry -> one dict per layer.
        for r in range(scan.repeats):
          layer_aux[scan.layer(j, r)] = {k: v[r] for k, v in aux.items()}
    x_btd = nn.RMSNorm(epsilon=spec.norm_eps, dtype=spec.dtype, param_dtype=spec.param_dtype,
                       name="final_norm")(x_btd)
    if self.hidden:
      logits_btv = jnp.where(bad_pos_bt[..., None], jnp.nan, x_btd)
    elif spec.tie_embeddings:
      dtype = jnp.dtype(spec.dtype)
      logits_btv = jnp.einsum("btd,vd->btv", x_btd.astype(dtype), embed.embedding.astype(dtype),
                              preferred_element_type=jnp.float32)
    else:
      logits_btv = nn.Dense(spec.vocab_size, use_bias=False, dtype=spec.dtype,
                            param_dtype=spec.param_dtype, dot_general=_dot_general_f32,
                            name="unembed")(x_btd)
    if not self.hidden:
      logits_btv = jnp.where(bad_pos_bt[..., None], jnp.nan, logits_btv.astype(jnp.float32))
    aux = {"layers": tuple(layer_aux), "moe_aux_loss": moe_loss}
    if spec.value_head:
      # The critic shares the trunk: one linear read-out of the final hidden state.
      aux["values"] = nn.Dense(1, dtype=jnp.float32, param_dtype=spec.param_dtype,
                               kernel_init=nn.initializers.zeros,
                               name="value_head")(x_btd.astype(jnp.float32))[..., 0]
    new_cache = None
    if cache is not None:
      new_cache = {"lengths": lengths_b, "layers": tuple(new_layer_caches[:unrolled])}
      if scan is not None:
        new_cache[cache_lib.STACK] = stack_cache
    return logits_btv, new_cache, aux


class Model:
  """A `ModelSpec` bound to its pure functions. Holds no weights."""

  def __init__(self, spec: ModelSpec):
    self.spec = spec
    self.module = Transformer(spec)

  def init(self, rng: jax.Array, out_shardings=None) -> dict[str, Any]:
    """Fresh params; with `out_shardings` (a tree of shardings, agentic_rl/parallel/mesh.py)
    each param is created directly in its shards, never whole on one device."""
    # Runs once, so skip LLVM's optimisations: that halves its compile time on CPU.
    compiled = jax.jit(self._init, out_shardings=out_shardings).lower(rng).compile(
        compiler_options={"xla_backend_optimization_level": 0})
    return compiled(rng)

  def _init(self, rng):
    tokens = jnp.zeros((1, self.spec.block_size), jnp.int32)
    positions = jnp.arange(self.spec.block_size, dtype=jnp.int32)[None]
    # The dispatch moves rows, not params: init on one row needs no mesh.
    spec = self.spec.replace(moe=self.spec.moe.replace(dispatch="dropless"))
    return Transformer(spec).init(rng, tokens, positions)["params"]

  def forward(self, params, tokens_bt, positions_bt, cache=None, replay: Replay | None = None,
              kv_len: int | None = None, hidden: bool = False):
    """See the module docstring. Concrete inputs are checked first (`check_inputs`);
    traced ones (under jit) are not, so a jitted caller pays nothing.

    kv_len (cached calls, static): attend over the cache's first kv_len positions only, a
    multiple of the block size that every fed position lies below; the cache is still
    written in place. Decode cost then follows the context, not the capacity.

    hidden (static): return the final-normed hidden states x_btd in place of the logits
    (NaN where the logits would be); logits = x_btd @ `readout_weights(params)`.T, which a
    caller may compute one vocabulary chunk at a time (agentic_rl/rl/chunked_logprobs.py)."""
    if kv_len is not None:
      if cache is None or kv_len % self.spec.block_size:
        raise ValueError(f"kv_len={kv_len}: a cached call's multiple of block_size="
                         f"{self.spec.block_size}.")
    if replay is not None and len(replay) != self.spec.num_layers:
      raise ValueError(f"replay has {len(replay)} layer entries; the model has "
                       f"{self.spec.num_layers} layers.")
    lengths_b = None if cache is None else cache["lengths"]
    if not any(isinstance(x, jax.core.Tracer) for x in (tokens_bt, positions_bt, lengths_b)):
      check_inputs(self.spec, tokens_bt, positions_bt, lengths_b=lengths_b,
                   capacity=position_capacity(self.spec, cache, np.shape(positions_bt)[-1],
                                              kv_len),
                   cached=cache is not None)
    module = self.module if kv_len is None and not hidden else Transformer(self.spec, kv_len,
                                                                          hidden)
    return module.apply({"params": params}, tokens_bt, positions_bt, cache, replay)

  def readout_weights(self, params) -> jax.Array:
    """w_vd: the read-out, one row per vocabulary entry (the tied embedding, or the
    transposed unembedding), in the params' dtype."""
    if self.spec.tie_embeddings:
      return params["embed"]["embedding"]
    return params["unembed"]["kernel"].T

  def readout(self, params, h_xd: jax.Array) -> jax.Array:
    """float32 logits [..., V] of final-normed hidden states (`forward(..., hidden=True)`),
    computed as `forward`'s read-out: in the model's dtype, accumulated in fp32. A caller
    that needs a few positions' logits reads out only those."""
    dtype = jnp.dtype(self.spec.dtype)
    return jnp.einsum("...d,vd->...v", h_xd.astype(dtype),
                      self.readout_weights(params).astype(dtype),
                      preferred_element_type=jnp.float32)

  def init_cache(self, batch_size: int, max_len: int | None = None) -> dict:
    return cache_lib.init_cache(self.spec, batch_size, max_len)

  def param_shapes(self) -> dict[str, Any]:
    """Parameter shapes and dtypes without allocating any weight."""
    return jax.eval_shape(self._init, jax.random.key(0))


def expert_overflow(layers_aux):
  """(dropped, routed) int32 expert assignments summed over a forward's layers
  (aux["layers"]), or None when no layer has a capacity (dropless dispatch)."""
  layers = [layer for layer in layers_aux if "dropped_assignments" in layer]
  if not layers:
    return None
  total = lambda key: sum(layer[key].astype(jnp.int32) for layer in layers)  # noqa: E731
  return total("dropped_assignments"), total("routed_assignments")


def replay_from_aux(aux: dict, *, experts: bool = True, blocks: bool = True) -> Replay:
  """The replay tuple that forces a forward's recorded routing and/or block selection."""
  keys = ([] if not experts else ["experts"]) + ([] if not blocks else ["blocks"])
  return tuple({k: layer[k] for k in keys if k in layer} for layer in aux["layers"])


# Time axis of each replay entry: experts [B, T, P], blocks [B, K, T, J].
REPLAY_TIME_AXIS = {"experts": 1, "blocks": 2}


def concat_replay_over_time(replays: list[Replay]) -> Replay:
  """Joins the replay of consecutive chunks (prefill, decode steps) into one sequence."""
  return tuple(
      {key: jnp.concatenate([r[i][key] for r in replays], axis=REPLAY_TIME_AXIS[key])
       for key in replays[0][i]}
      for i in range(len(replays[0])))


def update_routing_biases(params: dict, aux: dict, rate: float) -> dict:
  """Aux-loss-free balancing: nudges each MoE layer's routing bias toward even load.

  Applied by the learner outside the gradient, after each update. `params` in either
  layout (config.model.scan_layers): a scanned slot's [R, E] biases take their R layers'
  loads in one update, and nothing else in the tree is touched.
  """
  params = dict(params)
  scan = layer_stack.scan_of(params)
  loads = {i: layer["expert_load"] for i, layer in enumerate(aux["layers"])
           if "expert_load" in layer}
  unrolled = len(aux["layers"]) if scan is None else scan.unrolled
  for i in range(unrolled):
    name = layer_stack.layer_name(i)
    moe_params = params.get(name, {}).get("moe", {})
    if i not in loads or "routing_bias_e" not in moe_params:
      continue
    new_moe = dict(moe_params, routing_bias_e=moe_lib.update_routing_bias(
        moe_params["routing_bias_e"], loads[i], rate))
    params[name] = dict(params[name], moe=new_moe)
  if scan is None:
    return params
  slots = dict(params[layer_stack.STACK])
  for j in range(scan.period):
    name = layer_stack.slot_name(j)
    moe_params = slots[name].get("moe", {})
    layers = [scan.layer(j, r) for r in range(scan.repeats)]
    if "routing_bias_e" not in moe_params or any(i not in loads for i in layers):
      continue
    load_re = jnp.stack([loads[i] for i in layers])
    bias_re = jax.vmap(moe_lib.update_routing_bias, in_axes=(0, 0, None))(
        moe_params["routing_bias_e"], load_re, rate)
    slots[name] = dict(slots[name], moe=dict(moe_params, routing_bias_e=bias_re))
  params[layer_stack.STACK] = slots
  return params
