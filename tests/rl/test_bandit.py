"""A contextual bandit over token sequences, with a known optimum, learned by the real
tiny model and the real train step, under GRPO and under PPO with GAE (value head).

Context c in {0..3} is the prompt token; the policy writes L = 3 tokens; the reward
is the fraction of them in S_c = {y : y mod 4 = (c + 1) mod 4} (copying the context
earns nothing). A uniform policy scores 1/4; the optimum (all mass on S_c) scores 1.
The sampler here decodes token by token, records its log-probs, routing and block
selection, and the learner replays them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.records import batch as batch_lib
from agentic_rl.rl import train_step as ts
from tests.rl import tiny_model

NUM_CONTEXTS, GROUP, L = 4, 8, 3
B, T = NUM_CONTEXTS * GROUP, 1 + L


def reward(tokens_bt):
  target = (tokens_bt[:, :1] + 1) % NUM_CONTEXTS
  return np.mean(tokens_bt[:, 1:] % NUM_CONTEXTS == target, axis=1).astype(np.float32)


@functools.partial(jax.jit, static_argnums=0)
def _decode_step(model, params, tokens_bt, i, rng):
  """Scores position i with the prefix 0..i (later positions are padding), draws token i+1."""
  arange_t = jnp.arange(T, dtype=jnp.int32)
  positions_bt = jnp.broadcast_to(jnp.where(arange_t <= i, arange_t, -1), tokens_bt.shape)
  logits_btv, _, aux = model.forward(params, tokens_bt, positions_bt)
  logits_bv = jax.lax.dynamic_index_in_dim(logits_btv, i, axis=1, keepdims=False)
  token_b = jax.random.categorical(rng, logits_bv).astype(jnp.int32)
  logp_b = jnp.take_along_axis(jax.nn.log_softmax(logits_bv), token_b[:, None], axis=-1)[:, 0]
  tokens_bt = jax.lax.dynamic_update_index_in_dim(tokens_bt, token_b, i + 1, axis=1)
  record = {"experts": jax.lax.dynamic_index_in_dim(aux["layers"][0]["experts"], i, axis=1),
            "blocks": jax.lax.dynamic_index_in_dim(aux["layers"][0]["blocks"], i, axis=2)}
  return tokens_bt, logp_b, record


def sample(model, params, rng):
  """One batch: every context GROUP times; log-probs and selections as the sampler saw them."""
  contexts_b = np.repeat(np.arange(NUM_CONTEXTS, dtype=np.int32), GROUP)
  tokens_bt = jnp.zeros((B, T), jnp.int32).at[:, 0].set(contexts_b)
  logps, records = [], []
  for i, key in enumerate(jax.random.split(rng, T)):
    # Step T-1 only records the last token's selections (its draw is discarded).
    new_tokens, logp_b, record = _decode_step(model, params, tokens_bt, min(i, T - 1), key)
    if i < T - 1:
      tokens_bt = new_tokens
      logps.append(logp_b)
    records.append(record)
  tokens = np.asarray(tokens_bt)
  sampler_logp = np.concatenate([np.zeros((B, 1)), np.stack(logps, 1)], axis=1)
  replay = ({"experts": jnp.concatenate([r["experts"] for r in records], axis=1),
             "blocks": jnp.concatenate([r["blocks"] for r in records], axis=2)},)
  mask = np.zeros((B, T), np.float32)
  mask[:, 1:] = 1
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
  return batch_lib.make_batch(tokens, positions, mask, sampler_logp * mask, reward(tokens),
                              contexts_b, replay=replay)


def expected_reward(model, params, seed, batches=8):
  """Monte-Carlo estimate over batches * B sequences."""
  keys = jax.random.split(jax.random.key(seed), batches)
  return float(np.mean([np.asarray(sample(model, params, k).rewards_b).mean() for k in keys]))


def run_bandit(model_changes, rl_changes, steps):
  model, params = tiny_model.make_model(seed=0, **model_changes)
  spec = tiny_model.rl_spec(**{"replay.sampling_mask": False, "optim.learning_rate": 1e-2,
                               "optim.warmup_steps": 0, "optim.decay_steps": 1000,
                               "optim.end_lr_ratio": 1.0, "optim.weight_decay": 0.0},
                            **rl_changes)
  state = ts.init_train_state(model, params, spec)
  step = ts.make_train_step(model, spec)
  before = expected_reward(model, params, seed=100)
  keys = jax.random.split(jax.random.key(1), steps)
  metrics = []
  for key in keys:
    state, m = step(state, sample(model, state.params, key))
    metrics.append({k: float(v) for k, v in m.items() if np.ndim(v) == 0})
  after = expected_reward(model, state.params, seed=200)
  return before, after, metrics, state


def _check(before, after, metrics, state):
  assert before < 0.4, before  # about 1/4 for the untrained policy
  assert after > 0.75, (before, after)
  assert int(state.skipped_steps) == 0
  # The sampler's record made the learner's forward the sampler's: no mismatch.
  assert max(m["mismatch/k3"] for m in metrics) < 1e-6
  assert max(m["mismatch/abs_logp_diff_max"] for m in metrics) < 1e-5
  assert min(m["mismatch/routing_agreement"] for m in metrics) == 1.0


def test_grpo_learns_the_contextual_bandit():
  before, after, metrics, state = run_bandit({}, {"advantage.estimator": "grpo"}, steps=40)
  _check(before, after, metrics, state)


def test_ppo_with_gae_learns_the_contextual_bandit():
  before, after, metrics, state = run_bandit(
      {"value_head": True},
      {"advantage.estimator": "gae", "advantage.gamma": 1.0, "advantage.gae_lambda": 0.95,
       "objective.type": "ppo_clip", "loss.value_coef": 0.5}, steps=40)
  _check(before, after, metrics, state)
  # The critic learned: its mean value followed the return upward from 0.
  assert metrics[-1]["value_mean"] > 0.3, metrics[-1]
  assert metrics[-1]["value_loss"] < metrics[0]["value_loss"]
