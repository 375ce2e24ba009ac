"""Every budget ends a trajectory (or a turn) with its own recorded reason."""

import numpy as np
import pytest

from agentic_rl.rollout import config as config_lib
from tests.rollout.conftest import make_engine
from agentic_rl.envs.countdown import CountdownEnv, CountdownTeacher


def run_one(tiny_model, tokenizer, steps, task, **overrides):
  engine = make_engine(tiny_model, tokenizer, steps, CountdownEnv, **overrides)
  [t] = engine.run([task])
  engine.close()
  return t


def test_turn_budget(tiny_model, tokenizer, sampled_steps):
  t = run_one(tiny_model, tokenizer, sampled_steps, {"start": 9, "pad": 0},
              teacher_factory=CountdownTeacher, max_turns=2)
  assert t.end_reason == config_lib.END_TURN_BUDGET
  assert t.num_turns == 2 and t.turn_end_reasons == ["stop", "stop"]
  assert t.process_signals == [1.0, 1.0] and t.reward == 0.0
  # The record ends with the model's last token: no tool turn after the final action.
  assert t.tokens[-1] == tokenizer.end_turn_id and t.loss_mask[-1] == 1.0


def test_submit(tiny_model, tokenizer, sampled_steps):
  t = run_one(tiny_model, tokenizer, sampled_steps, {"start": 1, "pad": 0},
              teacher_factory=CountdownTeacher)
  assert t.end_reason == config_lib.END_SUBMIT and t.reward == 1.0 and t.num_turns == 2


def test_eos_ends_the_trajectory_after_its_action_is_stepped(tiny_model, tokenizer,
                                                             sampled_steps):
  t = run_one(tiny_model, tokenizer, sampled_steps, {"start": 5, "pad": 0},
              teacher_factory=lambda task: CountdownTeacher(task, eos_after=2), max_turns=5)
  assert t.end_reason == config_lib.END_EOS and t.num_turns == 2
  assert t.tokens[-1] == tokenizer.eos_id and t.process_signals == [1.0, 1.0]


def test_max_new_tokens_per_turn_truncates_the_turn_and_closes_it(tiny_model, tokenizer,
                                                                 sampled_steps):
  # The random model rarely emits a stop id within 12 tokens.
  t = run_one(tiny_model, tokenizer, sampled_steps, {"start": 3, "pad": 0},
              max_new_tokens_per_turn=12, max_turns=3)
  truncated = [i for i, r in enumerate(t.turn_end_reasons)
               if r == config_lib.TURN_MAX_NEW_TOKENS]
  assert truncated, t.turn_end_reasons
  for i, (start, end) in enumerate(t.turn_spans):
    assert end - start <= 12
    if i in truncated and i + 1 < t.num_turns:
      # The engine closes a truncated turn itself; that end_turn is not the model's.
      assert t.tokens[end] == tokenizer.end_turn_id and t.loss_mask[end] == 0.0


def test_token_budget_cuts_mid_turn_at_exactly_the_budget(tiny_model, tokenizer,
                                                          sampled_steps):
  t = run_one(tiny_model, tokenizer, sampled_steps, {"start": 3, "pad": 0},
              max_new_tokens_per_turn=200, max_total_tokens=150)
  assert t.end_reason == config_lib.END_TOKEN_BUDGET
  assert t.length == 150 and t.turn_end_reasons[-1] == config_lib.TURN_BUDGET_CUT


def test_token_budget_refuses_an_observation_that_does_not_fit(tiny_model, tokenizer,
                                                               sampled_steps):
  t = run_one(tiny_model, tokenizer, sampled_steps, {"start": 3, "pad": 6},
              teacher_factory=CountdownTeacher, max_total_tokens=160)
  assert t.end_reason == config_lib.END_TOKEN_BUDGET and t.length <= 160
  # It ended at a turn boundary: the last action was stepped, its answer did not fit.
  assert t.turn_end_reasons[-1] == "stop" and t.tool_infos[-1] is not None
  assert t.tokens[-1] == tokenizer.end_turn_id


def test_context_limit_when_the_cache_is_full(tiny_model, tokenizer, sampled_steps):
  t = run_one(tiny_model, tokenizer, sampled_steps, {"start": 30, "pad": 45},
              teacher_factory=CountdownTeacher, max_turns=30)
  assert t.end_reason == config_lib.END_CONTEXT_LIMIT
  assert 2048 - 800 < t.length <= 2048 and t.num_turns > 1


def test_a_prompt_that_leaves_no_room_is_an_error(tiny_model, tokenizer, sampled_steps):
  engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv, max_total_tokens=20)
  with pytest.raises(ValueError, match="prompt has .* tokens"):
    engine.run([{"start": 1, "pad": 0}])
  engine.close()


def test_every_budget_is_respected_over_many_random_trajectories(tiny_model, tokenizer,
                                                                  sampled_steps):
  engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv,
                       max_new_tokens_per_turn=20, max_turns=4, max_total_tokens=200)
  tasks = [{"start": s, "pad": p} for s, p in [(2, 0), (3, 4), (1, 9), (4, 2), (5, 1)]]
  trajectories = engine.run(tasks)
  engine.close()
  allowed = {config_lib.END_SUBMIT, config_lib.END_TURN_BUDGET, config_lib.END_TOKEN_BUDGET,
             config_lib.END_EOS}
  for t in trajectories:
    assert t.end_reason in allowed
    assert t.length <= 200 and t.num_turns <= 4
    assert all(e - s <= 20 for s, e in t.turn_spans)
    if t.end_reason == config_lib.END_TURN_BUDGET:
      assert t.num_turns == 4
    np.testing.assert_array_equal(t.loss_mask[:t.prompt_length], 0.0)
