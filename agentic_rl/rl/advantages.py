"""Credit assignment: advantages per generated token.

Group-relative (route B, statistical credit), over trajectories sharing group_id_b:
  grpo         A_i = (R_i - mean_g R) / (std_g R + eps)        DeepSeekMath (Shao et al. 2024)
  grpo_no_std  A_i = R_i - mean_g R
  dr_grpo      A_i = R_i - mean_g R, with loss.aggregation='constant'
                                                        Dr. GRPO (Liu et al. 2025)
  rloo         A_i = R_i - mean_{j in g, j != i} R_j       RLOO (Ahmadian et al. 2024)
std is the unbiased (n - 1) sample std, as in TRL and verl. A group of one gets A = 0.

Precise intermediate credit (route A):
  turn_level   from the environment's per-turn process signals p_{i,j}:
                 G_{i,j} = sum_{j' >= j} turn_gamma^(j'-j) p_{i,j'}   (turn return)
                 A_{i,j} = norm_g(R)_i + turn_weight * norm_{g,j}(G)_{i,j}
               norm_{g,j} compares trajectory i's turn j with the same turn of the
               other trajectories of its group that have one; every token of turn j
               gets A_{i,j}. This generalises MT-GRPO (Zeng et al. 2025) to any turn count.
  gae          GAE(gamma, lambda) (Schulman et al. 2016) over the generated tokens
               with the value head's estimates; environment tokens are part of the
               transition, not steps, and rewards on them go to the action before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl.rl.config import RLSpec


def group_statistics(values_b: jax.Array, group_id_b: jax.Array, valid_b: jax.Array
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-row (mean, unbiased std, count) of `values_b` over valid rows of the row's group."""
  valid_b = valid_b.astype(jnp.float32)
  same_bb = (group_id_b[:, None] == group_id_b[None, :]).astype(jnp.float32) * valid_b[None, :]
  count_b = same_bb.sum(1)
  mean_b = (same_bb @ values_b) / jnp.maximum(count_b, 1.0)
  sq_dev_b = jnp.sum(same_bb * (values_b[None, :] - mean_b[:, None]) ** 2, axis=1)
  std_b = jnp.sqrt(sq_dev_b / jnp.maximum(count_b - 1.0, 1.0))
  return mean_b, std_b, count_b


def group_all_equal(values_b, group_id_b, valid_b) -> jax.Array:
  """True where every valid member of the row's group has exactly the same value."""
  same_bb = (group_id_b[:, None] == group_id_b[None, :]) & (valid_b[None, :] > 0)
  hi_b = jnp.max(jnp.where(same_bb, values_b[None, :], -jnp.inf), axis=1)
  lo_b = jnp.min(jnp.where(same_bb, values_b[None, :], jnp.inf), axis=1)
  return hi_b == lo_b


def grpo_advantages(rewards_b, group_id_b, valid_b, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> jax.Array:
  valid_b = jnp.asarray(valid_b, jnp.float32)
  mean_b, std_b, _ = group_statistics(rewards_b, group_id_b, valid_b)
  adv_b = rewards_b - mean_b
  if normalize_std:
    adv_b = adv_b / (std_b + eps)
  # Equal rewards give exactly 0 (the mean's rounding error over a tiny std would not).
  keep_b = (valid_b > 0) & ~group_all_equal(rewards_b, group_id_b, valid_b)
  return jnp.where(keep_b, adv_b, 0.0)


def rloo_advantages(rewards_b, group_id_b, valid_b) -> jax.Array:
  valid_b = jnp.asarray(valid_b, jnp.float32)
  mean_b, _, count_b = group_statistics(rewards_b, group_id_b, valid_b)
  # R_i - (n mean - R_i) / (n - 1) = n / (n - 1) (R_i - mean).
  scale_b = jnp.where(count_b > 1, count_b / jnp.maximum(count_b - 1.0, 1.0), 0.0)
  keep_b = (valid_b > 0) & ~group_all_equal(rewards_b, group_id_b, valid_b)
  return jnp.where(keep_b, scale_b * (rewards_b - mean_b), 0.0)


def turn_signals(process_reward_bt, turn_index_bt, loss_mask_bt, max_turns: int
                 ) -> tuple[jax.Array, jax.Array]:
  """(p_bj, present_bj): summed process signal and has-generated-tokens per turn.

  Turn indices >= max_turns fold into the last turn.
  """
  turn_btj = jax.nn.one_hot(jnp.clip(turn_index_bt, 0, max_turns - 1), max_turns,
                            dtype=jnp.float32)
  hi = jax.lax.Precision.HIGHEST  # exact sums on TPU too
  p_bj = jnp.einsum("bt,btj->bj", process_reward_bt, turn_btj, precision=hi)
  present_bj = jnp.einsum("bt,btj->bj", loss_mask_bt, turn_btj, precision=hi) > 0
  return p_bj, present_bj


def turn_level_advantages(rewards_b, group_id_b, process_reward_bt, turn_index_bt,
                          loss_mask_bt, *, max_turns: int, turn_gamma: float,
                          turn_weight: float, normalize_std: bool = True,
                          eps: float = 1e-6) -> jax.Array:
  valid_b = (loss_mask_bt.sum(1) > 0).astype(jnp.float32)
  outcome_b = grpo_advantages(rewards_b, group_id_b, valid_b, normalize_std=normalize_std,
                              eps=eps)
  p_bj, present_bj = turn_signals(process_reward_bt, turn_index_bt, loss_mask_bt, max_turns)
  j = jnp.arange(max_turns)
  # discount_jj[j', j] = gamma^(j' - j) for j' >= j.
  discount_jj = jnp.where(j[:, None] >= j[None, :],
                          turn_gamma ** jnp.maximum(j[:, None] - j[None, :], 0), 0.0)
  turn_return_bj = p_bj @ discount_jj

  def normalise_turn(g_b, present_b):
    return grpo_advantages(g_b, group_id_b, present_b.astype(jnp.float32),
                           normalize_std=normalize_std, eps=eps)

  turn_adv_bj = jax.vmap(normalise_turn, in_axes=1, out_axes=1)(turn_return_bj, present_bj)
  turn_bt = jnp.clip(turn_index_bt, 0, max_turns - 1)
  turn_adv_bt = jnp.take_along_axis(turn_adv_bj, turn_bt, axis=1)
  return (outcome_b[:, None] + turn_weight * turn_adv_bt) * loss_mask_bt


def gae_advantages(rewards_b, process_reward_bt, values_bt, loss_mask_bt, *, gamma: float,
                   lam: float) -> tuple[jax.Array, jax.Array]:
  """(advantages_bt, returns_bt) by GAE over the generated tokens of each sequence.

  values_bt: target aligned (V of the state before token t). The outcome reward
  arrives after the last generated token, process rewards after the action they
  follow; the state after the last action is terminal (V = 0).
  Returns are the value targets A + V, on generated tokens (0 elsewhere).
  """
  mask_tb = loss_mask_bt.T
  reward_tb = process_reward_bt.T
  value_tb = values_bt.T

  def step(carry, inputs):
    next_value_b, next_adv_b, pending_b = carry
    m_b, r_b, v_b = inputs
    act_b = m_b > 0
    delta_b = r_b + pending_b + gamma * next_value_b - v_b
    adv_b = delta_b + gamma * lam * next_adv_b
    carry = (jnp.where(act_b, v_b, next_value_b), jnp.where(act_b, adv_b, next_adv_b),
             jnp.where(act_b, 0.0, pending_b + r_b))
    return carry, jnp.where(act_b, adv_b, 0.0)

  zeros_b = jnp.zeros_like(rewards_b)
  _, adv_tb = jax.lax.scan(step, (zeros_b, zeros_b, rewards_b.astype(jnp.float32)),
                           (mask_tb, reward_tb, value_tb), reverse=True)
  adv_bt = adv_tb.T
  return adv_bt, (adv_bt + values_bt) * loss_mask_bt


def sequence_valid(loss_mask_bt) -> jax.Array:
  """1 for sequences with at least one generated token (filler rows take no part)."""
  return (loss_mask_bt.sum(1) > 0).astype(jnp.float32)


def batch_advantages(spec: RLSpec, rewards_b, group_id_b, loss_mask_bt, process_reward_bt,
                     turn_index_bt) -> jax.Array:
  """Token advantages [B, T] for every estimator except 'gae' (which needs values).

  Group statistics span the whole batch, so call this before splitting micro-batches.
  """
  valid_b = sequence_valid(loss_mask_bt)
  a = spec.advantage
  est = a.estimator
  if est in ("grpo", "grpo_no_std", "dr_grpo"):
    adv_b = grpo_advantages(rewards_b, group_id_b, valid_b, normalize_std=est == "grpo",
                            eps=a.eps)
  elif est == "rloo":
    adv_b = rloo_advantages(rewards_b, group_id_b, valid_b)
  elif est == "turn_level":
    return turn_level_advantages(rewards_b, group_id_b, process_reward_bt, turn_index_bt,
                                 loss_mask_bt, max_turns=spec.max_turns,
                                 turn_gamma=a.turn_gamma, turn_weight=a.turn_weight,
                                 normalize_std=a.turn_normalize_std, eps=a.eps)
  elif est == "gae":
    raise ValueError("advantage.estimator='gae' needs values: use gae_advantages.")
  else:
    raise ValueError(f"config.rl.advantage.estimator={est!r} is unknown.")
  return adv_b[:, None] * loss_mask_bt
