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


def _shorten_rows(batch, rows):
  """`batch` with its last token dropped from `rows`: their position -1, loss mask 0,
  sampler log-prob 0, expert 0 and block -1 there, as to_batch pads."""
  last = batch.length - 1
  cut_bt = np.zeros(batch.tokens_bt.shape, bool)
  cut_bt[rows, last] = True
  where = lambda x, value: jnp.where(cut_bt, value, x)
  replay = tuple({"experts": jnp.where(cut_bt[..., None], 0, layer["experts"]),
                  "blocks": jnp.where(cut_bt[:, None, :, None], -1, layer["blocks"])}
                 for layer in batch.replay)
  return batch.replace(tokens_bt=where(batch.tokens_bt, 0),
                       positions_bt=where(batch.positions_bt, -1),
                       loss_mask_bt=where(batch.loss_mask_bt, 0.0),
                       sampler_logp_bt=where(batch.sampler_logp_bt, 0.0), replay=replay)


def test_minibatches_run_cut_to_their_own_length_and_train_the_same():
  model, params = tiny_model.make_model(seed=0)
  spec = tiny_model.rl_spec(**{"replay.sampling_mask": False, "loss.kl_coef": 0.1,
                               "optim.learning_rate": 1e-2, "ppo_epochs": 2,
                               "minibatches": 4})
  sampled = bandit.sample(model, params, jax.random.key(3))
  short_rows = np.arange(0, bandit.B, 2)  # Half the rows end a token early.
  batch = _pad(_shorten_rows(sampled, short_rows), sampled.length + 11)
  row_lengths = np.full(bandit.B, sampled.length)
  row_lengths[short_rows] -= 1
  lengths = (sampled.length - 1, sampled.length, batch.length)

  cut = ts.make_train_step(model, spec, donate=True, lengths=lengths)
  state = _state(model, params, spec)
  cut.precompile(state, batch)
  state, _ = cut(state, batch)  # Row lengths read from the batch (one process).
  step = int(state.step)  # Its row order (module doc); the call below spends the state.
  with _backend_compiles() as seen:
    got_state, got_metrics = cut(state, batch, row_lengths)
    jax.block_until_ready(got_state)
  assert not seen, seen  # Every minibatch length was compiled ahead.

  # Which length each update ran at.
  plan = ts.minibatch_rows(spec, bandit.B, step)
  assert len(plan) == 8 and all(
      np.array_equal(np.sort(np.concatenate(plan[e * 4:(e + 1) * 4])), np.arange(bandit.B))
      for e in range(2))
  want_lengths = [sampled.length - 1 if set(rows) <= set(short_rows) else sampled.length
                  for rows in plan]
  assert float(got_metrics["learner/minibatch_length"]) == pytest.approx(
      np.mean(want_lengths))
  assert float(got_metrics["learner/minibatch_length"]) < batch.length

  plain = ts.make_train_step(model, spec, donate=True)
  want_state, _ = plain(_state(model, params, spec), batch)
  want_state, want_metrics = plain(want_state, batch)
  for a, b in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  for key in ("loss", "kl_to_ref", "clip_frac_last_epoch"):
    np.testing.assert_allclose(float(got_metrics[key]), float(want_metrics[key]),
                               rtol=1e-4, atol=1e-6)


def test_minibatch_length_is_the_smallest_that_holds_its_rows():
  assert ts.minibatch_length(np.array([300, 500]), (256, 512, 768), 768) == 512
  assert ts.minibatch_length(np.array([512]), (256, 512, 768), 768) == 512
  assert ts.minibatch_length(np.array([513]), (256, 512, 768), 768) == 768
  assert ts.minibatch_length(np.array([100]), (), 768) == 768  # No lengths: the batch's.
  assert ts.minibatch_length(np.array([100]), (512,), 300) == 300  # Never past the batch.
  with pytest.raises(ValueError, match="longer than its batch"):
    ts.minibatch_length(np.array([800]), (256, 512, 768), 768)


def test_row_lengths_must_match_the_batch():
  model, params = tiny_model.make_model(seed=0)
  spec = tiny_model.rl_spec(**{"replay.sampling_mask": False, "ppo_epochs": 2})
  batch = bandit.sample(model, params, jax.random.key(3))
  step = ts.make_train_step(model, spec, lengths=(2, batch.length))
  with pytest.raises(ValueError, match="one length per row"):
    step(_state(model, params, spec), batch, np.array([batch.length] * 3))
