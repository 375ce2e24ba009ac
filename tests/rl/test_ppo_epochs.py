"""Several PPO epochs over one rollout batch: the old policy is the behaviour policy, so the
clip binds from the second update on, and the bandit learns from fewer sampled episodes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.rl import learner
from agentic_rl.rl import train_step as ts
from tests.rl import test_bandit as bandit
from tests.rl import tiny_model

_FAST = {"replay.sampling_mask": False, "optim.warmup_steps": 0, "optim.decay_steps": 1000,
         "optim.end_lr_ratio": 1.0, "optim.weight_decay": 0.0}


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_the_clip_binds_from_the_second_epoch(objective):
  model, params = tiny_model.make_model(seed=0)
  spec = tiny_model.rl_spec(**_FAST, **{"optim.learning_rate": 5e-2, "ppo_epochs": 3,
                                        "objective.type": objective})
  batch = bandit.sample(model, params, jax.random.key(3))
  assert np.ptp(np.asarray(batch.rewards_b)) > 0  # Non-zero advantages.
  state = ts.init_train_state(model, params, spec)
  _, metrics = ts.make_train_step(model, spec)(state, batch)
  assert float(metrics["clip_frac_first_epoch"]) == 0.0  # Ratio 1 at the first update.
  assert float(metrics["clip_frac_last_epoch"]) > 0.0
  assert float(metrics["updates"]) == 3

  # The same by hand: the old policy scored once, then one update at a time.
  update = ts.make_update(model, spec)
  scored = learner.with_old_policy(model, params, batch, spec)
  np.testing.assert_allclose(np.asarray(scored.old_logp_bt),
                             np.asarray(batch.sampler_logp_bt), atol=1e-5)
  adv = ts.batch_advantages(spec, scored)
  state = ts.init_train_state(model, params, spec)
  clip = []
  for _ in range(3):
    state, m = update(state, scored, adv)
    clip.append(float(m["clip_frac"]))
    assert float(m["ppo_ratio_mean"]) != 1.0 or len(clip) == 1
  assert clip[0] == 0.0 and clip[1] > 0.0 and clip[2] > 0.0
  np.testing.assert_allclose(clip[-1], float(metrics["clip_frac_last_epoch"]), rtol=1e-5)


def test_minibatches_shuffle_rows_and_the_schedule_counts_batches():
  model, params = tiny_model.make_model(seed=0)
  spec = tiny_model.rl_spec(**{**_FAST, "optim.warmup_steps": 4}, **{
      "optim.learning_rate": 1e-2, "ppo_epochs": 2, "minibatches": 4})
  batch = bandit.sample(model, params, jax.random.key(4))
  state = ts.init_train_state(model, params, spec)
  step = ts.make_train_step(model, spec)
  state, m1 = step(state, batch)
  assert int(state.step) == 8 and float(m1["updates"]) == 8
  state, m2 = step(state, batch)
  # Warmup over 4 rollout batches: every update of batch n uses the rate of batch n.
  assert float(m1["learning_rate"]) == 0.0
  assert float(m2["learning_rate"]) == pytest.approx(1e-2 / 4)
  with pytest.raises(ValueError, match="minibatches=3"):
    ts.make_train_step(model, tiny_model.rl_spec(**_FAST, minibatches=3))(state, batch)


def _episodes_to_learn(epochs: int, threshold: float = 0.6, max_steps: int = 40) -> int:
  model, params = tiny_model.make_model(seed=0)
  spec = tiny_model.rl_spec(**_FAST, **{"optim.learning_rate": 3e-3, "ppo_epochs": epochs})
  state = ts.init_train_state(model, params, spec)
  step = ts.make_train_step(model, spec)
  for n, key in enumerate(jax.random.split(jax.random.key(1), max_steps), 1):
    state, _ = step(state, bandit.sample(model, state.params, key))
    if bandit.expected_reward(model, state.params, seed=100 + n, batches=2) >= threshold:
      return n * bandit.B
  return (max_steps + 1) * bandit.B


def test_four_epochs_learn_the_bandit_from_fewer_sampled_episodes():
  one, four = _episodes_to_learn(1), _episodes_to_learn(4)
  assert four < 0.6 * one, (one, four)
