"""Donated train and SFT steps: the state passed in is spent (its buffers become the new
state's), the frozen reference is not, and the numbers equal an undonated step's."""

import jax
import numpy as np
import pytest

from agentic_rl.rl import train_step as ts
from agentic_rl.train import sft
from tests.rl import test_bandit as bandit
from tests.rl import tiny_model


def _fresh_state(model, params, spec):
  # Copies: each state owns its buffers, so donating one leaves the other intact. The
  # reference shares the params' buffers, as a run's reference taken at RL's start does.
  params = jax.tree.map(lambda x: x.copy(), params)
  return ts.init_train_state(model, params, spec, ref_params=params)


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_donated_train_step_spends_the_state_but_not_the_reference(epochs):
  model, params = tiny_model.make_model(seed=0)
  spec = tiny_model.rl_spec(**{"replay.sampling_mask": False, "loss.kl_coef": 0.1,
                               "optim.learning_rate": 1e-2, "ppo_epochs": epochs})
  batch = bandit.sample(model, params, jax.random.key(3))
  kept = _fresh_state(model, params, spec)
  want_state, want_metrics = ts.make_train_step(model, spec)(kept, batch)
  assert not any(x.is_deleted() for x in jax.tree.leaves(kept))  # Undonated: intact.

  spent = _fresh_state(model, params, spec)
  got_state, got_metrics = ts.make_train_step(model, spec, donate=True)(spent, batch)
  assert all(x.is_deleted() for x in jax.tree.leaves(spent.opt_state))
  assert all(x.is_deleted() for x in jax.tree.leaves(spent.params))
  # The reference shared the params' buffers (spent with them): the new state carries a
  # copy of it, made once and never donated.
  for a, b in zip(jax.tree.leaves(got_state.ref_params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves((got_state, got_metrics)),
                  jax.tree.leaves((want_state, want_metrics))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  again, _ = ts.make_train_step(model, spec, donate=True)(got_state, batch)
  assert again.ref_params is got_state.ref_params  # No second copy.
  assert not any(x.is_deleted() for x in jax.tree.leaves(got_state.ref_params))


def test_a_donated_sft_step_spends_the_state():
  model, params = tiny_model.make_model(seed=0)
  spec = tiny_model.rl_spec(**{"optim.learning_rate": 1e-2})
  optimizer = ts.make_optimizer(spec)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, model.spec.vocab_size, (4, 16)).astype(np.int32)
  batch = {"tokens_bt": tokens,
           "positions_bt": np.broadcast_to(np.arange(16, dtype=np.int32), (4, 16)).copy(),
           "loss_mask_bt": (np.arange(16) >= 8).astype(np.float32)[None].repeat(4, 0)}
  kept = ts.init_train_state(model, jax.tree.map(lambda x: x.copy(), params), spec)
  want_state, want_metrics = sft.make_sft_step(model, optimizer)(kept, batch)
  spent = ts.init_train_state(model, jax.tree.map(lambda x: x.copy(), params), spec)
  got_state, got_metrics = sft.make_sft_step(model, optimizer, donate=True)(spent, batch)
  assert all(x.is_deleted() for x in jax.tree.leaves(spent.params))
  assert not any(x.is_deleted() for x in jax.tree.leaves(kept.params))
  for a, b in zip(jax.tree.leaves((got_state, got_metrics)),
                  jax.tree.leaves((want_state, want_metrics))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
