"""The engine under config.model.scan_layers: the stacked cache (model/cache.py, "stack")
samples the tokens and log-probs the per-layer cache samples, and the learner's scanned
full forward agrees with them as the unscanned one does."""

import jax
import numpy as np

from agentic_rl.envs.countdown import CountdownEnv
from agentic_rl.model import config as model_config
from agentic_rl.model import layer_stack, transformer
from agentic_rl.records import trajectory as trajectory_lib
from agentic_rl.rollout import sampling
from agentic_rl.rollout.device_steps import DeviceSteps
from tests.rollout.conftest import CHUNKS, SAMPLED, make_engine, tiny_model_config
from tests.rollout.test_engine import TASKS, learner_logprobs


def _spec(scan_layers: bool):
  c = tiny_model_config()
  c.layer_pattern, c.num_layers = "SG", 5  # A dense S, then two repeats of MoE (S, G).
  c.scan_layers = scan_layers
  return model_config.validate(c)


def _run(model, params, tokenizer):
  steps = DeviceSteps(model, sampling.SamplingParams(**SAMPLED), CHUNKS)
  engine = make_engine((model, params), tokenizer, steps, CountdownEnv, group_size=2)
  trajectories = engine.run(TASKS[:3])
  engine.close()
  return trajectory_lib.to_batch(trajectories)


def test_the_scanned_sampler_equals_the_unrolled_one_and_the_learner(tokenizer):
  unrolled = transformer.Model(_spec(False))
  params = unrolled.init(jax.random.key(3))
  scanned = transformer.Model(_spec(True))
  assert scanned.spec.layer_scan.period == 2 and scanned.spec.layer_scan.repeats == 2
  stacked = layer_stack.stack_layers(params, scanned.spec)
  want = _run(unrolled, params, tokenizer)
  got = _run(scanned, stacked, tokenizer)
  np.testing.assert_array_equal(np.asarray(got.tokens_bt), np.asarray(want.tokens_bt))
  mask = np.asarray(got.loss_mask_bt) > 0
  assert mask.sum() > 50
  np.testing.assert_allclose(np.asarray(got.sampler_logp_bt)[mask],
                             np.asarray(want.sampler_logp_bt)[mask], atol=1e-5)
  logp, _ = learner_logprobs(scanned, stacked, got)
  assert np.abs(logp - np.asarray(got.sampler_logp_bt))[mask].max() < 1e-4
