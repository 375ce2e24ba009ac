"""The engine through a model's chat template and native tool calls: a tiny Qwen3 tokenizer
(tests/hf/tokenizer_fixture.py), config.tokenizer.chat_template='file' and
config.env.tool_format='json' on the SWE env, with transformers as the reference layout."""

import jax
import numpy as np
import pytest

from agentic_rl.envs import expert
from agentic_rl.envs.datasets import SweTaskSource
from agentic_rl.envs.json_tool_call import parse_json_tool_call
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.tool_call import ToolCall
from agentic_rl.model import config as model_config
from agentic_rl.model import transformer
from agentic_rl.records import batch as batch_lib
from agentic_rl.records import trajectory as trajectory_lib
from agentic_rl.rollout import config as config_lib
from agentic_rl.rollout import engine as engine_lib
from agentic_rl.rollout import sampling
from agentic_rl.rollout import teacher as teacher_lib
from agentic_rl.rollout.device_steps import DeviceSteps
from agentic_rl.rollout.tokenizer import make_tokenizer
from agentic_rl.rollout.tokenizer_config import default_tokenizer_config
from agentic_rl.envs.config import default_env_config, validate_env_config
from agentic_rl.train import sft
from tests.hf.tokenizer_fixture import write_tiny_qwen3_tokenizer
from tests.rollout.conftest import CHUNKS, SAMPLED, rollout_spec, tiny_model_config
from tests.rollout.test_engine import learner_logprobs

transformers = pytest.importorskip("transformers")
VOCAB, MAX_LEN = 512, 4096  # The tool schemas in Qwen3's system prompt take ~1K tokens.


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
  return write_tiny_qwen3_tokenizer(str(tmp_path_factory.mktemp("qwen3")), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tokenizer(qwen_dir):
  c = default_tokenizer_config()
  c.kind, c.path, c.chat_template = "hf", qwen_dir, "file"
  return make_tokenizer(c)


@pytest.fixture(scope="module")
def reference(qwen_dir):
  return transformers.AutoTokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="module")
def model():
  c = tiny_model_config()
  c.vocab_size, c.max_seq_len = VOCAB, MAX_LEN
  m = transformer.Model(model_config.validate(c))
  return m, m.init(jax.random.key(0))


@pytest.fixture(scope="module")
def steps(model):
  return DeviceSteps(model[0], sampling.SamplingParams(**SAMPLED), CHUNKS)


def json_env():
  c = default_env_config()
  c.tool_format = "json"
  return SweEnv(validate_env_config(c))


def make(model, tokenizer, steps, **overrides):
  m, params = model
  teacher_factory = overrides.pop("teacher_factory", None)
  return engine_lib.RolloutEngine(m, params, rollout_spec(m, **overrides), tokenizer, json_env,
                                  teacher_factory=teacher_factory, steps=steps)


def apply_chat_template(ref, messages, tools, **kwargs):
  out = ref.apply_chat_template(messages, tools=tools, tokenize=True, **kwargs)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_expert_episode_through_qwen3s_template_is_transformers_layout(
    model, tokenizer, reference, steps):
  task = SweTaskSource("train", tiers=("easy",))[0]
  with json_env() as env:
    played = expert.play_expert(env, task)
    tools = env.tools
  actions = [a for a, _ in played.turns]
  assert all(isinstance(parse_json_tool_call(a), ToolCall) for a in actions)
  engine = make(model, tokenizer, steps, max_turns=20, max_new_tokens_per_turn=256,
                teacher_factory=lambda _: teacher_lib.ReplayTeacher(actions))
  [t] = engine.run([task])
  engine.close()
  assert t.end_reason == config_lib.END_SUBMIT and t.reward == played.reward == 1.0
  assert t.num_turns == len(played.turns) and t.length < MAX_LEN
  messages = [{"role": "user", "content": played.first_observation}]
  # The task shows the call format; as untrusted text its tags stay text, as transformers'
  # sanitize_control_tokens keeps them.
  assert t.tokens[:t.prompt_length].tolist() == apply_chat_template(
      reference, messages, tools, add_generation_prompt=True, sanitize_control_tokens=True)
  for (start, end), (action, observation) in zip(t.turn_spans, played.turns):
    # Every prompt the model saw is the template's render of the history so far: the text
    # transformers renders, and the ids of the whole render (user and tool text sanitized).
    assert tokenizer.decode(t.tokens[:start]) == reference.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert t.tokens[:start].tolist() == tokenizer.render_conversation(
        messages, add_generation_prompt=True, tools=tools)
    assert t.tokens[start:end].tolist() == tokenizer.encode(action) + [tokenizer.end_turn_id]
    messages += [{"role": "assistant", "content": action},
                 {"role": "tool", "content": observation}]
  mask = np.zeros(t.length)
  for start, end in t.turn_spans:  # The loss is on the model's tokens and its end of turn.
    mask[start:end] = 1
  np.testing.assert_array_equal(t.loss_mask, mask)
  # SFT renders the same demonstration without a model, with the same masks.
  demo = sft.render_demonstration(tokenizer, engine.spec, played.first_observation,
                                  played.turns, tools=tools)
  np.testing.assert_array_equal(demo.tokens, t.tokens)
  np.testing.assert_array_equal(demo.loss_mask, t.loss_mask)


def test_sampled_episodes_follow_the_template_and_match_the_learner(model, tokenizer, steps):
  m, params = model
  engine = make(model, tokenizer, steps, max_turns=3, max_new_tokens_per_turn=24)
  trajectories = engine.run([SweTaskSource("train", tiers=("easy",))[i] for i in range(2)])
  engine.close()
  prompt_text = tokenizer.decode(tokenizer.generation_prompt())
  for t in trajectories:
    assert t.end_reason in (config_lib.END_TURN_BUDGET, config_lib.END_EOS), t.end_reason
    assert tokenizer.decode(t.tokens[:t.prompt_length]).endswith(prompt_text)
    for (start, end), nxt in zip(t.turn_spans, [s for s, _ in t.turn_spans[1:]]):
      between = tokenizer.decode(t.tokens[end:nxt])
      # A turn cut at max_new_tokens_per_turn gets the end of turn forced, then the
      # observation exactly as the template writes a tool message.
      stopped = t.tokens[end - 1] in tokenizer.stop_ids
      assert between.startswith("" if stopped else "<|im_end|>")
      body = between[0 if stopped else len("<|im_end|>"):]
      assert body.startswith("\n<|im_start|>user\n<tool_response>\n")
      assert body.endswith("\n</tool_response><|im_end|>\n" + prompt_text)
      assert not t.loss_mask[end:nxt].any()
  batch = trajectory_lib.to_batch(trajectories)
  batch_lib.check_batch(batch, m.spec)
  logp, _ = learner_logprobs(m, params, batch)
  mask = np.asarray(batch.loss_mask_bt) > 0
  assert np.abs(logp - np.asarray(batch.sampler_logp_bt))[mask].max() < 1e-4
