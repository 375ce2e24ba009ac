"""The fast demonstration renderer against the engine's teacher-forced recording."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from agentic_rl.envs import config as env_config_lib
from agentic_rl.envs.expert import play_expert, play_recovery
from agentic_rl.envs import datasets
from agentic_rl.envs import swe_env
from agentic_rl.envs.tool_call import format_tool_call, parse_tool_call
from agentic_rl.model import config as model_config_lib
from agentic_rl.model import transformer
from agentic_rl.rollout import config as rollout_config_lib
from agentic_rl.rollout import tokenizer as tokenizer_lib
from agentic_rl.train import sft
from configs import quickstart

_BPE = os.path.join(os.path.dirname(quickstart.__file__), "tokenizers", "swe_bpe_1k.json")


def _setup(tier, tokenizer_kind, **rollout):
  cfg = quickstart.get_config()
  if tokenizer_kind == "bpe":
    cfg.tokenizer.kind, cfg.tokenizer.path, cfg.model.vocab_size = "hf", _BPE, 1024
  else:
    cfg.tokenizer.kind, cfg.tokenizer.path, cfg.model.vocab_size = "byte", "", 320
  cfg.model.d_model, cfg.model.num_layers, cfg.model.layer_pattern = 32, 2, "SG"
  cfg.model.num_dense_layers = 2
  for k, v in rollout.items():
    cfg.rollout[k] = v
  cfg.env.default_tier = tier
  return _build(cfg, num_tasks=4)


def _build(cfg, num_tasks):
  """The model, rollout spec, tokenizer, env factory and first train tasks of `cfg`."""
  spec = model_config_lib.validate(cfg.model)
  rollout_spec = rollout_config_lib.validate(cfg.rollout, spec)
  env_config = env_config_lib.validate_env_config(cfg.env)
  source = datasets.SweTaskSource("train", config=env_config)
  tasks = [source[i] for i in range(num_tasks)]
  factory = lambda: swe_env.SweEnv(env_config)
  return (transformer.Model(spec), rollout_spec, tokenizer_lib.make_tokenizer(cfg.tokenizer),
          factory, tasks)


@pytest.mark.parametrize("tier,tokenizer_kind,rollout", [
    ("tiny", "bpe", {}),
    ("easy", "bpe", {}),
    ("tiny", "byte", {"max_new_tokens_per_turn": 64, "max_len": 1024}),
    ("tiny", "bpe", {"max_turns": 3}),  # The engine's turn budget ends the episode early.
    ("tiny", "bpe", {"max_len": 200, "prefill_chunk": 64}),  # The token budget cuts it.
    ("tiny", "bpe", {"max_len": 120, "prefill_chunk": 32}),
])
def test_rendered_demonstrations_equal_the_engines_recording(tier, tokenizer_kind, rollout):
  model, spec, tok, factory, tasks = _setup(tier, tokenizer_kind, **rollout)
  fast = sft.render_demonstrations(tok, spec, factory, tasks, spec.system_prompt,
                                   play_expert=play_expert)
  assert all(d is not None for d in fast)
  reference = sft.record_demonstrations(model, model.init(jax.random.key(0)), spec, tok,
                                        factory, tasks, play_expert=play_expert)
  assert len(fast) == len(reference) == len(tasks)
  for f, r in zip(fast, reference):
    np.testing.assert_array_equal(f.tokens, r.tokens)
    np.testing.assert_array_equal(f.loss_mask, r.loss_mask)
    assert f.length <= spec.token_limit


def test_recovery_demonstrations_leave_the_mistake_untaught_as_the_engine_records_them():
  """Recovery plays (sft.recovery_flags picks them) render as the engine records them, and
  the wrong edit's tokens, and only they, carry no loss."""
  model, spec, tok, factory, tasks = _setup("tiny", "bpe", max_turns=12, max_len=1024)
  recovery = [True, False, True, False]
  plays = dict(play_expert=play_expert, play_recovery=play_recovery, recovery=recovery)
  fast = sft.render_demonstrations(tok, spec, factory, tasks, spec.system_prompt, **plays)
  reference = sft.record_demonstrations(model, model.init(jax.random.key(0)), spec, tok,
                                        factory, tasks, **plays)
  plain = sft.render_demonstrations(tok, spec, factory, tasks, spec.system_prompt,
                                    play_expert=play_expert)
  for f, r, p, recovering in zip(fast, reference, plain, recovery):
    np.testing.assert_array_equal(f.tokens, r.tokens)
    np.testing.assert_array_equal(f.loss_mask, r.loss_mask)
    if not recovering:
      np.testing.assert_array_equal(f.tokens, p.tokens)
      continue
    # The recorded turn whose tokens all carry no loss is the wrong replace.
    untaught = [k for k in np.unique(r.turn_index) if not r.loss_mask[r.turn_index == k].any()]
    assert len(untaught) == 1, untaught
    assert "replace" in tok.decode(r.tokens[r.turn_index == untaught[0]].tolist())
    # Beside the expert's own play it teaches exactly two more actions: the test after the
    # mistake and the view of the module (tool calls and end-of-turn tokens).
    extra = [format_tool_call("test"), format_tool_call("view", path=_module(tok, r))]
    extra_ids = sum(len(tok.encode(a, parse_special=True)) + 1 for a in extra)
    assert f.loss_mask.sum() == p.loss_mask.sum() + extra_ids
    assert f.length > p.length


def _module(tok, traj) -> str:
  """The module the recorded episode edits (the path of its first replace call)."""
  for k in np.unique(traj.turn_index):
    taught = (traj.turn_index == k) & (traj.loss_mask > 0)
    call = parse_tool_call(tok.decode(traj.tokens[taught].tolist()))
    if getattr(call, "name", None) == "replace":
      return call.args["path"]
  raise AssertionError("no replace")


def test_recovery_flags_are_a_seeded_share():
  flags = sft.recovery_flags(1000, 0.6, seed=3)
  assert sum(flags) == 600 and flags == sft.recovery_flags(1000, 0.6, seed=3)
  assert flags != sft.recovery_flags(1000, 0.6, seed=4)
  assert sft.recovery_flags(8, 0.0, 0) == [False] * 8
  assert sft.recovery_flags(8, 1.0, 0) == [True] * 8


def test_an_action_the_engine_would_truncate_is_not_rendered():
  _, spec, tok, factory, tasks = _setup("tiny", "bpe")
  # A replace call of the tiny tier is ~15 BPE tokens; 'ls' and 'test' are 4-5.
  demos = sft.render_demonstrations(
      tok, dataclasses.replace(spec, max_new_tokens_per_turn=8), factory, tasks,
      play_expert=play_expert)
  assert demos == [None] * len(tasks)


def test_demonstration_arrays_pad_and_mark_positions():
  d = sft.Demonstration(np.asarray([5, 6, 7], np.int32), np.asarray([0, 1, 1], np.float32))
  arrays = sft.demonstration_arrays([d], 5)
  np.testing.assert_array_equal(arrays["tokens_bt"], [[5, 6, 7, 0, 0]])
  np.testing.assert_array_equal(arrays["positions_bt"], [[0, 1, 2, -1, -1]])
  np.testing.assert_array_equal(arrays["loss_mask_bt"], [[0, 1, 1, 0, 0]])


def test_sft_base_config_demonstrations_fit_its_budgets():
  """configs/sft_base.py: every expert episode renders whole within max_len."""
  from configs import sft_base
  model, rollout_spec, tok, factory, tasks = _build(sft_base.get_config(), num_tasks=32)
  assert tok.vocab_size <= model.spec.vocab_size
  assert {t.tier for t in tasks} == {"tiny"}
  demos = sft.render_demonstrations(tok, rollout_spec, factory, tasks, rollout_spec.system_prompt,
                                    play_expert=play_expert)
  assert all(d is not None for d in demos)  # No action over max_new_tokens_per_turn.
  lengths = [d.length for d in demos]
  assert max(lengths) < rollout_spec.token_limit, lengths  # None cut by the token budget.


def test_padded_length_rounds_up_and_caps():
  assert sft.padded_length(472, 768) == 512
  assert sft.padded_length(512, 768) == 512
  assert sft.padded_length(513, 768) == 576
  assert sft.padded_length(710, 720) == 720  # Never past the cache capacity.
  with pytest.raises(ValueError, match="positive"):
    sft.padded_length(0, 768)


def test_sft_step_at_the_padded_length_equals_the_full_length():
  """Padding is masked out: the step at the tight length matches the one at max_len."""
  from agentic_rl.rl import train_step as train_step_lib
  from tests.rl.tiny_model import make_model, rl_spec

  model, params = make_model()
  spec = rl_spec()
  optimizer = train_step_lib.make_optimizer(spec)
  state = train_step_lib.init_train_state(model, params, spec)
  state = state.replace(opt_state=optimizer.init(params))
  rng = np.random.default_rng(0)
  demos = [sft.Demonstration(rng.integers(1, 64, n).astype(np.int32),
                             (rng.random(n) < 0.6).astype(np.float32)) for n in (21, 30, 9)]
  step = sft.make_sft_step(model, optimizer)
  results = []
  for length in (sft.padded_length(30, 64, multiple=8), 64):  # 32 vs the model's 64.
    batch = {k: jax.numpy.asarray(v) for k, v in sft.demonstration_arrays(demos, length).items()}
    results.append(step(state, batch))
  (tight, m_tight), (full, m_full) = results
  for k in ("sft/loss", "sft/token_accuracy", "sft/moe_aux_loss", "sft/grad_norm"):
    np.testing.assert_allclose(m_tight[k], m_full[k], rtol=1e-5, atol=1e-7, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               tight.params, full.params)
