"""The engine's device functions: prefill, decode and fork, all over one jitted `model.forward`.

There is no second inference implementation. `forward_and_draw` is
`model.forward` on a chunk of positions per row (cache donated) followed by
one draw after each row's last valid position:

  * decode  = up to N steps of forward-and-draw on every slot row in one
              jitted `lax.while_loop`, each feeding a row the token it drew the
              step before (N = the forced ids' width: config.rollout.
              decode_steps_per_call). A row stops on a stop id or when it has
              drawn its `budget_b` tokens (its turn's or trajectory's budget: 0
              feeds one last token, a flush), and the loop ends when every row
              has stopped or after N steps: the host sees the tokens, log-probs,
              masks and replay of every step at once, not one round trip each;
  * prefill = one jitted call (cache donated): gather the P rows being
              prefilled, cut to the attend length, forward_and_draw a chunk
              of C positions each (-1 padding at the end of short rows), and
              scatter them back; the cost is that of P rows, whatever the
              cache size. The read-out runs only at each row's last valid
              position, the one that draws;
  * fork    = copy a prompt-store row into a slot row and draw the slot's
              first token from the prompt's last logits.

On a mesh (the engine's `mesh`: parallel/placement.sampler_mesh) the params come with the
learner's shardings, every cache is born and kept sharded by the rules (rows over the
batch axes, kv heads over tensor: parallel/rules.cache_specs), and each call runs under
`jax.set_mesh`, which the expert-parallel MoE dispatch needs.

Shapes are fixed (slots, P, C), so after the first call of each nothing
recompiles during a run; `trace_counts` counts traces (one per compilation).

Sampling keys: the token drawn after position p of a trajectory with seed s
uses fold_in(key(s), p + 1), whichever call (prefill, decode, fork) draws it.

Input checks: inside jit `model.forward` cannot raise, so `decode` and
`prefill` check host (numpy) ids and positions before dispatch
(`transformer.check_inputs`: ids in the vocabulary, positions below the
cache capacity, and, given the caller's host record of the cache lengths,
each row's next positions). That reads no device value: the engine keeps
the lengths on the host. Device arrays are passed through unchecked.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from agentic_rl.model import cache as cache_lib
from agentic_rl.model import transformer
from agentic_rl.parallel import rules
from agentic_rl.rollout import sampling


@dataclasses.dataclass(frozen=True)
class StepOutput:
  """What one forward_and_draw call returns."""
  sampled: sampling.Sampled  # One draw per row (after the row's last valid position).
  replay: Any  # model.forward's routing/blocks for the call's input positions.
  last_logits_bv: jax.Array  # float32 [B, V] logits at each row's last valid position.
  # int32 [2]: expert assignments dropped over capacity and routed, summed over the MoE
  # layers (expert-parallel dispatch; zeros when nothing has a capacity).
  overflow: jax.Array


jax.tree_util.register_dataclass(
    StepOutput, data_fields=["sampled", "replay", "last_logits_bv", "overflow"],
    meta_fields=[])


@dataclasses.dataclass(frozen=True)
class DecodeOutput:
  """What one decode call returns: N steps' draws, step n at index n (rows that had
  stopped hold what the step drew for them anyway: ignore past `drawn_b`)."""
  tokens_nb: jax.Array  # int32 [N, B]
  logp_nb: jax.Array  # float32 [N, B]
  mask_nbw: jax.Array  # uint8 [N, B, W]
  replay: Any  # Per layer, the replay of the N fed positions (time axis N).
  drawn_b: jax.Array  # int32 [B]: tokens row b fed and drew (0 for a row that sat out).
  steps: jax.Array  # int32: steps the loop ran.
  overflow: jax.Array  # int32 [2], as StepOutput's, summed over the steps.


jax.tree_util.register_dataclass(
    DecodeOutput, data_fields=["tokens_nb", "logp_nb", "mask_nbw", "replay", "drawn_b",
                               "steps", "overflow"], meta_fields=[])


def overflow_counts(aux: dict) -> jax.Array:
  """int32 [2]: (dropped, routed) expert assignments summed over a forward's layers."""
  counts = transformer.expert_overflow(aux["layers"])
  return jnp.zeros(2, jnp.int32) if counts is None else jnp.stack(counts)


def attend_length(block_size: int, positions: int, capacity: int | None) -> int | None:
  """The cache length a call that writes below `positions` attends over: a power of two
  times the block size (few shapes to compile), or None for the whole capacity."""
  if capacity is None:
    return None
  length = block_size
  while length < positions:
    length *= 2
  return None if length >= capacity else length


class DeviceSteps:
  """Jitted, cache-donating steps of one model with one sampling setting and set of
  prefill chunk sizes.

  One instance may serve several engines (same model, sampling and chunks);
  its compiled functions are then shared.
  """

  def __init__(self, model: transformer.Model, sampling_params: sampling.SamplingParams,
               chunks: int | tuple[int, ...], mesh: Mesh | None = None):
    self.model = model
    self.sampling_params = sampling_params
    self.chunks = tuple(sorted({chunks} if isinstance(chunks, int) else set(chunks)))
    self.mesh = mesh
    self.trace_counts: collections.Counter[str] = collections.Counter()
    self.prefill_rows = self._on_mesh(jax.jit(self._prefill_rows, donate_argnums=(1,),
                                              static_argnames=("attend",)))
    self.decode_loop = self._on_mesh(jax.jit(self._decode_loop, donate_argnums=(1,),
                                             static_argnames=("attend",)))
    self.fork = self._on_mesh(jax.jit(self._fork, donate_argnums=(0,)))
    self.reset_rows = self._on_mesh(jax.jit(self._reset_rows, donate_argnums=(0,)))

  @property
  def chunk(self) -> int:
    """The largest prefill chunk these steps compile."""
    return self.chunks[-1]

  def _on_mesh(self, fn):
    if self.mesh is None:
      return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
      with jax.set_mesh(self.mesh):
        return fn(*args, **kwargs)
    return call

  def init_cache(self, rows: int, max_len: int):
    """An empty cache of `rows` sequences, born in its shards on the mesh."""
    make = lambda: self.model.init_cache(rows, max_len)  # noqa: E731
    if self.mesh is None:
      return make()
    return jax.jit(make, out_shardings=self._cache_shardings(jax.eval_shape(make)))()

  def _cache_shardings(self, cache):
    return rules.named(self.mesh, rules.cache_specs(cache, rules.mesh_sizes(self.mesh)))

  def _keep_sharded(self, cache):
    """Pins a returned cache to the rules' shardings, so every call sees the same input
    shardings (no recompiles) and donation reuses the buffers."""
    if self.mesh is None:
      return cache
    return jax.lax.with_sharding_constraint(cache, self._cache_shardings(cache))

  @property
  def num_traces(self) -> int:
    return sum(self.trace_counts.values())

  # -- composite steps (host-side sequencing of the jitted pieces) ---------------------------

  def decode(self, params, cache, tokens_b, positions_b, seeds_b, forced_bn, lengths_b=None,
             *, budget_b=None, is_stop_v=None, max_steps=None):
    """Feeds one token per row at `positions_b` (-1: sits out), draws the next, and goes
    on feeding each row its draw for up to N steps (see the module docstring).

    forced_bn: int32 [B, N] teacher ids per step (-1: draw), or [B] for one step.
    budget_b: tokens each row may draw (default 1); is_stop_v: bool [V], the ids that end
    a row's turn (default none); max_steps: at most this many steps (default N; a value,
    not a shape: no recompile). Host (numpy) inputs are checked on the host: no extra
    device op. lengths_b: the caller's host record of each row's cache length, to check
    that every row feeds its next position.
    """
    forced_bn = forced_bn.reshape(forced_bn.shape[0], -1)
    self.check_inputs(cache, tokens_b.reshape(-1, 1), positions_b.reshape(-1, 1), forced_bn,
                      lengths_b)
    if budget_b is None:
      budget_b = np.ones(tokens_b.shape[0], np.int32)
    if is_stop_v is None:
      is_stop_v = np.zeros(self.model.spec.vocab_size, bool)
    max_steps = forced_bn.shape[1] if max_steps is None else min(max_steps, forced_bn.shape[1])
    attend = None
    if lengths_b is not None and isinstance(positions_b, np.ndarray):
      fed = positions_b >= 0
      attend = self.attend_length(cache, int(np.max(lengths_b[fed], initial=0)) + max_steps)
    return self.decode_loop(params, cache, tokens_b, positions_b, seeds_b, forced_bn,
                            budget_b, is_stop_v, np.int32(max_steps), attend=attend)

  def attend_length(self, cache, positions: int) -> int | None:
    """The cache length a call that writes below `positions` reads (decode: kv_len) or
    copies (prefill: the rows gathered); see `attend_length`."""
    return attend_length(self.model.spec.block_size, positions, cache_lib.capacity(cache))

  def attend_lengths(self, cache) -> list[int | None]:
    """Every length `attend_length` can pick for `cache`."""
    capacity = cache_lib.capacity(cache)
    lengths, length = [], self.model.spec.block_size
    while capacity is not None and length < capacity:
      lengths.append(length)
      length *= 2
    return lengths + [None]

  def warm_up(self, params, cache, *, prefill_rows: int | tuple[int, ...],
              decode_steps: int | None = None):
    """Runs every shape of call a run can make on `cache` once, each row sitting out
    (positions -1: nothing written, nothing drawn): a prefill of each of `prefill_rows`
    rows by each chunk size and, with `decode_steps`, a decode of that many steps per call,
    at every attend length. The compiles happen here, not mid-run. Returns the cache
    (donated through, unchanged)."""
    rows = int(cache["lengths"].shape[0])
    row_counts = (prefill_rows,) if isinstance(prefill_rows, int) else tuple(prefill_rows)
    for attend in self.attend_lengths(cache):
      for p in row_counts:
        rows_p = np.arange(p, dtype=np.int32) % max(rows, 1)
        seeds_p, forced_p = np.zeros(p, np.uint32), np.full(p, -1, np.int32)
        for chunk in self.chunks:
          tokens_pc = np.zeros((p, chunk), np.int32)
          positions_pc = np.full((p, chunk), -1, np.int32)
          cache, _ = self.prefill_rows(params, cache, rows_p, tokens_pc, positions_pc, seeds_p,
                                       forced_p, attend=attend)
      if decode_steps:
        cache, _ = self.decode_loop(
            params, cache, np.zeros(rows, np.int32), np.full(rows, -1, np.int32),
            np.zeros(rows, np.uint32), np.full((rows, decode_steps), -1, np.int32),
            np.zeros(rows, np.int32), np.zeros(self.model.spec.vocab_size, bool), np.int32(0),
            attend=attend)
    return cache

  def prefill(self, params, cache, rows_p, tokens_pc, positions_pc, seeds_p, forced_p,
              lengths_p=None):
    """Appends one chunk to each of the distinct rows `rows_p`; all -1 rows sit out.

    lengths_p: the caller's host record of the cache lengths of rows `rows_p`."""
    if tokens_pc.shape[1] not in self.chunks:
      raise ValueError(f"prefill chunk has {tokens_pc.shape[1]} tokens; these steps "
                       f"compile chunks of {self.chunks} (pad with position -1).")
    self.check_inputs(cache, tokens_pc, positions_pc, forced_p, lengths_p)
    attend = None
    if lengths_p is not None:
      attend = self.attend_length(cache, int(np.max(lengths_p, initial=0)) + tokens_pc.shape[1])
    return self.prefill_rows(params, cache, rows_p, tokens_pc, positions_pc, seeds_p, forced_p,
                             attend=attend)

  def check_inputs(self, cache, tokens_bt, positions_bt, forced_b, lengths_b=None) -> None:
    """Raises ValueError on a bad id, forced id or position in host (numpy) inputs."""
    if not (isinstance(tokens_bt, np.ndarray) and isinstance(positions_bt, np.ndarray)):
      return  # Reading device arrays back would wait for the device.
    transformer.check_inputs(self.model.spec, tokens_bt, positions_bt, lengths_b=lengths_b,
                             capacity=cache_lib.capacity(cache))
    if isinstance(forced_b, np.ndarray):
      self.check_forced(forced_b)

  def check_forced(self, forced_b: np.ndarray) -> None:
    """Forced (teacher) ids must be in the vocabulary, or -1 (draw)."""
    vocab = self.model.spec.vocab_size
    bad = (forced_b < -1) | (forced_b >= vocab)
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      step = f", step {where[1]}" if len(where) > 1 and forced_b.shape[1] > 1 else ""
      raise ValueError(f"forced token id {forced_b[where]} at row {where[0]}{step} is "
                       f"outside the vocabulary [0, {vocab}) (-1: draw).")

  # -- jitted bodies ------------------------------------------------------------------------

  def _fork(self, cache, store, src_row, dst_row, logits_v, seed, position, forced):
    """Copies store row `src_row` into cache row `dst_row` and draws that row's first token.

    `logits_v` are the prompt's last logits, `position` the prompt's last position.
    The copy replaces the whole row (lengths, rings, full buffers), so the slot
    needs no reset first.
    """
    self.trace_counts["fork"] += 1
    row = cache_lib.gather_sequences(store, src_row[None])
    cache = self._keep_sharded(cache_lib.scatter_sequences(cache, dst_row[None], row))
    keys_b = sampling.trajectory_keys(seed[None], position[None] + 1)
    return cache, sampling.sample(logits_v[None], keys_b, self.sampling_params, forced[None])

  def _prefill_rows(self, params, cache, rows_p, tokens_pc, positions_pc, seeds_p, forced_p,
                    attend=None):
    """Rows `rows_p` of the cache, their full buffers cut to `attend` positions (None: all),
    take one chunk each; the cache comes back with them written in."""
    self.trace_counts["prefill_rows"] += 1
    full = cache
    if attend is not None:
      cache = cache_lib.head(cache, attend)
    sub = self._keep_sharded(cache_lib.gather_sequences(cache, rows_p))
    sub, out = self._forward_and_draw(params, sub, tokens_pc, positions_pc, seeds_p, forced_p)
    return self._keep_sharded(cache_lib.scatter_sequences(full, rows_p, sub)), out

  def _forward_and_draw(self, params, cache, tokens_bt, positions_bt, seeds_b, forced_b,
                        kv_len=None):
    """The forward on a chunk per row, then one draw after each row's last valid position:
    the body of prefill and of every decode step."""
    h_btd, cache, aux = self.model.forward(params, tokens_bt, positions_bt, cache,
                                           kv_len=kv_len, hidden=True)
    last_b = jnp.maximum(jnp.sum(positions_bt >= 0, axis=1) - 1, 0)
    # Only the drawing position needs logits: the read-out is ~1/3 of a small model's
    # per-token FLOPs, and a prefill chunk has C positions per row.
    last_h_bd = jnp.take_along_axis(h_btd, last_b[:, None, None], axis=1)[:, 0]
    last_logits_bv = self.model.readout(params, last_h_bd)
    last_pos_b = jnp.take_along_axis(positions_bt, last_b[:, None], axis=1)[:, 0]
    keys_b = sampling.trajectory_keys(seeds_b, last_pos_b + 1)
    sampled = sampling.sample(last_logits_bv, keys_b, self.sampling_params, forced_b)
    return self._keep_sharded(cache), StepOutput(
        sampled, transformer.replay_from_aux(aux), last_logits_bv, overflow_counts(aux))

  def _decode_loop(self, params, cache, tokens_b, positions_b, seeds_b, forced_bn, budget_b,
                   is_stop_v, max_steps, attend=None):
    self.trace_counts["decode_loop"] += 1
    n = forced_bn.shape[1]

    def step(cache, tokens_b, positions_b, forced_b):
      cache, out = self._forward_and_draw(params, cache, tokens_b[:, None],
                                          positions_b[:, None], seeds_b, forced_b, attend)
      return cache, out.sampled, out.replay, out.overflow

    shapes = jax.eval_shape(step, cache, tokens_b, positions_b, forced_bn[:, 0])[1:3]
    # Per-step outputs stacked over a leading step axis, written at step i.
    records = jax.tree.map(lambda x: jnp.zeros((n,) + x.shape, x.dtype), shapes)
    active_b = positions_b >= 0
    init = (jnp.int32(0), cache, tokens_b.astype(jnp.int32), positions_b.astype(jnp.int32),
            active_b, jnp.zeros_like(budget_b, jnp.int32), records, jnp.zeros(2, jnp.int32))

    def cond(carry):
      i, _, _, _, active_b, _, _, _ = carry
      return (i < max_steps) & jnp.any(active_b)

    def body(carry):
      i, cache, tokens_b, positions_b, active_b, drawn_b, records, overflow = carry
      fed_b = jnp.where(active_b, positions_b, -1)
      cache, sampled, replay, step_overflow = step(cache, tokens_b, fed_b, forced_bn[:, i])
      records = jax.tree.map(lambda buf, x: buf.at[i].set(x), records, (sampled, replay))
      drawn_b = drawn_b + active_b
      stop_b = is_stop_v[sampled.tokens_b] | (drawn_b >= budget_b)
      active_b = active_b & ~stop_b
      return (i + 1, cache, sampled.tokens_b, positions_b + 1, active_b, drawn_b, records,
              overflow + step_overflow)

    steps, cache, _, _, _, drawn_b, (sampled, replay), overflow = jax.lax.while_loop(
        cond, body, init)
    # [N, B, ..., 1, ...] per replay entry -> the forward's layout with time axis N.
    replay = tuple(
        {k: jnp.moveaxis(jnp.squeeze(v, transformer.REPLAY_TIME_AXIS[k] + 1), 0,
                         transformer.REPLAY_TIME_AXIS[k]) for k, v in layer.items()}
        for layer in replay)
    return cache, DecodeOutput(sampled.tokens_b, sampled.logp_b, sampled.mask_bw, replay,
                               drawn_b, steps, overflow)

  def _reset_rows(self, cache, reset_b):
    self.trace_counts["reset_rows"] += 1
    return self._keep_sharded(cache_lib.reset_sequences(cache, reset_b))
