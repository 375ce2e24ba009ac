"""Text that always tokenizes: lone surrogates become U+FFFD at the engine's text boundary.

A tested function that raises ValueError('\\udc80'), or a module that prints '\\ud800' at
import, puts lone surrogates into the SWE env's `test` observation; the main job's
Hugging Face tokenizer only encodes valid Unicode, so before `valid_text` the rollout
raised and the run died. Here the quickstart's tokenizer runs such an episode through
the engine, and the batch goes through a train step.
"""

import jax
import numpy as np
import pytest

from agentic_rl.envs.datasets import SweTaskSource
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.tool_call import format_tool_call as F
from agentic_rl.model import config as model_config
from agentic_rl.model import transformer
from agentic_rl.records import batch as batch_lib
from agentic_rl.rl import train_step as train_step_lib
from agentic_rl.rollout import config as config_lib
from agentic_rl.rollout import engine as engine_lib
from agentic_rl.rollout import sampling
from agentic_rl.rollout import teacher as teacher_lib
from agentic_rl.rollout import tokenizer as tokenizer_lib
from agentic_rl.records import trajectory as trajectory_lib
from agentic_rl.rollout.device_steps import DeviceSteps
from agentic_rl.rollout.valid_text import valid_text
from agentic_rl.train import sft as sft_lib
from configs import quickstart
from tests.rl import tiny_model as rl_tiny_model
from tests.rollout.conftest import CHUNKS, MAX_LEN, rollout_spec, tiny_model_config

FFFD = "\ufffd"


@pytest.mark.parametrize("text,want", [
    ("", ""),
    ("plain ascii\n", "plain ascii\n"),
    ("héllo ÿ € 🙂 \ufffd \ud7ff \ue000", "héllo ÿ € 🙂 \ufffd \ud7ff \ue000"),  # Valid: kept.
    ("\udc80", FFFD),
    ("a\ud800b", f"a{FFFD}b"),
    ("\ud800\udfff", FFFD * 2),  # The range's ends.
    ("\ud83d\ude00", FFFD * 2),  # A pair is two code points in a str, not an emoji.
    ("ValueError: \udc80 (m.py:3)\n\ud800\n", f"ValueError: {FFFD} (m.py:3)\n{FFFD}\n"),
    (b"caf\xc3\xa9 \xff\xfe".decode("utf-8", "surrogateescape"), f"café {FFFD}{FFFD}"),
])
def test_valid_text_replaces_surrogates_only(text, want):
  got = valid_text(text)
  assert got == want
  got.encode("utf-8")  # Always encodable.
  if text == want:
    assert got is text  # Valid text is returned as is, not copied.


def test_valid_text_wants_str():
  with pytest.raises(TypeError, match="expects str"):
    valid_text(b"bytes")


def test_sft_demonstrations_render_surrogates_as_fffd():
  """The SFT renderer applies the engine's text boundary: same tokens as clean text."""
  tokenizer = tokenizer_lib.make_tokenizer(quickstart.get_config().tokenizer)
  c = tiny_model_config()
  c.vocab_size = tokenizer.vocab_size
  spec = config_lib.validate(quickstart.get_config().rollout, model_config.validate(c))
  turns = [("look \udc80 <tool_call>test</tool_call>", "ValueError: \udc80\n\ud800\n"),
           ("<tool_call>submit</tool_call>", "")]
  got = sft_lib.render_demonstration(tokenizer, spec, "task \ud800", turns, "system \udfff")
  want = sft_lib.render_demonstration(
      tokenizer, spec, f"task {FFFD}", [(valid_text(a), valid_text(o)) for a, o in turns],
      f"system {FFFD}")
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.loss_mask, want.loss_mask)
  assert f"ValueError: {FFFD}\n{FFFD}" in tokenizer.decode(got.tokens)


# -- The quickstart's tokenizer through the engine on a real SWE episode. ---------------

FULL = dict(temperature=1.0, top_k=0, top_p=1.0)  # The quickstart's sampling.


def _actions(task):
  """Replace the module with one that prints '\\ud800' at import and whose tested
  functions raise ValueError('\\udc80'), run the tests, submit. The replace body also
  holds a lone surrogate itself: actions are cleaned too."""
  n = len(task.files[task.module_path].rstrip("\n").split("\n"))
  body = "\n".join(["print('\\ud800')", "# \udc80"] + [
      f"def {name}(*args):\n    raise ValueError('\\udc80')" for name in task.functions])
  return [F("replace", path=task.module_path, start=1, end=n, text=body), F("test"),
          F("submit")]


@pytest.mark.slow  # ~30 s: a real SweEnv episode, the quickstart's HF tokenizer, a train step.
def test_surrogates_in_an_observation_reach_the_quickstart_tokenizer_as_fffd():
  tokenizer = tokenizer_lib.make_tokenizer(quickstart.get_config().tokenizer)
  assert isinstance(tokenizer, tokenizer_lib.HFTokenizer)
  task = SweTaskSource("train", tiers=("tiny",))[0]
  actions = _actions(task)
  # What the env answers to the cleaned actions, played directly (no engine, no tokenizer).
  with SweEnv() as env:
    first = env.reset(task)
    raw = [env.step(valid_text(a)).observation for a in actions]
  assert "\udc80" in raw[1] and "\ud800" in raw[1], raw[1]  # The problem is real.
  with pytest.raises(ValueError, match="lone surrogate"):
    tokenizer.render_turn("tool", raw[1])

  c = tiny_model_config()
  c.vocab_size = tokenizer.vocab_size
  model = transformer.Model(model_config.validate(c))
  params = model.init(jax.random.key(0))
  spec = rollout_spec(model, group_size=2, max_turns=4, max_new_tokens_per_turn=256, **FULL)
  engine = engine_lib.RolloutEngine(
      model, params, spec, tokenizer, SweEnv,
      teacher_factory=lambda _: teacher_lib.ReplayTeacher(actions),
      steps=DeviceSteps(model, sampling.SamplingParams(**FULL), CHUNKS))
  try:
    trajectories = engine.run([task])
  finally:
    engine.close()

  for t in trajectories:
    assert t.end_reason == config_lib.END_SUBMIT and t.error == "" and t.num_turns == 3
    assert t.tokens[:t.prompt_length].tolist() == tokenizer.render_conversation(
        [("user", first)], add_generation_prompt=True)
    for i, (start, end) in enumerate(t.turn_spans):
      assert tokenizer.decode(t.tokens[start:end]) == valid_text(actions[i]) + "<|end_turn|>"
      if i + 1 < t.num_turns:  # The tool turn is the env's answer with U+FFFD for surrogates.
        between = t.tokens[end:t.turn_spans[i + 1][0]].tolist()
        assert between == (tokenizer.render_turn("tool", valid_text(raw[i]))
                           + tokenizer.generation_prompt())
    shown = tokenizer.decode(t.tokens)
    assert f"ValueError: {FFFD}" in shown and f"\n{FFFD}\n" in shown and f"# {FFFD}" in shown
    assert valid_text(shown) == shown

  # Training goes on: the batch passes the learner's checks and one train step.
  batch = trajectory_lib.to_batch(trajectories, length=sft_lib.padded_length(
      max(t.length for t in trajectories), MAX_LEN, multiple=128))
  batch_lib.check_batch(batch, model.spec)
  rl_spec = rl_tiny_model.rl_spec()
  state = train_step_lib.init_train_state(model, params, rl_spec)
  state, metrics = train_step_lib.make_train_step(model, rl_spec)(state, batch)
  metrics = jax.device_get(metrics)
  assert int(metrics["skipped_steps"]) == 0 and np.isfinite(float(metrics["grad_norm"]))
  assert int(state.step) == 1
