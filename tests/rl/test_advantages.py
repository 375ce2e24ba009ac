"""Advantage estimators against hand-computed examples and an independent numpy GAE."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.rl import advantages as adv
from agentic_rl.rl import config as rl_config_lib

# Groups: 7 = [1, 0, 0, 1] (+ a filler row without generated tokens, reward 100),
# 3 = [.5, .5] (all equal), 9 = [2] (alone), 5 = [3, 1]. Ids need not be contiguous.
REWARDS = np.array([1, 0, 0, 1, 0.5, 0.5, 2.0, 3.0, 1.0, 100.0], np.float32)
GROUPS = np.array([7, 7, 7, 7, 3, 3, 9, 5, 5, 7], np.int32)
VALID = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 0], np.float32)
S3 = np.sqrt(1 / 3)  # std (n - 1) of [1, 0, 0, 1]
S2 = np.sqrt(2.0)  # std (n - 1) of [3, 1]


def test_grpo_hand_example():
  got = adv.grpo_advantages(jnp.asarray(REWARDS), jnp.asarray(GROUPS), jnp.asarray(VALID), eps=1e-6)
  want = [.5 / (S3 + 1e-6), -.5 / (S3 + 1e-6), -.5 / (S3 + 1e-6), .5 / (S3 + 1e-6), 0, 0, 0,
          1 / (S2 + 1e-6), -1 / (S2 + 1e-6), 0]
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
  assert abs(float(got[0]) - 0.8660254) < 1e-5 and abs(float(got[7]) - 0.7071068) < 1e-5


def test_grpo_without_std_and_dr_grpo_hand_example():
  got = adv.grpo_advantages(jnp.asarray(REWARDS), jnp.asarray(GROUPS), jnp.asarray(VALID),
                            normalize_std=False)
  np.testing.assert_allclose(np.asarray(got), [.5, -.5, -.5, .5, 0, 0, 0, 1, -1, 0], atol=1e-7)


def test_rloo_hand_example():
  got = adv.rloo_advantages(jnp.asarray(REWARDS), jnp.asarray(GROUPS), jnp.asarray(VALID))
  # R_i minus the mean of the others: 1 - 1/3, 0 - 2/3, ...; 3 - 1, 1 - 3.
  np.testing.assert_allclose(np.asarray(got), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 2, -2, 0],
                             atol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "grpo_no_std", "dr_grpo", "rloo"])
def test_batch_advantages_broadcast_to_generated_tokens(estimator):
  c = rl_config_lib.default_rl_config()
  c.advantage.estimator = estimator
  c.loss.aggregation = "constant"
  spec = rl_config_lib.validate(c)
  b, t = len(REWARDS), 6
  mask = np.zeros((b, t), np.float32)
  mask[:, 2:5] = 1
  mask[-1] = 0  # the filler row
  got = np.asarray(adv.batch_advantages(spec, jnp.asarray(REWARDS), jnp.asarray(GROUPS),
                                        jnp.asarray(mask), jnp.zeros((b, t)),
                                        jnp.zeros((b, t), jnp.int32)))
  if estimator == "rloo":
    per_seq = adv.rloo_advantages(REWARDS, GROUPS, VALID)
  else:
    per_seq = adv.grpo_advantages(REWARDS, GROUPS, VALID, normalize_std=estimator == "grpo")
  np.testing.assert_allclose(got, np.asarray(per_seq)[:, None] * mask, atol=1e-6)


def test_turn_level_hand_example():
  # Group of three: A (two turns), B (two turns), C (one turn); T = 8.
  turn = np.array([[0, 0, 0, 0, 1, 1, 0, 0],
                   [0, 0, 0, 1, 1, 1, 1, 1],
                   [0, 0, 0, 0, 0, 0, 0, 0]], np.int32)
  mask = np.array([[0, 1, 1, 0, 1, 1, 0, 0],
                   [0, 1, 0, 1, 1, 1, 1, 0],
                   [0, 1, 1, 0, 0, 0, 0, 0]], np.float32)
  process = np.zeros((3, 8), np.float32)
  process[0, 2] = 1.0  # A turn 0
  process[1, 6] = 0.5  # B turn 1
  process[2, 2] = 0.25  # C turn 0
  rewards = np.array([1.0, 0.0, 1.0], np.float32)
  turn_level = jax.jit(adv.turn_level_advantages,
                       static_argnames=("max_turns", "turn_gamma", "turn_weight", "eps"))
  got = np.asarray(turn_level(
      jnp.asarray(rewards), jnp.zeros(3, jnp.int32), jnp.asarray(process), jnp.asarray(turn),
      jnp.asarray(mask), max_turns=4, turn_gamma=0.5, turn_weight=0.5, eps=0.0))
  # Outcome: [1, 0, 1] -> mean 2/3, std sqrt(1/3): A, C = +0.57735, B = -1.15470.
  # Turn returns G_j = sum_{j' >= j} 0.5^(j'-j) p_j': A (1, 0), B (0.25, 0.5), C (0.25,).
  # Turn 0 over [1, .25, .25]: mean .5, std .4330127 -> A 1.1547005, B, C -0.5773503.
  # Turn 1 over A, B only [0, .5] -> A -0.7071068, B +0.7071068.
  a0, a1 = 0.5773503 + 0.5 * 1.1547005, 0.5773503 - 0.5 * 0.7071068
  b0, b1 = -1.1547005 - 0.5 * 0.5773503, -1.1547005 + 0.5 * 0.7071068
  c0 = 0.5773503 - 0.5 * 0.5773503
  want = np.array([[0, a0, a0, 0, a1, a1, 0, 0],
                   [0, b0, 0, b1, b1, b1, b1, 0],
                   [0, c0, c0, 0, 0, 0, 0, 0]])
  np.testing.assert_allclose(got, want, atol=1e-5)


def _gae_numpy(rewards, process, values, mask, gamma, lam):
  """Independent GAE: compress each sequence to its actions, then sum discounted deltas."""
  b, t = mask.shape
  adv_out = np.zeros((b, t))
  for i in range(b):
    acts = [j for j in range(t) if mask[i, j] > 0]
    n = len(acts)
    r = []
    for k, j in enumerate(acts):
      end = acts[k + 1] if k + 1 < n else t
      r.append(process[i, j] + process[i, j + 1:end].sum() + (rewards[i] if k == n - 1 else 0))
    v = [values[i, j] for j in acts] + [0.0]
    delta = [r[k] + gamma * v[k + 1] - v[k] for k in range(n)]
    for k, j in enumerate(acts):
      adv_out[i, j] = sum((gamma * lam) ** l * delta[k + l] for l in range(n - k))
  return adv_out


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0)])
def test_gae_matches_numpy(gamma, lam):
  rng = np.random.default_rng(0)
  b, t = 4, 12
  mask = (rng.random((b, t)) < 0.6).astype(np.float32)
  mask[:, 0] = 0
  mask[3] = 0  # a sequence without actions
  process = np.where(rng.random((b, t)) < 0.3, rng.normal(size=(b, t)), 0).astype(np.float32)
  values = rng.normal(size=(b, t)).astype(np.float32)
  rewards = rng.normal(size=b).astype(np.float32)
  got, returns = adv.gae_advantages(jnp.asarray(rewards), jnp.asarray(process),
                                    jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam)
  want = _gae_numpy(rewards, process, values, mask, gamma, lam)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(returns), (want + values) * mask, rtol=1e-5, atol=1e-5)


def test_gae_hand_example():
  # gamma = lambda = 1 and only an outcome reward: A_t = R - V_t on every action.
  mask = np.array([[0, 1, 1, 0, 1]], np.float32)
  values = np.array([[9, 0.2, 0.5, 9, 0.7]], np.float32)
  got, _ = adv.gae_advantages(jnp.asarray([2.0]), jnp.zeros((1, 5)), jnp.asarray(values),
                              jnp.asarray(mask), gamma=1.0, lam=1.0)
  np.testing.assert_allclose(np.asarray(got), [[0, 1.8, 1.5, 0, 1.3]], atol=1e-6)
  # lambda = 0: one-step TD errors, delta_t = V_next - V_t, last = R - V_last.
  got, _ = adv.gae_advantages(jnp.asarray([2.0]), jnp.zeros((1, 5)), jnp.asarray(values),
                              jnp.asarray(mask), gamma=1.0, lam=0.0)
  np.testing.assert_allclose(np.asarray(got), [[0, 0.3, 0.2, 0, 1.3]], atol=1e-6)


def test_equal_rewards_give_exactly_zero():
  # 0.1 is inexact in float32: the group mean's rounding must not leak through 1/(std + eps).
  rewards = jnp.asarray([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7], jnp.float32)
  groups = jnp.asarray([0, 0, 0, 1, 1, 1, 1], jnp.int32)
  valid = jnp.ones(7)
  for normalize_std in (True, False):
    got = adv.grpo_advantages(rewards, groups, valid, normalize_std=normalize_std)
    assert np.asarray(got).tolist() == [0.0] * 7
  assert np.asarray(adv.rloo_advantages(rewards, groups, valid)).tolist() == [0.0] * 7


def _two_edit_group():
  """One group, one generated token per turn. A: a wrong edit at turn 4 (process signal
  0), its failing test, the fix at turn 6 (+1), test, submit: solved. B: the fix at turn 4,
  test, submit: solved. C and D: a wrong edit at turn 4, test, submit: failed."""
  t = 9
  mask = np.zeros((4, t), np.float32)
  mask[0, :9] = 1
  mask[1:, :7] = 1
  turn = np.broadcast_to(np.arange(t, dtype=np.int32), (4, t)).copy()
  process = np.zeros((4, t), np.float32)
  process[0, 6] = 1.0  # A's fix
  process[1, 4] = 1.0  # B's fix
  rewards = np.asarray([1.0, 1.0, 0.0, 0.0], np.float32)
  return rewards, np.zeros(4, np.int32), mask, process, turn


def _advantages(estimator, **advantage):
  c = rl_config_lib.default_rl_config()
  c.advantage.estimator = estimator
  c.advantage.update(advantage)
  spec = rl_config_lib.validate(c, rollout_config={"group_size": 4, "max_turns": 12})
  rewards, groups, mask, process, turn = _two_edit_group()
  return np.asarray(adv.batch_advantages(spec, jnp.asarray(rewards), jnp.asarray(groups),
                                         jnp.asarray(mask), jnp.asarray(process),
                                         jnp.asarray(turn)))


def test_a_retrys_wrong_first_edit_is_not_credited_like_its_fix():
  """The two-edit trajectory A: under GRPO its wrong edit (turn 4) gets exactly the fix's
  advantage; under turn_level with each edit's own signal (turn_gamma 0) it gets far less,
  by hand: outcome +0.866 for A; turn 4 signals (0, 1, 0, 0) normalise to A -0.5, turn 6
  signals (1, 0, 0, 0) to A +1.5. So 0.366 for the wrong edit against 2.366 for the fix."""
  grpo = _advantages("grpo")
  assert grpo[0, 4] == pytest.approx(grpo[0, 6])
  turn = _advantages("turn_level", turn_gamma=0.0, turn_weight=1.0)
  outcome = 1 / np.sqrt(1 / 3)  # (1 - 0.5) / std of (1, 1, 0, 0)
  assert turn[0, 4] == pytest.approx(0.5 * outcome - 0.5, rel=1e-4)
  assert turn[0, 6] == pytest.approx(0.5 * outcome + 1.5, rel=1e-4)
  assert turn[1, 4] == pytest.approx(turn[0, 6], rel=1e-4)  # B's fix: credited as A's fix.
  # The return-to-go (turn_gamma 1) hands the later fix's signal back to the wrong edit.
  to_go = _advantages("turn_level", turn_gamma=1.0, turn_weight=1.0)
  assert to_go[0, 4] - turn[0, 4] > 1.0
