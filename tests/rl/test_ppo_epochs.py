"""Several PPO epochs over one rollout batch: the old policy is the behaviour policy, so the
clip binds from the second update on, and the bandit learns from fewer sampled episodes."""

import jax
import numpy as np
import pytest

from agentic_rl.records import batch as batch_lib
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


def test_minibatches_shuffle_rows_and_the_schedule_counts_batches(monkeypatch):
  # Spy on the rows each update trains on (a callback from inside the jitted update).
  rows_seen = []
  take_rows = ts._take_rows

  def spy(tree, rows):
    if isinstance(tree, batch_lib.Batch):
      jax.debug.callback(lambda r: rows_seen.append(np.asarray(r)), rows, ordered=True)
    return take_rows(tree, rows)

  monkeypatch.setattr(ts, "_take_rows", spy)
  model, params = tiny_model.make_model(seed=0)
  spec = tiny_model.rl_spec(**{**_FAST, "optim.warmup_steps": 4}, **{
      "optim.learning_rate": 1e-2, "ppo_epochs": 2, "minibatches": 4})
  batch = bandit.sample(model, params, jax.random.key(4))
  start = ts.init_train_state(model, params, spec)
  step = ts.make_train_step(model, spec)

  def rows_of(state):
    """(new state, metrics, [epochs, B] row order of each epoch's four minibatches)."""
    rows_seen.clear()
    state, metrics = step(state, batch)
    jax.effects_barrier()
    rows = np.stack(rows_seen)
    assert rows.shape == (8, bandit.B // 4), rows.shape
    return state, metrics, rows.reshape(2, bandit.B)

  state, m1, order1 = rows_of(start)
  assert int(state.step) == 8 and float(m1["updates"]) == 8
  state, m2, order2 = rows_of(state)
  # Each epoch's minibatches cover every row once, in a shuffled order of its own.
  epochs = np.concatenate([order1, order2])
  for order in epochs:
    np.testing.assert_array_equal(np.sort(order), np.arange(bandit.B))
  assert not any(np.array_equal(o, np.arange(bandit.B)) for o in epochs), epochs
  assert len({o.tobytes() for o in epochs}) == 4, epochs
  # Deterministic per update count: the same state again draws the same rows (a resumed
  # run shuffles as an uninterrupted one), another step draws others (checked above).
  _, _, again = rows_of(start)
  np.testing.assert_array_equal(again, order1)
  # Warmup over 4 rollout batches: every update of batch n (1-based) uses its rate n/4.
  assert float(m1["learning_rate"]) == pytest.approx(1e-2 / 4)
  assert float(m2["learning_rate"]) == pytest.approx(2e-2 / 4)
  with pytest.raises(ValueError, match="minibatches=3"):
    ts.make_train_step(model, tiny_model.rl_spec(**_FAST, minibatches=3))(state, batch)


def _np_token_logp(logits_btv, tokens_bt):
  """float64 target-aligned log-probs at temperature 1 (column 0 unscored)."""
  z = np.asarray(logits_btv, np.float64)[:, :-1]
  z = z - z.max(-1, keepdims=True)
  logp_btv = z - np.log(np.exp(z).sum(-1, keepdims=True))
  tokens_bt = np.asarray(tokens_bt)
  target_bt = np.take_along_axis(logp_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]
  return np.concatenate([np.zeros((len(tokens_bt), 1)), target_bt], axis=1)


def test_epochs_score_the_kl_against_the_reference_params():
  """With several updates per batch the reference is scored once, before the first update:
  by ref_params, not by the params the step starts from. A learning rate of 1e-9 leaves
  the policy where it starts (to float32 round-off), so every update's KL is the same,
  computed here in float64."""
  model, params = tiny_model.make_model(seed=0)
  _, ref_params = tiny_model.make_model(seed=1)  # another policy: KL clearly above 0
  spec = tiny_model.rl_spec(**{**_FAST, "optim.warmup_steps": 4}, **{
      "optim.learning_rate": 1e-9, "ppo_epochs": 2, "minibatches": 2, "loss.kl_coef": 0.1})
  batch = bandit.sample(model, params, jax.random.key(5))
  state = ts.init_train_state(model, params, spec, ref_params=ref_params)
  new, metrics = ts.make_train_step(model, spec)(state, batch)
  assert float(metrics["learning_rate"]) == pytest.approx(1e-9 / 4)
  assert float(metrics["updates"]) == 4
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       rtol=0, atol=1e-8), new.params, params)

  # The learner scores both policies with the sampler's routing and blocks forced.
  forward = tiny_model.forward_fn(model)
  logp = {}
  for name, p in (("policy", params), ("reference", ref_params)):
    logits, _, _ = forward(p, batch.tokens_bt, batch.positions_bt, None, batch.replay)
    logp[name] = _np_token_logp(logits, batch.tokens_bt)
  mask = np.asarray(batch.loss_mask_bt) > 0
  log_ratio = (logp["policy"] - logp["reference"])[mask]  # log pi / pi_ref
  want = np.mean(np.exp(-log_ratio) - 1.0 + log_ratio)  # k3, token mean (every row has L tokens)
  assert want > 1e-2
  np.testing.assert_allclose(float(metrics["kl_to_ref"]), want, rtol=1e-4)


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


def test_sampler_denominator_skips_the_old_policy_forward(monkeypatch):
  """old_logp_source='sampler' with no correction and no critic: the step runs no forward
  before its updates, trains exactly as with the old policy scored, and its mismatch is
  the first update's minibatch's, measured at the params the batch was sampled with."""
  model, params = tiny_model.make_model(seed=0)
  spec = tiny_model.rl_spec(**_FAST, **{"optim.learning_rate": 5e-2, "ppo_epochs": 2,
                                        "minibatches": 2, "objective.old_logp_source": "sampler"})
  assert not learner.needs_old_policy_forward(spec)
  for changes in ({"objective.old_logp_source": "learner"}, {"correction.type": "tis"}):
    assert learner.needs_old_policy_forward(tiny_model.rl_spec(**_FAST, **changes))
  batch = bandit.sample(model, params, jax.random.key(3))
  # A sampler that disagrees by a known amount, so the mismatch is far above round-off.
  noise = np.random.default_rng(4).normal(scale=0.1, size=batch.sampler_logp_bt.shape)
  batch = batch.replace(sampler_logp_bt=batch.sampler_logp_bt + noise.astype(np.float32))
  scored = learner.with_old_policy(model, params, batch, spec)
  assert scored.old_logp_bt is None and scored.old_values_bt is None
  # No forward: no matmul in what the step runs before its updates.
  jaxpr = jax.make_jaxpr(lambda b: learner.with_old_policy(model, params, b, spec))(batch)
  assert "dot_general" not in str(jaxpr)

  new, metrics = ts.make_train_step(model, spec)(ts.init_train_state(model, params, spec),
                                                 batch)
  monkeypatch.setattr(learner, "needs_old_policy_forward", lambda spec: True)
  forced, _ = ts.make_train_step(model, spec)(ts.init_train_state(model, params, spec), batch)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       rtol=1e-6, atol=1e-7),
               new.params, forced.params)

  rows = np.split(np.random.default_rng([17, 0]).permutation(bandit.B), 2)[0]
  first = jax.tree.map(lambda x: x[rows], batch)
  want = learner.mismatch_metrics(model, params, first, spec)
  assert float(metrics["mismatch/num_tokens"]) == float(want["mismatch/num_tokens"]) > 0
  assert float(want["mismatch/abs_logp_diff_mean"]) > 0.05
  for key in ("mismatch/abs_logp_diff_mean", "mismatch/abs_logp_diff_max", "mismatch/k3"):
    assert float(metrics[key]) == pytest.approx(float(want[key]), rel=1e-3, abs=1e-12), key
