"""The learner's batch: what the rollout engine records, as one pytree.

Shapes: B sequences (trajectories) of T padded tokens, V vocabulary, W =
ceil(V / 8) packed mask bytes.

Alignment. Arrays named *_bt that describe a sampled token are *target
aligned*: entry [b, t] is about token tokens_bt[b, t], which the sampler drew
from the logits computed at position t - 1. So loss_mask_bt[:, 0] is always 0,
sampler_logp_bt[b, t] = log p_sampler(tokens_bt[b, t] | tokens_bt[b, :t]), and
sampling_mask_btw[b, t] is the support of that distribution.

Fields:
  tokens_bt          int32 [B, T]   prompt, model and environment tokens, padded.
  positions_bt       int32 [B, T]   0, 1, ... per sequence; -1 on padding.
  loss_mask_bt       float32 [B, T] 1 on model-generated tokens, 0 on prompt,
                                    environment (tool output) and padding.
  sampler_logp_bt    float32 [B, T] the sampler's log-prob of each generated token
                                    (under its temperature and sampling mask).
  turn_index_bt      int32 [B, T]   0-based turn of each token.
  rewards_b          float32 [B]    outcome reward of each trajectory.
  group_id_b         int32 [B]      trajectories of one task share an id (group baselines).
  process_reward_bt  float32 [B, T] per-turn process signals from the environment,
                                    placed at the last generated token of the turn
                                    (anywhere in the turn works for 'turn_level';
                                    'gae' credits it to the action it follows).
  temperature_b      float32 [B]    the sampling temperature; the learner divides
                                    its logits by it so both score the same distribution.
  replay             optional tuple, one dict per layer, as the model's aux["layers"]:
                                    MoE layers 'experts' int32 [B, T, P], sparse layers
                                    'blocks' int32 [B, K, T, J] (-1 = unused slot). The
                                    routing/blocks the sampler used at each input position.
  sampling_mask_btw  optional uint8 [B, T, W] packed top-k/top-p support (sampling_mask.py).
  old_logp_bt        optional float32 [B, T] the learner's log-probs before this round
                                    of updates (for several epochs over one batch).
  old_values_bt      optional float32 [B, T] the critic's target-aligned values before
                                    this round (GAE and value clipping); see below.
  ref_logp_bt        optional float32 [B, T] frozen reference log-probs, if precomputed.

Value alignment: values_bt[b, t] is V(state before token t), i.e. the value head's
output at position t - 1, like the logits that scored token t.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.records import sampling_mask as sampling_mask_lib


@flax.struct.dataclass
class Batch:
  tokens_bt: jax.Array
  positions_bt: jax.Array
  loss_mask_bt: jax.Array
  sampler_logp_bt: jax.Array
  turn_index_bt: jax.Array
  rewards_b: jax.Array
  group_id_b: jax.Array
  process_reward_bt: jax.Array
  temperature_b: jax.Array
  replay: Any = None
  sampling_mask_btw: jax.Array | None = None
  old_logp_bt: jax.Array | None = None
  old_values_bt: jax.Array | None = None
  ref_logp_bt: jax.Array | None = None

  @property
  def batch_size(self) -> int:
    return self.tokens_bt.shape[0]

  @property
  def length(self) -> int:
    return self.tokens_bt.shape[1]

  def truncated(self, length: int) -> Batch:
    """The first `length` token positions of every row: each per-token field cut on its
    token axis (replay 'blocks' [B, K, T, J] on axis 2, the rest on axis 1). Only for rows
    that end by `length`: their later positions are padding, which the learner ignores."""
    if not 0 < length <= self.length:
      raise ValueError(f"Batch.truncated({length}): expected a length in [1, {self.length}].")
    if length == self.length:
      return self
    cut = lambda x, axis=1: None if x is None else jax.lax.slice_in_dim(x, 0, length, axis=axis)
    replay = None if self.replay is None else tuple(
        {name: cut(x, 2 if name == "blocks" else 1) for name, x in layer.items()}
        for layer in self.replay)
    return self.replace(
        tokens_bt=cut(self.tokens_bt), positions_bt=cut(self.positions_bt),
        loss_mask_bt=cut(self.loss_mask_bt), sampler_logp_bt=cut(self.sampler_logp_bt),
        turn_index_bt=cut(self.turn_index_bt), process_reward_bt=cut(self.process_reward_bt),
        replay=replay, sampling_mask_btw=cut(self.sampling_mask_btw),
        old_logp_bt=cut(self.old_logp_bt), old_values_bt=cut(self.old_values_bt),
        ref_logp_bt=cut(self.ref_logp_bt))


def make_batch(tokens_bt, positions_bt, loss_mask_bt, sampler_logp_bt, rewards_b, group_id_b,
               *, turn_index_bt=None, process_reward_bt=None, temperature=1.0, replay=None,
               sampling_mask_btw=None, old_logp_bt=None, old_values_bt=None,
               ref_logp_bt=None) -> Batch:
  """A `Batch` with dtypes fixed and defaults filled (one turn, no process reward)."""
  tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
  b, t = tokens_bt.shape
  f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
  temperature_b = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
  batch = Batch(
      tokens_bt=tokens_bt,
      positions_bt=jnp.asarray(positions_bt, jnp.int32),
      loss_mask_bt=f32(loss_mask_bt),
      sampler_logp_bt=f32(sampler_logp_bt),
      turn_index_bt=(jnp.zeros((b, t), jnp.int32) if turn_index_bt is None
                     else jnp.asarray(turn_index_bt, jnp.int32)),
      rewards_b=f32(rewards_b),
      group_id_b=jnp.asarray(group_id_b, jnp.int32),
      process_reward_bt=(jnp.zeros((b, t), jnp.float32) if process_reward_bt is None
                         else f32(process_reward_bt)),
      temperature_b=temperature_b,
      replay=None if replay is None else jax.tree.map(
          lambda x: jnp.asarray(x, jnp.int32), tuple(dict(l) for l in replay)),
      sampling_mask_btw=(None if sampling_mask_btw is None
                         else jnp.asarray(sampling_mask_btw, jnp.uint8)),
      old_logp_bt=f32(old_logp_bt), old_values_bt=f32(old_values_bt),
      ref_logp_bt=f32(ref_logp_bt))
  return batch


def check_batch(batch: Batch, model_spec, rl_spec=None) -> None:
  """Raises ValueError naming the first field whose shape, dtype or content is wrong.

  Host-side (reads values); call it on batches from outside before training.
  """
  b, t = batch.tokens_bt.shape

  def need(ok, field, what):
    if not ok:
      raise ValueError(f"Batch.{field}: {what}.")

  need(jnp.issubdtype(batch.tokens_bt.dtype, jnp.integer), "tokens_bt",
       f"expected int32 token ids, got dtype {batch.tokens_bt.dtype}")
  for field in ("positions_bt", "loss_mask_bt", "sampler_logp_bt", "turn_index_bt",
                "process_reward_bt", "old_logp_bt", "old_values_bt", "ref_logp_bt"):
    x = getattr(batch, field)
    if x is None:
      continue
    need(x.shape == (b, t), field, f"shape {x.shape}, expected {(b, t)} like tokens_bt")
  for field in ("rewards_b", "group_id_b", "temperature_b"):
    x = getattr(batch, field)
    need(x.shape == (b,), field, f"shape {x.shape}, expected {(b,)}")
  tokens = np.asarray(batch.tokens_bt)
  need(((tokens >= 0) & (tokens < model_spec.vocab_size)).all(), "tokens_bt",
       f"ids must lie in [0, vocab_size={model_spec.vocab_size})")
  pos = np.asarray(batch.positions_bt)
  need((pos < model_spec.max_seq_len).all(), "positions_bt",
       f"positions must stay below model.max_seq_len={model_spec.max_seq_len}")
  mask = np.asarray(batch.loss_mask_bt)
  need(np.isin(mask, (0.0, 1.0)).all(), "loss_mask_bt", "entries must be 0 or 1")
  need((mask[:, 0] == 0).all(), "loss_mask_bt",
       "column 0 must be 0 (the first token has no logits to score it)")
  need((mask[pos < 0] == 0).all(), "loss_mask_bt", "padding (position -1) must have mask 0")
  need(np.isfinite(np.asarray(batch.sampler_logp_bt)[mask > 0]).all(), "sampler_logp_bt",
       "must be finite on generated tokens")
  need((np.asarray(batch.sampler_logp_bt)[mask > 0] <= 1e-6).all(), "sampler_logp_bt",
       "log-probs must be <= 0")
  need((np.asarray(batch.temperature_b) > 0).all(), "temperature_b", "must be positive")
  turns = np.asarray(batch.turn_index_bt)
  need((turns >= 0).all(), "turn_index_bt", "turn indices must be >= 0")
  if rl_spec is not None:
    need((turns[mask > 0] < rl_spec.max_turns).all(), "turn_index_bt",
         f"generated tokens' turns must be < config.rollout.max_turns={rl_spec.max_turns} "
         "(the learner's turn bound)")
  if batch.sampling_mask_btw is not None:
    w = sampling_mask_lib.packed_width(model_spec.vocab_size)
    need(batch.sampling_mask_btw.shape == (b, t, w), "sampling_mask_btw",
         f"shape {batch.sampling_mask_btw.shape}, expected {(b, t, w)}")
    need(batch.sampling_mask_btw.dtype == jnp.uint8, "sampling_mask_btw", "must be uint8")
    keep = np.asarray(sampling_mask_lib.unpack_mask(batch.sampling_mask_btw,
                                                    model_spec.vocab_size))
    drawn = np.take_along_axis(keep, tokens[..., None], axis=-1)[..., 0]
    need(drawn[mask > 0].all(), "sampling_mask_btw",
         "every generated token must lie inside its own sampling mask")
  if batch.replay is not None:
    need(len(batch.replay) == model_spec.num_layers, "replay",
         f"{len(batch.replay)} layer entries, the model has {model_spec.num_layers}")
    k = model_spec.moe.num_experts_per_token
    for i, layer in enumerate(batch.replay):
      if "experts" in layer:
        e = np.asarray(layer["experts"])
        need(e.shape == (b, t, k), f"replay[{i}]['experts']",
             f"shape {e.shape}, expected {(b, t, k)}")
        need(((e >= 0) & (e < model_spec.moe.num_experts))[pos >= 0].all(),
             f"replay[{i}]['experts']",
             f"ids on real tokens must lie in [0, num_experts={model_spec.moe.num_experts})")
      if "blocks" in layer:
        bl = np.asarray(layer["blocks"])
        shape = (b, model_spec.num_kv_heads, t, model_spec.num_selected_blocks)
        need(bl.shape == shape, f"replay[{i}]['blocks']",
             f"shape {bl.shape}, expected {shape}")
