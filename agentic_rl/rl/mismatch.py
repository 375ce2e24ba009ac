"""Train-inference mismatch: how far the learner's distribution is from the sampler's.

Over generated tokens, with log r = log p_learner(y) - log p_sampler(y):
  k1 = -log r            mean is an unbiased estimate of KL(sampler || learner)
  k3 = (r - 1) - log r   non-negative, unbiased, lower variance
  |log r|                mean and max
  outside                fraction of tokens with r outside [ratio_low, ratio_high] ([0.5, 2])
Over every real input position (positions_bt >= 0), against the sampler's record:
  routing agreement      |learner experts ∩ sampler experts| / k, per token and MoE layer;
                         also the exact-match rate (all k experts equal)
  block agreement        |learner blocks ∩ sampler blocks| / |sampler blocks|, over the
                         used slots of every (kv head, token) of every sparse layer
With replay on, the learner is forced onto the record and both agreements are 1;
they measure something when replay is off.

Each metric is also broken down by turn index (turn_index_bt, turns >= num_turns
fold into the last) and by position bucket (num_position_buckets equal-width
buckets over [0, max_position)), as arrays.

Two steps, so micro-batches can accumulate: `*_sums` return additive sums (and
maxima, keys ending in '_max'); `combine_sums` adds two of them; `finalize`
turns the total into metrics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def position_buckets(positions_bt, num_buckets: int, max_position: int):
  """Bucket index of each position (padding goes to bucket 0 and must be masked)."""
  pos_bt = jnp.maximum(positions_bt, 0)
  return jnp.clip(pos_bt * num_buckets // max_position, 0, num_buckets - 1)


def _bucketed_sums(values: dict, weight_bt, turn_bt, bucket_bt, num_turns, num_buckets
                   ) -> dict:
  """Weighted sums of each [B, T] value: total, per turn [num_turns], per position bucket.

  One-hot contractions (at full float32 precision, also on TPU) rather than scatters:
  the bucket counts are small, and this compiles much faster than segment sums.
  """
  names = list(values)
  stacked_btq = jnp.stack([jnp.where(weight_bt > 0, values[n], 0.0) * weight_bt
                           for n in names], axis=-1)
  turn_btj = jax.nn.one_hot(turn_bt, num_turns, dtype=jnp.float32)
  pos_btp = jax.nn.one_hot(bucket_bt, num_buckets, dtype=jnp.float32)
  hi = jax.lax.Precision.HIGHEST
  total_q = jnp.sum(stacked_btq, axis=(0, 1))
  turn_jq = jnp.einsum("btq,btj->jq", stacked_btq, turn_btj, precision=hi)
  pos_pq = jnp.einsum("btq,btp->pq", stacked_btq, pos_btp, precision=hi)
  out = {}
  for q, name in enumerate(names):
    out[name] = total_q[q]
    out[f"turn/{name}"] = turn_jq[:, q]
    out[f"pos/{name}"] = pos_pq[:, q]
  return out


def _bucketed_max(x_bt, bucket_bt, num_buckets):
  """Per-bucket max of a non-negative value (0 for an empty bucket)."""
  one_hot_btk = jax.nn.one_hot(bucket_bt, num_buckets, dtype=jnp.bool_)
  return jnp.max(jnp.where(one_hot_btk, x_bt[..., None], 0.0), axis=(0, 1))


def logprob_mismatch_sums(learner_logp_bt, sampler_logp_bt, mask_bt, turn_index_bt,
                          positions_bt, *, num_turns: int, num_position_buckets: int,
                          max_position: int, ratio_low: float = 0.5,
                          ratio_high: float = 2.0) -> dict:
  mask_bt = mask_bt.astype(jnp.float32)
  log_r_bt = jnp.where(mask_bt > 0, learner_logp_bt - sampler_logp_bt, 0.0)
  r_bt = jnp.exp(log_r_bt)
  turn_bt = jnp.clip(turn_index_bt, 0, num_turns - 1)
  bucket_bt = position_buckets(positions_bt, num_position_buckets, max_position)
  abs_bt = jnp.abs(log_r_bt)
  values = {
      "tokens": jnp.ones_like(mask_bt),
      "k1": -log_r_bt,
      "k3": (r_bt - 1.0) - log_r_bt,
      "abs": abs_bt,
      "outside": ((r_bt < ratio_low) | (r_bt > ratio_high)).astype(jnp.float32),
  }
  sums = _bucketed_sums(values, mask_bt, turn_bt, bucket_bt, num_turns, num_position_buckets)
  masked_abs_bt = abs_bt * mask_bt
  sums["abs_max"] = jnp.max(masked_abs_bt)
  sums["turn/abs_max"] = _bucketed_max(masked_abs_bt, turn_bt, num_turns)
  sums["pos/abs_max"] = _bucketed_max(masked_abs_bt, bucket_bt, num_position_buckets)
  return sums


def set_overlap(a_sk, b_sk):
  """|a ∩ b| over the last axis, ignoring negative ids; each row's ids must be unique."""
  both = jnp.sort(jnp.concatenate([a_sk, b_sk], axis=-1), axis=-1)
  same = (both[..., 1:] == both[..., :-1]) & (both[..., 1:] >= 0)
  return jnp.sum(same.astype(jnp.float32), axis=-1)


def selection_agreement_sums(learner_layers, recorded_layers, positions_bt, turn_index_bt,
                             *, num_turns: int, num_position_buckets: int,
                             max_position: int) -> dict:
  """Routing and block-selection agreement sums for layers recorded in both tuples."""
  valid_bt = (positions_bt >= 0).astype(jnp.float32)
  turn_bt = jnp.clip(turn_index_bt, 0, num_turns - 1)
  bucket_bt = position_buckets(positions_bt, num_position_buckets, max_position)
  num_layers = len(recorded_layers)
  sums = {}
  route_overlap, route_exact, route_slots, route_recorded, route_layer = [], [], [], [], []
  block_overlap, block_used, block_layer = [], [], []
  for i, (mine, theirs) in enumerate(zip(learner_layers, recorded_layers)):
    if "experts" in mine and "experts" in theirs:
      k = theirs["experts"].shape[-1]
      overlap_bt = set_overlap(mine["experts"], theirs["experts"])
      recorded_bt = jnp.all(theirs["experts"] >= 0, axis=-1).astype(jnp.float32) * valid_bt
      route_overlap.append(overlap_bt * recorded_bt)
      route_exact.append((overlap_bt == k).astype(jnp.float32) * recorded_bt)
      route_slots.append(k * recorded_bt)
      route_recorded.append(recorded_bt)
      route_layer.append((i, jnp.sum(overlap_bt * recorded_bt), jnp.sum(k * recorded_bt)))
    if "blocks" in mine and "blocks" in theirs:
      overlap_bkt = set_overlap(mine["blocks"], theirs["blocks"])
      used_bkt = jnp.sum((theirs["blocks"] >= 0).astype(jnp.float32), axis=-1)
      overlap_bt = overlap_bkt.sum(1) * valid_bt
      used_bt = used_bkt.sum(1) * valid_bt
      block_overlap.append(overlap_bt)
      block_used.append(used_bt)
      block_layer.append((i, jnp.sum(overlap_bt), jnp.sum(used_bt)))

  def per_layer(entries):
    num = [jnp.float32(0.0)] * num_layers
    den = [jnp.float32(0.0)] * num_layers
    for i, n, d in entries:
      num[i], den[i] = n, d
    return jnp.stack(num), jnp.stack(den)

  values = {}
  if route_overlap:
    values["route_overlap"], values["route_slots"] = sum(route_overlap), sum(route_slots)
    # Exact-match rate over (token, MoE layer) pairs.
    sums["route_exact"] = jnp.sum(sum(route_exact))
    sums["route_tokens"] = jnp.sum(sum(route_recorded))
    sums["layer/route_overlap"], sums["layer/route_slots"] = per_layer(route_layer)
  if block_overlap:
    values["block_overlap"], values["block_used"] = sum(block_overlap), sum(block_used)
    sums["layer/block_overlap"], sums["layer/block_used"] = per_layer(block_layer)
  if values:
    sums.update(_bucketed_sums(values, jnp.ones_like(valid_bt), turn_bt, bucket_bt, num_turns,
                               num_position_buckets))
  return sums


def combine_sums(a: dict, b: dict) -> dict:
  """Adds two sums dicts (keys ending in '_max' take the maximum)."""
  return {k: (jnp.maximum(a[k], b[k]) if k.endswith("_max") else a[k] + b[k]) for k in a}


def _ratio(num, den):
  return jnp.where(den > 0, num / jnp.maximum(den, 1e-30), 0.0)


def finalize(sums: dict, prefix: str = "mismatch/") -> dict:
  """Metrics from accumulated sums. Empty buckets report 0 with a count of 0."""
  out = {}
  for scope, key in (("", ""), ("by_turn/", "turn/"), ("by_position/", "pos/")):
    if f"{key}tokens" in sums:
      n = sums[f"{key}tokens"]
      out[f"{prefix}{scope}num_tokens"] = n
      out[f"{prefix}{scope}k1"] = _ratio(sums[f"{key}k1"], n)
      out[f"{prefix}{scope}k3"] = _ratio(sums[f"{key}k3"], n)
      out[f"{prefix}{scope}abs_logp_diff_mean"] = _ratio(sums[f"{key}abs"], n)
      out[f"{prefix}{scope}abs_logp_diff_max"] = sums[f"{key}abs_max"]
      out[f"{prefix}{scope}ratio_outside_frac"] = _ratio(sums[f"{key}outside"], n)
    if f"{key}route_overlap" in sums:
      out[f"{prefix}{scope}routing_agreement"] = _ratio(sums[f"{key}route_overlap"],
                                                        sums[f"{key}route_slots"])
    if f"{key}block_overlap" in sums:
      out[f"{prefix}{scope}block_agreement"] = _ratio(sums[f"{key}block_overlap"],
                                                      sums[f"{key}block_used"])
  if "route_exact" in sums:
    out[f"{prefix}routing_exact_match"] = _ratio(sums["route_exact"], sums["route_tokens"])
    out[f"{prefix}by_layer/routing_agreement"] = _ratio(sums["layer/route_overlap"],
                                                        sums["layer/route_slots"])
  if "layer/block_overlap" in sums:
    out[f"{prefix}by_layer/block_agreement"] = _ratio(sums["layer/block_overlap"],
                                                      sums["layer/block_used"])
  return out
