"""Learner steps compiled ahead of time (train_step.PrecompilingJit, `precompile`): a step
at a precompiled length compiles nothing, and trains exactly as a step jit compiled."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.rl import train_step as ts
from tests.rl import test_bandit as bandit
from tests.rl import tiny_model


def _pad(batch, length):
  """The batch padded on the right to `length` tokens, as to_batch pads."""
  extra = length - batch.length
  pad = lambda x, value, axis=1: jnp.pad(x, [(0, extra) if a == axis else (0, 0)
                                            for a in range(x.ndim)], constant_values=value)
  replay = tuple({"experts": pad(layer["experts"], 0), "blocks": pad(layer["blocks"], -1, 2)}
                 for layer in batch.replay)
  return batch.replace(
      tokens_bt=pad(batch.tokens_bt, 0), positions_bt=pad(batch.positions_bt, -1),
      loss_mask_bt=pad(batch.loss_mask_bt, 0.0), sampler_logp_bt=pad(batch.sampler_logp_bt, 0.0),
      turn_index_bt=pad(batch.turn_index_bt, 0),
      process_reward_bt=pad(batch.process_reward_bt, 0.0), replay=replay)


@contextlib.contextmanager
def _backend_compiles():
  seen = []
  listener = lambda event, duration, **kw: seen.append(event) if event.endswith(
      "backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _state(model, params, spec):
  params = jax.tree.map(lambda x: x.copy(), params)
  return ts.init_train_state(model, params, spec, ref_params=params)


@pytest.mark.parametrize("epochs,minibatches", [(1, 1), (2, 2)])
def test_a_precompiled_length_compiles_nothing_and_trains_the_same(epochs, minibatches):
  model, params = tiny_model.make_model(seed=0)
  spec = tiny_model.rl_spec(**{"replay.sampling_mask": False, "loss.kl_coef": 0.1,
                               "optim.learning_rate": 1e-2, "ppo_epochs": epochs,
                               "minibatches": minibatches})
  batch = bandit.sample(model, params, jax.random.key(3))
  short, long = _pad(batch, batch.length + 3), _pad(batch, batch.length + 11)

  step = ts.make_train_step(model, spec, donate=True)
  state = _state(model, params, spec)
  with _backend_compiles() as seen:
    for b in (short, long):
      step.precompile(state, b)
  assert seen  # The programs compiled here, ahead of the steps...
  state, _ = step(state, short)  # (the host's small metric ops compile once, any length)
  with _backend_compiles() as seen:
    got_state, got_metrics = step(state, long)
    jax.block_until_ready(got_state)
  assert not seen, seen  # ...and not in a step at another precompiled length.

  plain = ts.make_train_step(model, spec, donate=True)
  want_state, _ = plain(_state(model, params, spec), short)
  want_state, want_metrics = plain(want_state, long)
  for a, b in zip(jax.tree.leaves((got_state, got_metrics)),
                  jax.tree.leaves((want_state, want_metrics))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
