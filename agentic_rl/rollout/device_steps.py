"""The engine's device functions: prefill, decode and fork, all over one jitted `model.forward`.

There is no second inference implementation. `forward_and_sample` is
`model.forward` on a chunk of positions per row (cache donated) followed by
one draw after each row's last valid position:

  * decode  = forward_and_sample on every slot row, one position each
              (-1 for a slot that sits the step out);
  * prefill = gather the P rows being prefilled, forward_and_sample a chunk
              of C positions each (-1 padding at the end of short rows),
              scatter them back; the cost is that of P rows, whatever the
              cache size, and one compiled forward serves both the slot
              cache and the prompt store;
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
  """What one forward_and_sample call returns."""
  sampled: sampling.Sampled  # One draw per row (after the row's last valid position).
  replay: Any  # model.forward's routing/blocks for the call's input positions.
  last_logits_bv: jax.Array  # float32 [B, V] logits at each row's last valid position.
  # int32 [2]: expert assignments dropped over capacity and routed, summed over the MoE
  # layers (expert-parallel dispatch; zeros when nothing has a capacity).
  overflow: jax.Array


jax.tree_util.register_dataclass(
    StepOutput, data_fields=["sampled", "replay", "last_logits_bv", "overflow"],
    meta_fields=[])


def overflow_counts(aux: dict) -> jax.Array:
  """int32 [2]: (dropped, routed) expert assignments summed over a forward's layers."""
  counts = transformer.expert_overflow(aux["layers"])
  return jnp.zeros(2, jnp.int32) if counts is None else jnp.stack(counts)


class DeviceSteps:
  """Jitted, cache-donating steps of one model with one sampling setting and chunk size.

  One instance may serve several engines (same model, sampling and chunk);
  its compiled functions are then shared.
  """

  def __init__(self, model: transformer.Model, sampling_params: sampling.SamplingParams,
               chunk: int, mesh: Mesh | None = None):
    self.model = model
    self.sampling_params = sampling_params
    self.chunk = chunk
    self.mesh = mesh
    self.trace_counts: collections.Counter[str] = collections.Counter()
    self.forward_and_sample = self._on_mesh(jax.jit(self._forward_and_sample,
                                                    donate_argnums=(1,)))
    self.gather_rows = self._on_mesh(jax.jit(self._gather_rows))
    self.scatter_rows = self._on_mesh(jax.jit(self._scatter_rows, donate_argnums=(0,)))
    self.fork = self._on_mesh(jax.jit(self._fork, donate_argnums=(0,)))
    self.reset_rows = self._on_mesh(jax.jit(self._reset_rows, donate_argnums=(0,)))

  def _on_mesh(self, fn):
    if self.mesh is None:
      return fn

    @functools.wraps(fn)
    def call(*args):
      with jax.set_mesh(self.mesh):
        return fn(*args)
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

  def decode(self, params, cache, tokens_b, positions_b, seeds_b, forced_b, lengths_b=None):
    """Feeds one token per row at `positions_b` (-1: sits out) and draws the next.

    Host (numpy) inputs are reshaped and checked on the host: no extra device op per
    step. lengths_b: the caller's host record of each row's cache length, to check
    that every row feeds its next position.
    """
    tokens_bt, positions_bt = tokens_b.reshape(-1, 1), positions_b.reshape(-1, 1)
    self.check_inputs(cache, tokens_bt, positions_bt, forced_b, lengths_b)
    return self.forward_and_sample(params, cache, tokens_bt, positions_bt, seeds_b, forced_b)

  def prefill(self, params, cache, rows_p, tokens_pc, positions_pc, seeds_p, forced_p,
              lengths_p=None):
    """Appends one chunk to each of the distinct rows `rows_p`; all -1 rows sit out.

    lengths_p: the caller's host record of the cache lengths of rows `rows_p`."""
    if tokens_pc.shape[1] != self.chunk:
      raise ValueError(f"prefill chunk has {tokens_pc.shape[1]} tokens; these steps "
                       f"compile chunks of {self.chunk} (pad with position -1).")
    self.check_inputs(cache, tokens_pc, positions_pc, forced_p, lengths_p)
    sub = self.gather_rows(cache, rows_p)
    sub, out = self.forward_and_sample(params, sub, tokens_pc, positions_pc, seeds_p, forced_p)
    return self.scatter_rows(cache, rows_p, sub), out

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
      b = int(np.argmax(bad))
      raise ValueError(f"forced token id {forced_b[b]} at row {b} is outside the "
                       f"vocabulary [0, {vocab}) (-1: draw).")

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

  def _forward_and_sample(self, params, cache, tokens_bt, positions_bt, seeds_b, forced_b):
    self.trace_counts["forward_and_sample"] += 1
    logits_btv, cache, aux = self.model.forward(params, tokens_bt, positions_bt, cache)
    last_b = jnp.maximum(jnp.sum(positions_bt >= 0, axis=1) - 1, 0)
    last_logits_bv = jnp.take_along_axis(logits_btv, last_b[:, None, None], axis=1)[:, 0]
    last_pos_b = jnp.take_along_axis(positions_bt, last_b[:, None], axis=1)[:, 0]
    keys_b = sampling.trajectory_keys(seeds_b, last_pos_b + 1)
    sampled = sampling.sample(last_logits_bv, keys_b, self.sampling_params, forced_b)
    return self._keep_sharded(cache), StepOutput(
        sampled, transformer.replay_from_aux(aux), last_logits_bv, overflow_counts(aux))

  def _gather_rows(self, cache, rows):
    self.trace_counts["gather_rows"] += 1
    return self._keep_sharded(cache_lib.gather_sequences(cache, rows))

  def _scatter_rows(self, cache, rows, sub):
    self.trace_counts["scatter_rows"] += 1
    return self._keep_sharded(cache_lib.scatter_sequences(cache, rows, sub))

  def _reset_rows(self, cache, reset_b):
    self.trace_counts["reset_rows"] += 1
    return self._keep_sharded(cache_lib.reset_sequences(cache, reset_b))
