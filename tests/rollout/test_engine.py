"""The engine end to end on the countdown environment: consistency, greedy decoding,
slot independence, loss mask, group sharing, concurrency and compilation counts."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.records import batch as batch_lib
from agentic_rl.rl import logprobs
from agentic_rl.rollout import config as config_lib
from agentic_rl.records import trajectory as trajectory_lib
from agentic_rl.rollout import engine_stats
from agentic_rl.rollout import sampling
from agentic_rl.rollout.device_steps import DeviceSteps
from tests.rollout.conftest import CHUNKS, SAMPLED, make_engine
from agentic_rl.envs.countdown import CountdownEnv, CountdownTeacher


class RecordingFactory:
  """An env factory that keeps every env it made."""

  def __init__(self, **kwargs):
    self.envs = []
    self.kwargs = kwargs
    self._lock = threading.Lock()

  def __call__(self):
    env = CountdownEnv(**self.kwargs)
    with self._lock:
      self.envs.append(env)
    return env


TASKS = [{"start": 3, "pad": 9}, {"start": 2, "pad": 0}, {"start": 4, "pad": 3},
         {"start": 1, "pad": 12}]


def learner_logprobs(model, params, batch):
  logits, _, _ = jax.jit(model.forward)(params, batch.tokens_bt, batch.positions_bt, None,
                                        batch.replay)
  logp, _ = logprobs.token_logprobs(logits, batch.tokens_bt, batch.temperature_b,
                                    batch.sampling_mask_btw)
  return np.asarray(logp), np.asarray(logits)


def test_sampler_logprobs_equal_the_learners_full_forward_with_replay(
    tiny_model, tokenizer, sampled_steps):
  model, params = tiny_model
  engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv, group_size=2)
  trajectories = engine.run(TASKS)
  engine.close()
  assert len(trajectories) == 2 * len(TASKS)
  # Observations longer than a chunk were prefilled in several chunks.
  assert max(t.length - t.prompt_length for t in trajectories) > 2 * 32
  batch = trajectory_lib.to_batch(trajectories)
  batch_lib.check_batch(batch, model.spec)
  logp, _ = learner_logprobs(model, params, batch)
  mask = np.asarray(batch.loss_mask_bt) > 0
  assert mask.sum() > 100
  diff = np.abs(logp - np.asarray(batch.sampler_logp_bt))[mask]
  assert diff.max() < 1e-4, diff.max()
  # The replay holds real routing on every token, and top-k/top-p masks on every draw.
  keep = np.asarray(jax.vmap(lambda w: jnp.sum(jnp.unpackbits(w, axis=-1), -1))(
      batch.sampling_mask_btw))
  assert (keep[mask] <= 40).all() and (keep[mask] >= 1).all() and (keep[~mask] == 0).all()
  for layer, kind in zip(batch.replay, model.spec.layer_types):
    assert ("blocks" in layer) == (kind == "G")
  assert "experts" in batch.replay[1] and "experts" in batch.replay[2]


def test_greedy_tokens_are_the_argmax_of_a_full_forward(tiny_model, tokenizer, greedy_steps):
  model, params = tiny_model
  engine = make_engine(tiny_model, tokenizer, greedy_steps, CountdownEnv,
                       temperature=0.0, top_k=0, top_p=1.0)
  trajectories = engine.run(TASKS[:3])
  engine.close()
  batch = trajectory_lib.to_batch(trajectories)
  # The reference forward is plain: no replay, no cache.
  logits, _, _ = jax.jit(model.forward)(params, batch.tokens_bt, batch.positions_bt)
  argmax = np.asarray(jnp.argmax(logits, -1))
  tokens, mask = np.asarray(batch.tokens_bt), np.asarray(batch.loss_mask_bt) > 0
  b_idx, t_idx = np.nonzero(mask)
  assert len(t_idx) > 30
  np.testing.assert_array_equal(tokens[b_idx, t_idx], argmax[b_idx, t_idx - 1])
  np.testing.assert_array_equal(np.asarray(batch.sampler_logp_bt)[mask], 0.0)
  assert all(t.temperature == 1.0 for t in trajectories)


def test_same_seeds_give_the_same_tokens_whatever_slot_and_batch(
    tiny_model, tokenizer, sampled_steps):
  seeds = [101, 202, 303, 404]
  first = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv)
  alone = {t.seed: t for t in first.run(TASKS, task_seeds=seeds)}
  first.close()
  # Reversed, interleaved with other tasks: other slots, other batch neighbours.
  fillers = [{"start": 6, "pad": 2}, {"start": 5, "pad": 7}]
  tasks = [fillers[0], TASKS[3], TASKS[2], fillers[1], TASKS[1], TASKS[0]]
  task_seeds = [7, 404, 303, 8, 202, 101]
  second = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv)
  mixed = {t.seed: t for t in second.run(tasks, task_seeds=task_seeds)}
  second.close()
  assert set(alone) <= set(mixed)
  for seed, t in alone.items():
    np.testing.assert_array_equal(t.tokens, mixed[seed].tokens)
    np.testing.assert_allclose(t.sampler_logp, mixed[seed].sampler_logp, atol=1e-5)
  # The comparison is not vacuous: different seeds draw different tokens.
  assert len({t.tokens.tobytes() for t in alone.values()}) == len(alone)


def test_same_seeds_give_the_same_tokens_with_another_slot_count_and_prefill_rows(
    tiny_model, tokenizer, sampled_steps):
  # Two slots and two rows per prefill call: other decode and prefill batch shapes
  # (two more compilations, ~10 s on a 2-core CPU).
  seeds = [101, 202, 303]
  three = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv)
  reference = {t.seed: t for t in three.run(TASKS[:3], task_seeds=seeds)}
  three.close()
  two = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv, num_slots=2,
                    prefill_rows=2, prompt_store_rows=2)
  other = {t.seed: t for t in two.run(TASKS[:3][::-1], task_seeds=seeds[::-1])}
  two.close()
  assert two.stats.prefill_rows_used > two.stats.prefill_calls  # Some calls had two rows.
  for seed, t in reference.items():
    np.testing.assert_array_equal(t.tokens, other[seed].tokens)
    np.testing.assert_allclose(t.sampler_logp, other[seed].sampler_logp, atol=1e-5)


@pytest.mark.slow  # ~2 min: the one-chunk engine compiles its own prefill shapes.
def test_smaller_prefill_shapes_change_nothing_but_the_work(tiny_model, tokenizer,
                                                            sampled_steps):
  # One prefill shape, 2 rows x 32 (prefill_chunk_min 0), against the tests' set, rows of
  # 1 and 2 by chunks of 16 and 32: the same tokens, less computed.
  seeds = [101, 202, 303]
  one_steps = DeviceSteps(tiny_model[0], sampling.SamplingParams(**SAMPLED), 32)
  one = make_engine(tiny_model, tokenizer, one_steps, CountdownEnv, prefill_chunk_min=0,
                    prefill_rows=2, prompt_store_rows=2)
  reference = {t.seed: t for t in one.run(TASKS[:3], task_seeds=seeds)}
  one.close()
  many = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv, prefill_rows=2,
                     prompt_store_rows=2)
  other = {t.seed: t for t in many.run(TASKS[:3], task_seeds=seeds)}
  many.close()
  assert many.stats.prefilled_tokens == one.stats.prefilled_tokens
  assert one.stats.prefill_shape_tokens == 2 * 32 * one.stats.prefill_calls
  assert many.stats.prefill_shape_tokens < one.stats.prefill_shape_tokens
  assert many.stats.as_dict()["prefill_fill"] > one.stats.as_dict()["prefill_fill"]
  for seed, t in reference.items():
    np.testing.assert_array_equal(t.tokens, other[seed].tokens)
    np.testing.assert_allclose(t.sampler_logp, other[seed].sampler_logp, atol=1e-5)


def test_prompt_and_tool_tokens_are_masked(tiny_model, tokenizer, sampled_steps):
  factory = RecordingFactory()
  engine = make_engine(tiny_model, tokenizer, sampled_steps, factory)
  trajectories = engine.run(TASKS)
  engine.close()
  by_start = {env.task["start"]: env for env in factory.envs}
  for t in trajectories:
    env = by_start[t.task["start"]]
    # Rebuild the sequence from the env's own record: prompt, then per turn the model's
    # tokens, the engine's end_turn after a truncated turn, the tool turn and the header.
    expected = tokenizer.render_conversation(
        [("system", env.system_prompt), ("user", env.observations[0])],
        add_generation_prompt=True)
    expected_mask = [0.0] * len(expected)
    assert t.prompt_length == len(expected)
    for i, (start, end) in enumerate(t.turn_spans):
      expected += t.tokens[start:end].tolist()
      expected_mask += [1.0] * (end - start)
      if i + 1 < len(t.turn_spans):
        extra = [tokenizer.end_turn_id] if t.turn_end_reasons[i] == "max_new_tokens" else []
        extra += tokenizer.render_turn("tool", env.observations[i + 1])
        extra += tokenizer.generation_prompt()
        expected += extra
        expected_mask += [0.0] * len(extra)
    np.testing.assert_array_equal(t.tokens, expected)
    np.testing.assert_array_equal(t.loss_mask, expected_mask)
    # What the env was told is exactly what the model wrote in each turn.
    for action, (start, end), reason in zip(env.actions, t.turn_spans, t.turn_end_reasons):
      ids = t.tokens[start:end].tolist()
      if reason == "stop":
        ids = ids[:-1]
      assert action == tokenizer.decode(ids)


def test_group_members_share_one_prompt_prefill(tiny_model, tokenizer, sampled_steps):
  engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv, group_size=3,
                       num_slots=3)
  trajectories = engine.run(TASKS[:2])
  engine.close()
  stats = engine.stats
  assert stats.prompts_prefilled == 2 and stats.forks == 6
  # The forks have their own time bucket, and the buckets split the wall time.
  assert stats.fork_s > 0 and stats.prefill_s > 0
  buckets = sum(getattr(stats, k) for k in engine_stats.TIME_BUCKETS)
  assert buckets == pytest.approx(stats.wall_s, rel=0.05)
  for group_id in (0, 1):
    members = [t for t in trajectories if t.group_id == group_id]
    assert sorted(t.member for t in members) == [0, 1, 2]
    p = members[0].prompt_length
    for m in members[1:]:
      np.testing.assert_array_equal(m.tokens[:p], members[0].tokens[:p])
      for la, lb in zip(m.replay, members[0].replay):
        for key in la:
          axis = 0 if key == "experts" else 1
          np.testing.assert_array_equal(np.take(la[key], range(p), axis),
                                        np.take(lb[key], range(p), axis))
    assert len({m.tokens.tobytes() for m in members}) == 3


def test_other_slots_keep_decoding_while_a_tool_runs(tiny_model, tokenizer, sampled_steps):
  # Task 0's first step blocks until task 1's env has been stepped twice: possible only
  # if slot 1 keeps decoding (and stepping) while slot 0 waits on its tool.
  second_step_of_other = threading.Event()
  steps_seen = {}

  def hook(env):
    start = env.task["start"]
    steps_seen[start] = steps_seen.get(start, 0) + 1
    if start == 7 and steps_seen[start] == 1:
      assert second_step_of_other.wait(timeout=60), "the other slot stopped decoding"
    if start == 8 and steps_seen[start] == 2:
      second_step_of_other.set()

  factory = RecordingFactory(step_hook=hook)
  engine = make_engine(tiny_model, tokenizer, sampled_steps, factory, num_slots=3)
  trajectories = engine.run([{"start": 7, "pad": 0}, {"start": 8, "pad": 0}])
  engine.close()
  assert second_step_of_other.is_set()
  assert {t.num_turns for t in trajectories} == {3}


def test_a_finished_slot_takes_the_next_task_at_once(tiny_model, tokenizer, sampled_steps):
  # One six-turn task and five one-turn tasks on three slots: if slots were refilled
  # only when the whole batch finished, the long task would finish before the fourth.
  engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv,
                       teacher_factory=CountdownTeacher, max_turns=8)
  tasks = [{"start": 5, "pad": 0}] + [{"start": 0, "pad": 0}] * 5
  order = [t.trajectory_id for t in engine.generate(tasks)]
  engine.close()
  assert order[-1] == 0 and sorted(order[:-1]) == [1, 2, 3, 4, 5]
  assert engine.stats.forks == 6 and engine.stats.trajectories == 6


def test_compiles_are_bounded_by_the_length_buckets(tiny_model, tokenizer):
  """Calls run on the cache cut to a power-of-two length bucket: a new bucket compiles once,
  and nothing else does, within or across runs and engines of the same shapes."""
  sampled_steps = DeviceSteps(tiny_model[0], sampling.SamplingParams(**SAMPLED), CHUNKS)
  engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv)
  engine.run(TASKS[:2])
  warm = dict(sampled_steps.trace_counts)
  engine.run(TASKS[:2])  # The same lengths: nothing new.
  assert dict(sampled_steps.trace_counts) == warm
  engine.run(TASKS[2:] + [{"start": 9, "pad": 20}])
  engine.close()
  other = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv, group_size=2)
  other.run(TASKS[:1])
  other.close()
  counts = dict(sampled_steps.trace_counts)
  # block_size 4 up to 2048: 10 buckets, and the whole capacity (None).
  buckets = 11
  assert 1 <= counts["decode_loop"] <= buckets
  # Prefill: slot rows and prompt-store rows, a bucket each.
  assert 1 <= counts["prefill_rows"] <= 2 * buckets
  assert counts["fork"] == warm["fork"] and counts["reset_rows"] == warm["reset_rows"]


def test_warm_up_compiles_every_bucket_and_changes_no_trajectory(tiny_model, tokenizer):
  """After warm_up a run compiles no prefill or decode step (only the one-off fork and row
  reset), and samples exactly what an engine that was not warmed samples."""
  warm_steps = DeviceSteps(tiny_model[0], sampling.SamplingParams(**SAMPLED), CHUNKS)
  engine = make_engine(tiny_model, tokenizer, warm_steps, CountdownEnv, max_len=256)
  assert engine.warm_up() > 0
  # block_size 4 up to 256: 6 buckets and the whole capacity.
  assert warm_steps.trace_counts["decode_loop"] == 7
  before = dict(warm_steps.trace_counts)
  got = engine.run(TASKS)
  engine.close()
  steps_kinds = ("decode_loop", "prefill_rows")
  assert {k: warm_steps.trace_counts[k] for k in steps_kinds} == {k: before[k]
                                                                  for k in steps_kinds}
  cold = make_engine(tiny_model, tokenizer,
                     DeviceSteps(tiny_model[0], sampling.SamplingParams(**SAMPLED), CHUNKS),
                     CountdownEnv, max_len=256)
  want = cold.run(TASKS)
  cold.close()
  order = lambda trajs: sorted(trajs, key=lambda t: (t.group_id, t.member))
  for a, b in zip(order(got), order(want)):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.sampler_logp, b.sampler_logp)


def test_policy_version_is_recorded_per_token(tiny_model, tokenizer, sampled_steps):
  model, params = tiny_model
  engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv)
  engine.set_params(params, 7)
  [t] = engine.run(TASKS[1:2])
  engine.close()
  assert (t.policy_version[t.loss_mask > 0] == 7).all()
  assert (t.policy_version[t.loss_mask == 0] == -1).all()


def test_teacher_forcing_submits_with_full_reward_and_process_signals(
    tiny_model, tokenizer, sampled_steps):
  engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv,
                       teacher_factory=CountdownTeacher, max_turns=8)
  [t] = engine.run([{"start": 2, "pad": 1}])
  engine.close()
  assert t.end_reason == config_lib.END_SUBMIT
  assert t.reward == 1.0 and t.process_signals == [1.0, 1.0, 1.0]
  assert t.turn_end_reasons == ["stop"] * 3
  text = tokenizer.decode(t.tokens[t.turn_spans[0][0]:t.turn_spans[0][1]])
  assert text == "ok <tool_call>say 2</tool_call><|end_turn|>"
  np.testing.assert_array_equal(t.process_reward()[[e - 1 for _, e in t.turn_spans]], 1.0)


def test_stopping_early_closes_every_environment(tiny_model, tokenizer, sampled_steps):
  factory = RecordingFactory()
  engine = make_engine(tiny_model, tokenizer, sampled_steps, factory)
  stream = engine.generate(TASKS * 2)
  first = next(stream)
  with pytest.raises(RuntimeError, match="already generating"):
    next(engine.generate(TASKS))
  stream.close()
  engine.close()  # Waits for the pool, where the closes run.
  assert first.end_reason and len(factory.envs) > 1
  assert all(env.closed for env in factory.envs)


@pytest.mark.parametrize("steps_per_call", [3, 16])
def test_several_decode_steps_per_call_give_the_one_step_trajectories(
    tiny_model, tokenizer, sampled_steps, steps_per_call):
  """The on-device decode loop feeds each slot its own draws and stops it where the host
  would (stop id, turn budget, token limit): the same records, in fewer device calls."""
  runs = {}
  for n in (1, steps_per_call):
    engine = make_engine(tiny_model, tokenizer, sampled_steps, CountdownEnv, group_size=2,
                         decode_steps_per_call=n, max_total_tokens=160)
    trajectories = engine.run(TASKS)
    engine.close()
    runs[n] = (trajectories, engine.stats)
  (want, one), (got, many) = runs[1], runs[steps_per_call]
  reasons = {r for t in want for r in t.turn_end_reasons}
  assert reasons >= {"max_new_tokens"}, reasons  # Budgets stop rows on the device too.
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.turn_end_reasons == b.turn_end_reasons
    assert a.end_reason == b.end_reason and a.reward == b.reward
    np.testing.assert_allclose(a.sampler_logp, b.sampler_logp, atol=1e-6)
    np.testing.assert_array_equal(a.sampling_mask, b.sampling_mask)
    for la, lb in zip(a.replay, b.replay):
      for key in lb:
        np.testing.assert_array_equal(la[key], lb[key])
  assert many.decode_rows == one.decode_rows and many.generated_tokens == one.generated_tokens
  # How many calls depends on when env steps return (a waiting prefill cuts a call to one
  # step); tests/rollout/test_decode_loop.py counts steps exactly.
  assert many.decode_calls < one.decode_calls, (many.decode_calls, one.decode_calls)
