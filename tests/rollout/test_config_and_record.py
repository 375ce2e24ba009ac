"""config.rollout validation, and the trajectory record's conversion to the learner's batch."""

import numpy as np
import pytest

from agentic_rl.model import config as model_config
from agentic_rl.records import batch as batch_lib
from agentic_rl.rollout import config as config_lib
from agentic_rl.records import trajectory as trajectory_lib
from tests.rollout.conftest import tiny_model_config


@pytest.fixture(scope="module")
def spec():
  return model_config.validate(tiny_model_config())


def with_field(**changes):
  c = config_lib.default_rollout_config()
  c.update(changes)
  return c


def test_defaults_validate_and_zero_means_capacity(spec):
  r = config_lib.validate(config_lib.default_rollout_config(), spec)
  assert r.max_len == spec.max_seq_len and r.max_total_tokens == r.max_len
  assert r.token_limit == r.max_len and r.token_limit_reason == config_lib.END_CONTEXT_LIMIT
  r = config_lib.validate(with_field(max_total_tokens=100), spec)
  assert r.token_limit == 100 and r.token_limit_reason == config_lib.END_TOKEN_BUDGET
  assert config_lib.validate(with_field(temperature=0.0), spec).recorded_temperature == 1.0


@pytest.mark.parametrize("changes,field", [
    (dict(num_slots=0), "num_slots"),
    (dict(max_len=4096), "max_len"),  # Above model.max_seq_len.
    (dict(max_len=1022), "max_len"),  # Not a multiple of block_size.
    (dict(max_len=512, prefill_chunk=1024), "prefill_chunk"),
    (dict(prefill_rows=9), "prefill_rows"),
    (dict(prefill_rows=3, prompt_store_rows=2), "prefill_rows"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=321), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_total_tokens=1), "max_total_tokens"),
    (dict(max_turns=0), "max_turns"),
    (dict(group_size=True), "group_size"),
])
def test_bad_values_name_the_field(spec, changes, field):
  with pytest.raises(ValueError, match=f"config.rollout.{field}="):
    config_lib.validate(with_field(**changes), spec)


def test_unknown_fields_are_refused(spec):
  c = config_lib.default_rollout_config()
  c.slots = 4
  with pytest.raises(ValueError, match="config.rollout has unknown field slots; valid fields: "
                                       "decode_steps_per_call, env_threads, group_size, "):
    config_lib.validate(c, spec)


def test_the_sampling_seed_is_the_run_seed(spec):
  assert config_lib.validate(config_lib.default_rollout_config(), spec, seed=7).seed == 7
  c = config_lib.default_rollout_config()
  c.seed = 3
  with pytest.raises(ValueError, match="config.rollout.seed is set from config.seed"):
    config_lib.validate(c, spec)


def build_trajectory(spec, *, prompt, turns, tool_len, rng):
  """A hand-made record: prompt, then (generated, tool) per turn, with fake replay."""
  keys = [(), ("experts", "blocks"), ("experts",)]
  b = trajectory_lib.TrajectoryBuilder(vocab_size=spec.vocab_size, layer_replay_keys=keys)
  b.add_context(rng.integers(0, 256, prompt).tolist())
  for i, n in enumerate(turns):
    if i:
      b.add_context(rng.integers(0, 256, tool_len).tolist())
      b.add_context([263], new_turn=True)
    b.begin_turn()
    for _ in range(n):
      mask = np.zeros(40, np.uint8)
      mask[0] = 0xFF
      b.add_generated(int(rng.integers(0, 8)), -0.5, mask, version=3)
    b.end_turn(config_lib.TURN_STOP)
    b.record_step(0.25 * (i + 1), {"tool": "say"})
  n = b.length
  k, kv, n_sel = spec.moe.num_experts_per_token, spec.num_kv_heads, spec.num_selected_blocks
  replay = ({}, {"experts": rng.integers(0, 4, (1, n, k)),
                 "blocks": rng.integers(-1, 3, (1, kv, n, n_sel))},
            {"experts": rng.integers(0, 4, (1, n, k))})
  b.add_replay(replay, 0, n)
  return b.finish(trajectory_id=0, group_id=5, member=0, seed=1, task=None, reward=0.5,
                  end_reason="submit", temperature=0.7, prompt_length=prompt), replay


def test_record_converts_into_a_valid_learner_batch(spec):
  rng = np.random.default_rng(0)
  t1, replay1 = build_trajectory(spec, prompt=5, turns=[3, 2], tool_len=4, rng=rng)
  t2, _ = build_trajectory(spec, prompt=7, turns=[4], tool_len=0, rng=rng)
  batch = trajectory_lib.to_batch([t1, t2], length=24)
  batch_lib.check_batch(batch, spec)
  assert batch.tokens_bt.shape == (2, 24)
  np.testing.assert_array_equal(batch.positions_bt[0], list(range(t1.length)) +
                                [-1] * (24 - t1.length))
  # t1: prompt 5, turn 0 = tokens 5..7, tool 8..11, header 12, turn 1 = 13..14.
  np.testing.assert_array_equal(np.nonzero(np.asarray(batch.loss_mask_bt[0]))[0],
                                [5, 6, 7, 13, 14])
  np.testing.assert_array_equal(batch.turn_index_bt[0, :t1.length],
                                [0] * 12 + [1] * 3)
  np.testing.assert_allclose(np.nonzero(np.asarray(batch.process_reward_bt[0]))[0], [7, 14])
  np.testing.assert_allclose(batch.process_reward_bt[0, [7, 14]], [0.25, 0.5])
  np.testing.assert_allclose(batch.temperature_b, 0.7)
  np.testing.assert_array_equal(batch.group_id_b, [5, 5])
  np.testing.assert_array_equal(batch.replay[1]["experts"][0, :t1.length],
                                replay1[1]["experts"][0])
  # Padding: expert 0 (a valid id), block -1 (skipped), mask bytes 0.
  assert (np.asarray(batch.replay[1]["experts"])[0, t1.length:] == 0).all()
  assert (np.asarray(batch.replay[1]["blocks"])[0, :, t1.length:] == -1).all()
  assert (np.asarray(batch.sampling_mask_btw)[0, t1.length:] == 0).all()
  assert t1.policy_version.tolist() == [-1] * 5 + [3] * 3 + [-1] * 5 + [3] * 2


def test_record_refuses_tokens_without_replay(spec):
  b = trajectory_lib.TrajectoryBuilder(vocab_size=spec.vocab_size,
                                       layer_replay_keys=[(), (), ()])
  b.add_context([1, 2, 3])
  b.add_replay(({}, {}, {}), 0, 2)
  with pytest.raises(RuntimeError, match="replay covers 2 of 3 tokens"):
    b.finish(trajectory_id=0, group_id=0, member=0, seed=0, task=None, reward=0.0,
             end_reason="submit", temperature=1.0, prompt_length=3)


def test_to_batch_refuses_a_too_short_length(spec):
  t, _ = build_trajectory(spec, prompt=5, turns=[3], tool_len=0,
                          rng=np.random.default_rng(1))
  with pytest.raises(ValueError, match="shorter than the longest"):
    trajectory_lib.to_batch([t], length=4)
