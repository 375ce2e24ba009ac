"""The engine on the real SWE environment (sandboxed tool runs)."""

import numpy as np

from agentic_rl.envs import expert
from agentic_rl.envs.datasets import SweTaskSource
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.records import batch as batch_lib
from agentic_rl.rollout import config as config_lib
from agentic_rl.rollout import teacher as teacher_lib
from agentic_rl.records import trajectory as trajectory_lib
from tests.rollout.conftest import make_engine
from tests.rollout.test_engine import learner_logprobs


def easy_tasks(n):
  source = SweTaskSource("train", tiers=("easy",))
  return [source[i] for i in range(n)]


def test_expert_replay_reproduces_the_experts_episode(tiny_model, tokenizer, sampled_steps):
  tasks = easy_tasks(2)
  played = []
  for task in tasks:
    env = SweEnv()
    played.append(expert.play_expert(env, task))
    env.close()
  by_seed = {task.seed: [a for a, _ in p.turns] for task, p in zip(tasks, played)}
  engine = make_engine(tiny_model, tokenizer, sampled_steps, SweEnv, max_turns=20,
                       max_new_tokens_per_turn=256,
                       teacher_factory=lambda task: teacher_lib.ReplayTeacher(by_seed[task.seed]))
  trajectories = engine.run(tasks)
  engine.close()
  for t, p in zip(trajectories, played):
    assert t.end_reason == config_lib.END_SUBMIT and t.reward == p.reward
    assert t.num_turns == len(p.turns)
    assert t.tokens[:t.prompt_length].tolist() == tokenizer.render_conversation(
        [("user", p.first_observation)], add_generation_prompt=True)
    for i, ((start, end), (action, observation)) in enumerate(zip(t.turn_spans, p.turns)):
      assert tokenizer.decode(t.tokens[start:end]) == action + "<|end_turn|>"
      if i + 1 < t.num_turns:  # The tool turn the engine prefilled is the env's answer.
        between = t.tokens[end:t.turn_spans[i + 1][0]].tolist()
        assert between == (tokenizer.render_turn("tool", observation)
                           + tokenizer.generation_prompt())
    np.testing.assert_allclose(t.process_signals, [info["process_signal"] for info in p.infos])
    assert 1000 < t.length <= 2048


def test_sampled_swe_trajectories_match_the_learner(tiny_model, tokenizer, sampled_steps):
  model, params = tiny_model
  engine = make_engine(tiny_model, tokenizer, sampled_steps, SweEnv, max_turns=3,
                       max_new_tokens_per_turn=24)
  trajectories = engine.run(easy_tasks(3))
  engine.close()
  for t in trajectories:
    # The random model may also end the conversation itself with <|eos|>.
    assert t.end_reason in (config_lib.END_TURN_BUDGET, config_lib.END_EOS)
    assert t.num_turns == 3 or (t.end_reason == config_lib.END_EOS and t.num_turns < 3)
    assert all(info["decision"] in ("allowed", "denied", "timeout", "error")
               for info in t.tool_infos)
  # A random model's text is rarely a valid call: the env answers with an error.
  assert any(info["decision"] == "error" for t in trajectories for info in t.tool_infos)
  batch = trajectory_lib.to_batch(trajectories)
  batch_lib.check_batch(batch, model.spec)
  logp, _ = learner_logprobs(model, params, batch)
  mask = np.asarray(batch.loss_mask_bt) > 0
  diff = np.abs(logp - np.asarray(batch.sampler_logp_bt))[mask]
  assert diff.max() < 1e-4, diff.max()
