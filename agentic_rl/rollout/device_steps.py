"""The engine's device functions: jitted prefill, decode and fork, all over `model.forward`.

There is no second inference implementation: prefill is `model.forward` on a
chunk of positions, decode is `model.forward` on one position per slot, both
with the cache donated. Shapes are fixed (rows per call, chunk size, slot
count), so after the first call of each nothing recompiles during a run;
`trace_counts` counts traces so tests can check it.

    steps = DeviceSteps(model, SamplingParams(temperature=1.0, top_k=50), chunk=256)
    cache, out = steps.prefill(params, cache, rows_p, tokens_pc, positions_pc, seeds_p, forced_p)
    cache, out = steps.decode(params, cache, tokens_b, positions_b, seeds_b, forced_b)
    cache, sampled = steps.fork(cache, store, src_row, dst_row, logits_v, seed, position, forced)

Sampling keys: the token drawn after position p of a trajectory with seed s
uses fold_in(key(s), p + 1), whichever call (prefill, decode, fork) draws it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from agentic_rl.model import cache as cache_lib
from agentic_rl.model import transformer
from agentic_rl.rollout import sampling


@dataclasses.dataclass(frozen=True)
class StepOutput:
  """What one prefill or decode call returns to the host."""
  sampled: sampling.Sampled  # One draw per row (after the row's last valid position).
  replay: Any  # model.forward's routing/blocks for the call's input positions.
  last_logits_bv: jax.Array  # float32 [B, V] logits at each row's last valid position.


jax.tree_util.register_dataclass(StepOutput, data_fields=["sampled", "replay", "last_logits_bv"],
                                 meta_fields=[])


class DeviceSteps:
  """Jitted, cache-donating steps of one model with one sampling setting."""

  def __init__(self, model: transformer.Model, sampling_params: sampling.SamplingParams,
               chunk: int):
    self.model = model
    self.sampling_params = sampling_params
    self.chunk = chunk
    self.trace_counts: collections.Counter[str] = collections.Counter()
    self.prefill = jax.jit(self._prefill, donate_argnums=(1,))
    self.decode = jax.jit(self._decode, donate_argnums=(1,))
    self.fork = jax.jit(self._fork, donate_argnums=(0,))
    self.reset_rows = jax.jit(self._reset_rows, donate_argnums=(0,))

  @property
  def num_traces(self) -> int:
    return sum(self.trace_counts.values())

  def _sample_after(self, logits_bv, positions_b, seeds_b, forced_b):
    keys_b = sampling.trajectory_keys(seeds_b, positions_b + 1)
    return sampling.sample(logits_bv, keys_b, self.sampling_params, forced_b)

  def _prefill(self, params, cache, rows_p, tokens_pc, positions_pc, seeds_p, forced_p):
    """Appends one chunk per row `rows_p` of `cache`; rows of all -1 positions sit out.

    The rows are gathered, run through model.forward and scattered back, so
    the cost is that of P rows whatever the cache's size. `rows_p` must be
    distinct. Returns the draw after each row's last valid position.
    """
    self.trace_counts["prefill"] += 1
    if tokens_pc.shape[1] != self.chunk:
      raise ValueError(f"prefill chunk has {tokens_pc.shape[1]} tokens; this engine "
                       f"compiles chunks of {self.chunk} (pad with position -1).")
    sub = cache_lib.gather_sequences(cache, rows_p)
    logits_pcv, sub, aux = self.model.forward(params, tokens_pc, positions_pc, sub)
    cache = cache_lib.scatter_sequences(cache, rows_p, sub)
    last_p = jnp.maximum(jnp.sum(positions_pc >= 0, axis=1) - 1, 0)
    last_logits_pv = jnp.take_along_axis(logits_pcv, last_p[:, None, None], axis=1)[:, 0]
    last_pos_p = jnp.take_along_axis(positions_pc, last_p[:, None], axis=1)[:, 0]
    sampled = self._sample_after(last_logits_pv, last_pos_p, seeds_p, forced_p)
    return cache, StepOutput(sampled, transformer.replay_from_aux(aux), last_logits_pv)

  def _decode(self, params, cache, tokens_b, positions_b, seeds_b, forced_b):
    """Feeds one token per slot at `positions_b` (-1: the slot sits out) and draws the next."""
    self.trace_counts["decode"] += 1
    logits_b1v, cache, aux = self.model.forward(params, tokens_b[:, None], positions_b[:, None],
                                                cache)
    sampled = self._sample_after(logits_b1v[:, 0], positions_b, seeds_b, forced_b)
    return cache, StepOutput(sampled, transformer.replay_from_aux(aux), logits_b1v[:, 0])

  def _fork(self, cache, store, src_row, dst_row, logits_v, seed, position, forced):
    """Copies prompt-store row `src_row` into slot `dst_row` and draws the slot's first token.

    `logits_v` are the prompt's last logits, `position` the prompt's last position.
    """
    self.trace_counts["fork"] += 1
    row = cache_lib.gather_sequences(store, src_row[None])
    cache = cache_lib.scatter_sequences(cache, dst_row[None], row)
    sampled = self._sample_after(logits_v[None], position[None], seed[None], forced[None])
    return cache, sampled

  def _reset_rows(self, cache, reset_b):
    self.trace_counts["reset_rows"] += 1
    return cache_lib.reset_sequences(cache, reset_b)
