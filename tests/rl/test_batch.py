"""Batch construction and its checks: each bad field is named."""

import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.records import batch as batch_lib
from agentic_rl.records import sampling_mask as sm
from tests.rl import tiny_model

B, T = 2, 6
MODEL, _ = tiny_model.make_model(init=False)
SPEC = MODEL.spec


def _good(**changes):
  tokens = np.arange(B * T).reshape(B, T) % SPEC.vocab_size
  mask = np.array([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]], np.float32)
  positions = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]])
  keep = np.zeros((B, T, SPEC.vocab_size), bool)
  keep[np.arange(B)[:, None], np.arange(T)[None], tokens] = True
  experts = np.zeros((B, T, SPEC.moe.num_experts_per_token), np.int32)
  experts[..., 1] = 1
  blocks = np.zeros((B, SPEC.num_kv_heads, T, SPEC.num_selected_blocks), np.int32)
  kw = dict(tokens_bt=tokens, positions_bt=positions, loss_mask_bt=mask,
            sampler_logp_bt=-0.5 * mask, rewards_b=[1.0, 0.0], group_id_b=[0, 0],
            turn_index_bt=np.zeros((B, T)), temperature=0.8,
            replay=({"experts": experts, "blocks": blocks},),
            sampling_mask_btw=sm.pack_mask(jnp.asarray(keep)))
  kw.update(changes)
  return batch_lib.make_batch(**kw)


def test_make_batch_fills_defaults_and_dtypes():
  batch = batch_lib.make_batch(np.zeros((B, T)), np.zeros((B, T)), np.zeros((B, T)),
                               np.zeros((B, T)), [0, 1], [0, 0])
  assert batch.tokens_bt.dtype == jnp.int32 and batch.loss_mask_bt.dtype == jnp.float32
  assert batch.turn_index_bt.shape == (B, T) and float(batch.process_reward_bt.sum()) == 0
  np.testing.assert_array_equal(batch.temperature_b, [1.0, 1.0])
  assert batch.replay is None and batch.sampling_mask_btw is None
  batch_lib.check_batch(_good(), SPEC, tiny_model.rl_spec())


@pytest.mark.parametrize("changes,field", [
    (dict(rewards_b=[1.0, 0.0, 2.0]), "rewards_b"),
    (dict(tokens_bt=np.full((B, T), 10_000)), "tokens_bt"),
    (dict(loss_mask_bt=np.ones((B, T))), "loss_mask_bt"),
    (dict(sampler_logp_bt=np.full((B, T), 0.5)), "sampler_logp_bt"),
    (dict(temperature=0.0), "temperature_b"),
    (dict(turn_index_bt=np.full((B, T), 99)), "turn_index_bt"),
    (dict(sampling_mask_btw=jnp.zeros((B, T, 8), jnp.uint8)), "sampling_mask_btw"),
    (dict(replay=({"experts": np.zeros((B, T, 5), np.int32)},)), r"replay\[0\]\['experts'\]"),
    (dict(replay=({"experts": np.full((B, T, 2), 9, np.int32)},)), r"replay\[0\]\['experts'\]"),
])
def test_check_batch_names_the_bad_field(changes, field):
  with pytest.raises(ValueError, match=f"Batch.{field}"):
    batch_lib.check_batch(_good(**changes), SPEC, tiny_model.rl_spec())


def test_drawn_token_outside_its_sampling_mask_is_rejected():
  keep = np.ones((B, T, SPEC.vocab_size), bool)
  keep[0, 3, :] = False
  keep[0, 3, 0] = True  # token [0, 3] is 3, not 0
  with pytest.raises(ValueError, match="inside its own sampling mask"):
    batch_lib.check_batch(_good(sampling_mask_btw=sm.pack_mask(jnp.asarray(keep))), SPEC)


def test_truncated_cuts_every_per_token_field_on_its_token_axis():
  rng = np.random.default_rng(0)
  blocks = rng.integers(-1, 3, (B, SPEC.num_kv_heads, T, SPEC.num_selected_blocks))
  batch = _good(replay=({"experts": np.zeros((B, T, SPEC.moe.num_experts_per_token)),
                         "blocks": blocks},),
                old_logp_bt=rng.normal(size=(B, T)), ref_logp_bt=rng.normal(size=(B, T)),
                old_values_bt=rng.normal(size=(B, T)))
  cut = batch.truncated(4)
  assert cut.length == 4 and cut.batch_size == B
  for name in ("tokens_bt", "positions_bt", "loss_mask_bt", "sampler_logp_bt",
               "turn_index_bt", "process_reward_bt", "old_logp_bt", "old_values_bt",
               "ref_logp_bt"):
    np.testing.assert_array_equal(getattr(cut, name), np.asarray(getattr(batch, name))[:, :4])
  np.testing.assert_array_equal(cut.sampling_mask_btw, batch.sampling_mask_btw[:, :4])
  np.testing.assert_array_equal(cut.replay[0]["experts"], batch.replay[0]["experts"][:, :4])
  np.testing.assert_array_equal(cut.replay[0]["blocks"], blocks[:, :, :4])
  for name in ("rewards_b", "group_id_b", "temperature_b"):
    np.testing.assert_array_equal(getattr(cut, name), getattr(batch, name))
  assert batch.truncated(T) is batch
  for bad in (0, T + 1):
    with pytest.raises(ValueError, match=rf"truncated\({bad}\)"):
      batch.truncated(bad)
