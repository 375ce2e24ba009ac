"""The device steps and the engine reject bad ids and positions before dispatch.

Inside the jitted sampler `model.forward` cannot raise: an id outside the vocabulary
gave NaN logits (and the engine sampled from them), and a position off the cache's
length was written where it fell. The checks run on the host arrays the engine builds
anyway, against its host record of each row's cache length, so they read nothing back
from the device.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from agentic_rl.rollout import engine as engine_lib
from agentic_rl.rollout.tokenizer import ByteTokenizer
from tests.rollout.conftest import make_engine, rollout_spec
from agentic_rl.envs.countdown import CountdownEnv

TASKS = [{"start": 2, "pad": 0}]


def decode_inputs(n=2):
  return (np.zeros(n, np.int32), np.full(n, -1, np.int32), np.zeros(n, np.uint32),
          np.full(n, -1, np.int32))


def test_decode_rejects_bad_host_inputs_with_the_entry_and_its_bound(tiny_model, greedy_steps):
  model, params = tiny_model
  cache = model.init_cache(2, 64)
  tokens, positions, seeds, forced = decode_inputs()
  positions[1] = 0
  tokens[1] = model.spec.vocab_size
  with pytest.raises(ValueError, match=r"token id 320 at row 1, index 0 .*\[0, 320\)"):
    greedy_steps.decode(params, cache, tokens, positions, seeds, forced)
  tokens[1], positions[1] = 5, 64
  with pytest.raises(ValueError, match="position 64 at row 1, index 0 is at or past the "
                                       "cache capacity 64"):
    greedy_steps.decode(params, cache, tokens, positions, seeds, forced)
  positions[1] = 3
  with pytest.raises(ValueError, match="row 1 feeds position 3 but its cache holds 0 tokens"):
    greedy_steps.decode(params, cache, tokens, positions, seeds, forced,
                        np.zeros(2, np.int64))
  positions[1], forced[1] = 0, 400
  with pytest.raises(ValueError, match=r"forced token id 400 at row 1 .*\[0, 320\)"):
    greedy_steps.decode(params, cache, tokens, positions, seeds, forced)


def test_prefill_checks_positions_against_the_given_row_lengths(tiny_model, greedy_steps):
  model, params = tiny_model
  cache = model.init_cache(2, 64)
  chunk = greedy_steps.chunk
  tokens = np.zeros((1, chunk), np.int32)
  positions = np.full((1, chunk), -1, np.int32)
  positions[0, :4] = [2, 3, 4, 5]  # a row holding 0 tokens must start at 0
  with pytest.raises(ValueError, match="row 0 feeds positions 2, 3, 4, 5 but its cache holds "
                                       "0 tokens"):
    greedy_steps.prefill(params, cache, np.array([1], np.int32), tokens, positions,
                         np.zeros(1, np.uint32), np.full(1, -1, np.int32),
                         np.zeros(1, np.int64))


def test_the_checks_read_nothing_back_from_the_device(tiny_model, greedy_steps):
  model, params = tiny_model
  cache = model.init_cache(2, 64)
  tokens, positions, seeds, forced = decode_inputs()
  positions[0] = 0
  with jax.transfer_guard_device_to_host("disallow"):
    cache, _ = greedy_steps.decode(params, cache, tokens, positions, seeds, forced,
                                   np.zeros(2, np.int64))
  np.testing.assert_array_equal(cache["lengths"], [1, 0])


class OutOfVocabTokenizer(ByteTokenizer):
  """Claims 266 ids but its prompts carry id 320 (a model of vocab 320 has no such id)."""

  def render_conversation(self, turns, *, add_generation_prompt=False):
    ids = super().render_conversation(turns, add_generation_prompt=add_generation_prompt)
    return ids[:3] + [320] + ids[3:]


def test_the_engine_rejects_an_id_outside_the_model_vocabulary(tiny_model, sampled_steps):
  engine = make_engine(tiny_model, OutOfVocabTokenizer(), sampled_steps, CountdownEnv)
  try:
    with pytest.raises(ValueError, match=r"token id 320 at row 0, index 3 .*\[0, 320\)"):
      engine.run(TASKS)
  finally:
    engine.close()


class SkippingEngine(engine_lib.RolloutEngine):
  """A bookkeeping bug: after its first tool call a trajectory counts one token more
  than its cache holds, so its observation would be prefilled one position ahead."""

  skipped = False

  def _on_env_result(self, active, result):
    if not self.skipped:
      self.skipped = True
      active.cache_len += 1
    super()._on_env_result(active, result)


def test_the_engine_rejects_a_position_off_its_host_record_of_the_cache(
    tiny_model, tokenizer, sampled_steps):
  model, params = tiny_model
  engine = SkippingEngine(model, params, rollout_spec(model), tokenizer, CountdownEnv,
                          steps=sampled_steps)
  try:
    with pytest.raises(ValueError, match=r"row \d+ feeds positions \d+.* but its cache holds "
                                         r"\d+ tokens.*no gap, no rewind"):
      engine.run(TASKS)
  finally:
    engine.close()


def test_the_host_record_matches_the_device_lengths_after_a_run(tiny_model, tokenizer,
                                                                sampled_steps):
  engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv, group_size=2)
  try:
    engine.run(TASKS + [{"start": 1, "pad": 3}])
  finally:
    engine.close()
  np.testing.assert_array_equal(engine._cache_lengths, np.asarray(engine.cache["lengths"]))
  np.testing.assert_array_equal(engine._store_lengths, np.asarray(engine.store["lengths"]))
