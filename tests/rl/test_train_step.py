"""The jitted train step: micro-batch accumulation, the non-finite guard, the schedule,
metrics of an on-policy batch, the routing-bias update and the KL to the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.records import batch as batch_lib
from agentic_rl.rl import train_step as ts
from tests.rl import tiny_model

B, T, PROMPT = 8, 24, 8
STEP_CHANGES = {"replay.sampling_mask": False, "optim.learning_rate": 1e-2,
                "optim.warmup_steps": 0, "optim.decay_steps": 100, "optim.eps": 1.0,
                "optim.weight_decay": 0.0}


def _on_policy_batch(model, params, rewards, seed=0):
  """A batch sampled by `params`: the uncached sampler's log-probs (not the learner's code)
  and its routing and block record, which the learner replays."""
  tokens, positions, mask = tiny_model.random_sequences(model.spec.vocab_size, B, T, PROMPT, seed)
  sampler_logp, replay = tiny_model.uncached_sampler(model, params, tokens, PROMPT)
  return batch_lib.make_batch(tokens, positions, mask, sampler_logp * mask, rewards,
                              np.arange(B) // 4, replay=replay)


@pytest.fixture(scope="module")
def setup():
  # Two compiled steps (M = 1, 2) serve every test here: compiles dominate on CPU.
  # The MoE aux loss is off: it is not additive over micro-batches (f_e P_e per batch).
  model, params = tiny_model.make_model(**{"moe.aux_loss_coef": 0.0,
                                           "moe.use_routing_bias": True,
                                           "moe.routing_bias_rate": 0.01})
  changes = dict(STEP_CHANGES, **{"loss.kl_coef": 0.1, "loss.entropy_coef": 0.01})
  spec1 = tiny_model.rl_spec(**changes)
  spec2 = tiny_model.rl_spec(**changes, **{"optim.num_micro_batches": 2})
  rewards = np.array([1, 0, 0, 1, 0.2, 0.9, 0.5, 0.4], np.float32)
  batch = _on_policy_batch(model, params, rewards)
  return dict(model=model, params=params, spec1=spec1, spec2=spec2, batch=batch,
              step1=ts.make_train_step(model, spec1), step2=ts.make_train_step(model, spec2))


def _init(s, spec):
  return ts.init_train_state(s["model"], s["params"], spec, ref_params=s["params"])


def test_micro_batches_give_the_full_batch_update(setup):
  s = setup
  state = _init(s, s["spec1"])
  new1, m1 = s["step1"](state, s["batch"])
  new2, m2 = s["step2"](state, s["batch"])
  for k in ("loss", "pg_loss", "entropy", "kl_to_ref", "grad_norm", "mismatch/k3",
            "advantage_mean"):
    np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5, atol=1e-7, err_msg=k)
  # optim.eps = 1 makes Adam's first step ~ lr * g (linear in the gradient), so the
  # parameter updates expose any accumulation error.
  d1 = jax.tree.map(lambda a, b: np.asarray(a - b), new1.params, s["params"])
  d2 = jax.tree.map(lambda a, b: np.asarray(a - b), new2.params, s["params"])
  moved = jax.tree.leaves(jax.tree.map(lambda a: np.abs(a).max(), d1))
  assert max(moved) > 1e-4
  # atol: one float32 ulp of the parameters (~1e-8) shows up in the differences.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7), d1, d2)


def test_on_policy_metrics_and_loss_value(setup):
  s = setup
  state = _init(s, s["spec1"])
  _, m = s["step1"](state, s["batch"])
  # The sampler's own params, its record replayed: no mismatch beyond float32 round-off
  # of |log p| (a few ulps against the sampler's float64), full agreement, ratio 1.
  for k in ("mismatch/k1", "mismatch/k3", "mismatch/abs_logp_diff_mean"):
    assert abs(float(m[k])) < 1e-6, (k, float(m[k]))
  assert float(m["mismatch/abs_logp_diff_max"]) < 2e-6
  assert float(m["mismatch/ratio_outside_frac"]) == 0.0
  assert float(m["mismatch/routing_agreement"]) == 1.0
  assert float(m["mismatch/block_agreement"]) == 1.0
  assert float(m["clip_frac"]) == 0.0 and float(m["ppo_ratio_mean"]) == pytest.approx(1.0)
  assert float(m["update_applied"]) == 1.0 and int(m["skipped_steps"]) == 0
  assert float(m["update_loss_tokens"]) == B * (T - PROMPT)
  assert m["mismatch/by_position/k3"].shape == (s["spec1"].mismatch.num_position_buckets,)
  assert m["mismatch/by_turn/k3"].shape == (s["spec1"].max_turns,)
  # At ratio 1 the token-mean PPO loss is -mean_t A_t; GRPO by hand over the two groups.
  r = np.asarray(s["batch"].rewards_b, np.float64).reshape(2, 4)
  a = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
  assert float(m["pg_loss"]) == pytest.approx(-a.mean(), abs=1e-6)
  assert float(m["kl_to_ref"]) == pytest.approx(0.0, abs=1e-7)  # policy = reference
  assert float(m["loss"]) == pytest.approx(float(m["pg_loss"]) - 0.01 * float(m["entropy"]),
                                           abs=1e-6)


def test_non_finite_guard_skips_and_counts(setup):
  s = setup
  state = _init(s, s["spec2"])
  bad = s["batch"].replace(rewards_b=s["batch"].rewards_b.at[0].set(jnp.nan))
  new, m = s["step2"](state, bad)
  assert float(m["update_applied"]) == 0.0
  assert int(new.skipped_steps) == 1 and int(new.step) == 1
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               new.params, state.params)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               new.opt_state, state.opt_state)
  new2, m2 = s["step2"](new, s["batch"])
  assert float(m2["update_applied"]) == 1.0
  assert int(new2.skipped_steps) == 1 and int(new2.step) == 2
  schedule = ts.learning_rate_schedule(s["spec2"])
  assert float(m2["learning_rate"]) == pytest.approx(float(schedule(0)))  # first applied update


def test_replay_flags_need_a_record(setup):
  s = setup
  with pytest.raises(ValueError, match="config.rl.replay.routing=True"):
    s["step1"](_init(s, s["spec1"]), s["batch"].replace(replay=None))


def test_batch_must_split_into_micro_batches(setup):
  s = setup
  state = _init(s, s["spec2"])
  small = jax.tree.map(lambda x: x[:3], s["batch"])
  with pytest.raises(ValueError, match="num_micro_batches=2"):
    s["step2"](state, small)


@pytest.mark.parametrize("warmup,decay,end", [(10, 100, 0.1), (0, 50, 0.0), (5, 6, 0.5)])
def test_learning_rate_schedule_matches_formula(warmup, decay, end):
  spec = tiny_model.rl_spec(**{"optim.learning_rate": 3e-4, "optim.warmup_steps": warmup,
                               "optim.decay_steps": decay, "optim.end_lr_ratio": end})
  schedule = ts.learning_rate_schedule(spec)
  peak, low = 3e-4, 3e-4 * end
  for c in range(0, decay + 5):
    n = c + 1  # Batch c is the schedule's n-th update: the first learns.
    if n < warmup:
      want = peak * n / warmup
    else:
      frac = min(n - warmup, decay - warmup) / (decay - warmup)
      want = low + (peak - low) * 0.5 * (1 + np.cos(np.pi * frac))
    assert float(schedule(c)) == pytest.approx(want, rel=1e-5, abs=1e-12), c
  assert float(schedule(0)) > 0.0


def test_weight_decay_spares_vectors():
  model, _ = tiny_model.make_model(init=False, **{"moe.use_routing_bias": True})
  mask = ts.weight_decay_mask(model.param_shapes())
  assert not mask["layer_0"]["moe"]["routing_bias_e"]
  assert not mask["layer_0"]["attn_norm"]["scale"]
  assert mask["layer_0"]["moe"]["w_router_de"]


@pytest.mark.parametrize("which", ["step1", "step2"])
def test_routing_bias_update_and_kl_to_reference(setup, which):
  s = setup
  step, params, batch = s[which], s["params"], s["batch"]
  new, m = step(_init(s, s["spec1" if which == "step1" else "spec2"]), batch)
  assert float(m["update_applied"]) == 1.0
  # Expected bias step from the recorded (replayed) experts: fraction of assignments.
  experts = np.asarray(batch.replay[0]["experts"]).reshape(-1)
  load = np.bincount(experts, minlength=4) / experts.size
  want = 0.01 * np.sign(load.mean() - load)
  got = np.asarray(new.params["layer_0"]["moe"]["routing_bias_e"]) - np.asarray(
      params["layer_0"]["moe"]["routing_bias_e"])
  np.testing.assert_allclose(got, want, atol=1e-7)
  # The policy moved: a positive KL to the reference, and a measurable mismatch against
  # the (now stale) sampler record, while replay still pins the routing.
  _, m2 = step(new, batch)
  assert float(m2["kl_to_ref"]) > 1e-6
  assert float(m2["mismatch/k3"]) > 1e-6
  assert float(m2["mismatch/routing_agreement"]) == 1.0
  assert float(m2["loss"]) == pytest.approx(
      float(m2["pg_loss"]) + 0.1 * float(m2["kl_to_ref"]) - 0.01 * float(m2["entropy"]),
      abs=1e-6)
