"""Every loss option is wired through the learner's loss, and two of them checked by hand."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model import transformer
from agentic_rl.rl import advantages as adv_lib
from agentic_rl.rl import batch as batch_lib
from agentic_rl.rl import config as rl_config_lib
from agentic_rl.rl import learner
from agentic_rl.rl import objectives
from tests.rl import tiny_model

B, T, PROMPT = 4, 12, 4
REWARDS = np.array([1.0, 0.0, 0.5, 0.5], np.float32)  # groups [0, 0, 1, 1]: the second is flat


@pytest.fixture(scope="module")
def env():
  model, params = tiny_model.make_model(value_head=True)
  tokens, positions, mask = tiny_model.random_sequences(model.spec.vocab_size, B, T, PROMPT)
  _, _, aux = tiny_model.forward_fn(model)(params, jnp.asarray(tokens), jnp.asarray(positions))
  batch = batch_lib.make_batch(tokens, positions, mask, np.zeros((B, T)), REWARDS,
                               [0, 0, 1, 1], replay=transformer.replay_from_aux(aux),
                               sampling_mask_btw=jnp.zeros((B, T, 8), jnp.uint8))
  spec = tiny_model.rl_spec()
  logp = jax.jit(lambda p, b: learner.policy_outputs(model, p, b, spec)["logp_bt"])(params, batch)
  return dict(model=model, params=params, batch=batch, learner_logp=np.asarray(logp) * mask)


_batch_advantages = jax.jit(adv_lib.batch_advantages, static_argnums=0)


def _loss(env, spec, batch):
  norms = objectives.loss_normalizers(batch.loss_mask_bt, spec.constant_normalizer)
  adv = (jnp.zeros_like(batch.loss_mask_bt) if spec.uses_values else
         _batch_advantages(spec, batch.rewards_b, batch.group_id_b, batch.loss_mask_bt,
                           batch.process_reward_bt, batch.turn_index_bt))
  return functools.partial(learner.microbatch_loss, model=env["model"], spec=spec,
                           num_micro_batches=1), norms, adv


# Six traces that between them take every choice of every option (tracing is the cost).
VARIATIONS = [
    {"advantage.estimator": "grpo", "objective.type": "ppo_clip", "loss.aggregation": "token",
     "correction.type": "none"},
    {"advantage.estimator": "grpo_no_std", "objective.type": "gspo",
     "loss.aggregation": "sequence", "correction.type": "tis", "loss.kl_coef": 0.1,
     "loss.kl_estimator": "k1", "loss.entropy_coef": 0.01},
    {"advantage.estimator": "dr_grpo", "loss.aggregation": "constant",
     "loss.constant_normalizer": 16, "correction.type": "mis_token", "loss.kl_coef": 0.1,
     "loss.kl_estimator": "k2", "objective.old_logp_source": "sampler"},
    {"advantage.estimator": "rloo", "correction.type": "mis_sequence",
     "correction.mis_sequence_ratio": "product", "loss.kl_coef": 0.1, "loss.kl_estimator": "k3",
     "replay.routing": False},
    {"advantage.estimator": "turn_level", "correction.type": "mis_sequence",
     "correction.mis_sequence_ratio": "geometric_mean", "replay.blocks": False},
    {"advantage.estimator": "gae", "loss.value_clip": 0.2, "correction.type": "icepop",
     "objective.type": "gspo", "replay.sampling_mask": False},
]


def test_variations_cover_every_choice():
  covered = {}
  for changes in VARIATIONS:
    for k, v in changes.items():
      covered.setdefault(k, set()).add(v)
  for field, choices in [("advantage.estimator", rl_config_lib.ADVANTAGE_ESTIMATORS),
                         ("objective.type", rl_config_lib.OBJECTIVES),
                         ("objective.old_logp_source", ("sampler",)),
                         ("loss.aggregation", rl_config_lib.AGGREGATIONS),
                         ("loss.kl_estimator", rl_config_lib.KL_ESTIMATORS),
                         ("correction.type", rl_config_lib.CORRECTIONS),
                         ("correction.mis_sequence_ratio", rl_config_lib.SEQUENCE_RATIOS)]:
    assert set(choices) <= covered[field], field


@pytest.mark.parametrize("changes", VARIATIONS,
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_every_option_traces_through_the_loss(env, changes):
  spec = tiny_model.rl_spec(**changes)
  batch = env["batch"]
  if spec.uses_values:
    batch = batch.replace(old_values_bt=jnp.zeros((B, T)))
  loss_fn, norms, adv = _loss(env, spec, batch)
  ref = env["params"] if spec.kl_coef > 0 else None
  loss, (sums, _) = jax.eval_shape(loss_fn, env["params"], ref, batch, adv, norms)
  assert loss.shape == () and "mm/k3" in sums
  assert ("value_loss" in sums) == spec.uses_values
  assert ("kl_to_ref" in sums) == (spec.kl_coef > 0)
  assert ("corr_rejected_sequences" in sums) == (spec.correction == "mis_sequence")


def test_sampler_as_old_policy_and_tis_by_hand(env):
  """Sampler log-probs 0.1 below the learner's: with old_logp_source='sampler' the ratio is
  e^0.1 on every token; TIS with C = 1.05 then weights every token by 1.05."""
  mask = np.asarray(env["batch"].loss_mask_bt)
  batch = env["batch"].replace(sampler_logp_bt=jnp.asarray(env["learner_logp"] - 0.1 * mask))
  r = np.asarray(REWARDS).reshape(2, 2)
  a = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
  a[1] = 0.0  # the flat group
  mean_adv = a.repeat(1, axis=1).mean()  # every sequence has T - PROMPT tokens
  for changes, want_pg, want_rejected in [
      ({"objective.old_logp_source": "sampler"}, -np.exp(0.1) * mean_adv, 0.0),
      ({"correction.type": "tis", "correction.tis_cap": 1.05}, -1.05 * mean_adv, 1.0)]:
    spec = tiny_model.rl_spec(**changes)
    loss_fn, norms, adv = _loss(env, spec, batch)
    _, (sums, _) = jax.jit(loss_fn)(env["params"], None, batch, adv, norms)
    assert float(sums["pg_loss"]) == pytest.approx(want_pg, abs=1e-5), changes
    n = mask.sum()
    assert float(sums["corr_rejected_count"]) / n == pytest.approx(want_rejected), changes
    # The mismatch metric sees the constructed shift: log r = 0.1 on every token, so
    # k1 = -log r = -0.1 and k3 = r - 1 - log r.
    assert float(sums["mm/k1"]) / n == pytest.approx(-0.1, abs=1e-5)
    assert float(sums["mm/k3"]) / n == pytest.approx(np.exp(0.1) - 1.1, rel=1e-3)
