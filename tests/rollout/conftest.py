"""Shared fixtures: one tiny model with S, G and F attention and MoE, and compiled steps.

Compiling the model's forward takes seconds on a CPU, so the device steps are
session fixtures that every engine of a given sampling setting reuses.
"""

from __future__ import annotations

import jax
import pytest

from agentic_rl.model import config as model_config
from agentic_rl.model import transformer
from agentic_rl.rollout import config as rollout_config
from agentic_rl.rollout import engine as engine_lib
from agentic_rl.rollout import sampling
from agentic_rl.rollout.device_steps import DeviceSteps
from agentic_rl.rollout.tokenizer import ByteTokenizer

CHUNK = 32
# The engine's prefill chunks: prefill_chunk 32 halved down to prefill_chunk_min 16.
CHUNKS = (16, 32)
MAX_LEN = 2048  # Holds a real SWE trajectory (~1.8K byte tokens).
SAMPLED = dict(temperature=3.0, top_k=40, top_p=0.95)
GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0)


def tiny_model_config():
  c = model_config.default_model_config()
  c.vocab_size = 320
  c.d_model = 32
  c.num_layers = 3
  c.layer_pattern = "SGF"  # One of each attention type; layers 1 and 2 are MoE.
  c.num_heads = 2
  c.num_kv_heads = 1
  c.head_dim = 8
  c.max_seq_len = MAX_LEN
  c.sliding_window = 8
  c.block_size = 4
  c.topk_tokens = 8
  c.num_dense_layers = 1
  c.d_ff = 64
  c.moe.num_experts = 4
  c.moe.num_experts_per_token = 2
  c.moe.d_ff_expert = 16
  return c


@pytest.fixture(scope="session")
def tiny_model():
  spec = model_config.validate(tiny_model_config())
  model = transformer.Model(spec)
  return model, model.init(jax.random.key(0))


@pytest.fixture(scope="session")
def tokenizer():
  return ByteTokenizer()


@pytest.fixture(scope="session")
def sampled_steps(tiny_model):
  return DeviceSteps(tiny_model[0], sampling.SamplingParams(**SAMPLED), CHUNKS)


@pytest.fixture(scope="session")
def greedy_steps(tiny_model):
  return DeviceSteps(tiny_model[0], sampling.SamplingParams(**GREEDY), CHUNKS)


def rollout_spec(model, *, seed: int = 0, **overrides):
  """The tests' rollout spec; `seed` is config.seed, joined as the run joins it."""
  c = rollout_config.default_rollout_config()
  c.num_slots = 3
  c.prefill_chunk = CHUNK
  c.prefill_chunk_min = CHUNKS[0]
  c.max_new_tokens_per_turn = 12
  c.max_turns = 3
  c.env_threads = 4
  c.update(SAMPLED)
  c.update(overrides)
  return rollout_config.validate(c, model.spec, seed=seed)


def make_engine(tiny_model, tokenizer, steps, env_factory, *, teacher_factory=None,
                **overrides):
  model, params = tiny_model
  return engine_lib.RolloutEngine(model, params, rollout_spec(model, **overrides), tokenizer,
                                  env_factory, teacher_factory=teacher_factory, steps=steps)
