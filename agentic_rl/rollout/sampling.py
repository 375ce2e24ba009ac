"""Token sampling as a pure function of logits and per-row PRNG keys.

Each row draws with its own key, `trajectory_keys(seeds_b, positions_b)` =
fold_in(key(seed), position of the token being drawn), so a trajectory's tokens
depend only on its seed and its own logits, never on which slot served it or
what else shared the batch.

The recorded log-prob is under the exact distribution drawn from:

    scaled_v = logits_v / temperature
    keep_v   = top-k then top-p support of scaled_v  (rl.sampling_mask)
    logp_v   = log_softmax(where(keep_v, scaled_v, -inf))

which is what the learner recomputes with the recorded (packed) mask and
temperature. Greedy (temperature 0) is the point mass on the argmax: the mask
keeps only the argmax (first on ties, like argmax), the log-prob is 0, and the
temperature recorded for the learner is 1 (any positive value scores it 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from agentic_rl.records import sampling_mask as sampling_mask_lib


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 1.0  # 0 = greedy.
  top_k: int = 0  # 0 = off.
  top_p: float = 1.0  # 1 = off.

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature}: expected >= 0 (0 = greedy).")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k}: expected >= 0 (0 = off).")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p}: expected a number in (0, 1].")


@dataclasses.dataclass(frozen=True)
class Sampled:
  """One draw per row."""
  tokens_b: jax.Array  # int32 [B]
  logp_b: jax.Array  # float32 [B], log-prob of tokens_b under the distribution drawn from
  mask_bw: jax.Array  # uint8 [B, ceil(V / 8)], packed support of that distribution


jax.tree_util.register_dataclass(Sampled, data_fields=["tokens_b", "logp_b", "mask_bw"],
                                 meta_fields=[])


def trajectory_keys(seeds_b: jax.Array, positions_b: jax.Array) -> jax.Array:
  """Typed PRNG keys [B]: fold_in(key(seed), position of the token being drawn)."""
  return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(
      seeds_b.astype(jnp.uint32), positions_b.astype(jnp.int32))


def sampling_distribution(logits_bv: jax.Array, params: SamplingParams
                          ) -> tuple[jax.Array, jax.Array]:
  """(logp_bv, keep_bv): the log-probs actually sampled from, and their support."""
  logits_bv = logits_bv.astype(jnp.float32)
  vocab = logits_bv.shape[-1]
  if params.temperature == 0.0:
    keep_bv = jax.nn.one_hot(jnp.argmax(logits_bv, axis=-1), vocab, dtype=jnp.bool_)
    scaled_bv = logits_bv
  else:
    scaled_bv = logits_bv / params.temperature
    top_k = min(params.top_k, vocab)
    if not sampling_mask_lib.truncates(vocab, top_k, params.top_p):
      # Full-vocabulary sampling: no mask to build or apply (a static choice).
      return (jax.nn.log_softmax(scaled_bv, axis=-1),
              jnp.ones(scaled_bv.shape, jnp.bool_))
    keep_bv = sampling_mask_lib.sampling_mask_from_logits(scaled_bv, top_k=top_k,
                                                          top_p=params.top_p)
  logp_bv = jax.nn.log_softmax(sampling_mask_lib.apply_mask_to_logits(scaled_bv, keep_bv),
                               axis=-1)
  return logp_bv, keep_bv


def sample(logits_bv: jax.Array, keys_b: jax.Array, params: SamplingParams,
           forced_b: jax.Array | None = None) -> Sampled:
  """Draws one token per row with its own key.

  forced_b: optional int32 [B]; rows with an id >= 0 take that token instead of
    drawing (teacher forcing), recording its log-prob under the same
    distribution (-inf if the mask excludes it).
  """
  logp_bv, keep_bv = sampling_distribution(logits_bv, params)
  if params.temperature == 0.0:
    tokens_b = jnp.argmax(logp_bv, axis=-1)
  else:
    tokens_b = jax.vmap(jax.random.categorical)(keys_b, logp_bv)
  tokens_b = tokens_b.astype(jnp.int32)
  if forced_b is not None:
    tokens_b = jnp.where(forced_b >= 0, forced_b.astype(jnp.int32), tokens_b)
  logp_b = jnp.take_along_axis(logp_bv, tokens_b[:, None], axis=-1)[:, 0]
  return Sampled(tokens_b=tokens_b, logp_b=logp_b, mask_bw=sampling_mask_lib.pack_mask(keep_bv))
