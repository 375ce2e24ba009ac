"""The sampler's throughput: the full RolloutEngine on a one-turn, no-tool workload.

    python -m launch.bench_sampler --json
    python -m launch.bench_sampler --batch 32 --num_experts 8 --experts_per_tok 2 \
        --d_ff_expert 256 --json

B prompts of --prompt tokens each generate --gen tokens: temperature 1, the full vocabulary
(top_k 0, top_p 1 unless set), no early stop (the bench tokenizer has no stop id, so every
turn runs to its budget). Each prompt is its own task (group size 1) in its own slot; the
env answers the one turn with done. Everything the engine does per token is timed: prefill
into the prompt store, the copy into a slot, the decode steps and their host bookkeeping.

The default shape is a tiny Qwen3: 4 layers, d_model 256, MLP 1024, 4 query and 2 KV heads
of 64, vocabulary 512, full attention with q/k norms, fp32. --num_experts makes every layer
a routed MoE with no shared expert.

Prints {"tokens_per_s", "batch", "prompt", "gen", "seconds", "compile_seconds",
"ms_per_decode_step", "params", ...}: generated tokens over the median timed run's wall
seconds, after one untimed run that compiles (compile_seconds is that run's wall time).
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app
from absl import flags
import jax
import numpy as np

from agentic_rl.envs.env import StepResult
from agentic_rl.model.config import ModelSpec, MoESpec
from agentic_rl.model.transformer import Model
from agentic_rl.rollout import config as rollout_config
from agentic_rl.rollout import engine as engine_lib

_BATCH = flags.DEFINE_integer("batch", 8, "Prompts sampled together (one slot each).")
_PROMPT = flags.DEFINE_integer("prompt", 128, "Prompt tokens.")
_GEN = flags.DEFINE_integer("gen", 128, "Generated tokens per prompt (no early stop).")
_LAYERS = flags.DEFINE_integer("num_layers", 4, "Layers.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width.")
_D_FF = flags.DEFINE_integer("d_ff", 1024, "Dense MLP hidden size.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 2, "Key/value heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head size.")
_VOCAB = flags.DEFINE_integer("vocab_size", 512, "Vocabulary.")
_PATTERN = flags.DEFINE_string("layer_pattern", "F", "Layer letters (F full, S window, G sparse).")
_EXPERTS = flags.DEFINE_integer("num_experts", 0, "Routed experts in every layer (0: dense).")
_TOP = flags.DEFINE_integer("experts_per_tok", 2, "Experts per token.")
_D_FF_EXPERT = flags.DEFINE_integer("d_ff_expert", 256, "Expert MLP hidden size.")
_EXPERT_MATMUL = flags.DEFINE_enum("expert_matmul", "auto", ["auto", "ragged_dot", "grouped"],
                                   "config.model.moe.expert_matmul.")
_SCAN = flags.DEFINE_bool("scan_layers", False, "config.model.scan_layers: the layer stack "
                           "and its cache scanned (compile time flat in depth).")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k (0: off).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Top-p (1: off).")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 128, "Prefill chunk.")
_PREFILL_ROWS = flags.DEFINE_integer(
    "prefill_rows", 16, "config.rollout.prefill_rows: prompts prefilled per call (the "
    "prompt store holds as many).")
_STEPS_PER_CALL = flags.DEFINE_integer(
    "decode_steps_per_call", getattr(rollout_config.RolloutSpec, "decode_steps_per_call", 1),
    "config.rollout.decode_steps_per_call: decode steps per device call.")
_MAX_LEN = flags.DEFINE_integer(
    "max_len", 0, "Cache capacity per slot (a multiple of 8); at least prompt + gen + 1. "
    "A capacity above the context shows decode cost following the context.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs (the median is reported).")
_JSON = flags.DEFINE_bool("json", False, "Print only the JSON report.")


# The engine's time buckets (RolloutStats), reported per timed run. Spelled out here, not
# imported: compare_samplers runs this script on an older checkout too.
_SPLIT = ("decode_s", "prefill_s", "fork_s", "env_wait_s", "host_s")
# Every stat the report reads, counted over the timed runs (an older checkout has no
# decode_calls or fork_s: 0).
_COUNTED = _SPLIT + ("decode_steps", "decode_calls")


class BenchTokenizer:
  """Ids only: a prompt is --prompt ids drawn from the task's seed; nothing stops a turn
  early (no stop id), and no text is ever rendered."""

  def __init__(self, vocab_size: int, prompt: int):
    self.vocab_size, self.prompt = vocab_size, prompt
    self.special_ids = {}
    self.bos_id = self.eos_id = self.pad_id = self.end_turn_id = 0
    self.stop_ids = ()

  def render_conversation(self, turns, *, add_generation_prompt=False, tools=None):
    seed = int(list(turns)[-1][1])
    return np.random.default_rng(seed).integers(1, self.vocab_size, self.prompt).tolist()

  def decode(self, ids) -> str:
    return ""

  def encode(self, text, *, parse_special=True):
    return []

  def generation_prompt(self):
    return []

  def observation_turn(self, text):
    return []


class OneTurnEnv:
  """The task is its prompt's seed; the one turn ends the episode."""

  def reset(self, task) -> str:
    return str(task)

  def step(self, action_text: str) -> StepResult:
    return StepResult("", 0.0, True, {"end_reason": "done"})

  def close(self):
    pass


def capacity() -> int:
  """Cache positions per slot: the prompt and the generation (+1 flushed), in whole blocks
  (ModelSpec's default block_size, 8), or --max_len when larger."""
  return max(-(-(_PROMPT.value + _GEN.value + 1) // 8) * 8, _MAX_LEN.value)


def model_spec() -> ModelSpec:
  moe = {}
  if _EXPERTS.value:
    moe = dict(num_dense_layers=0, moe=MoESpec(
        num_experts=_EXPERTS.value, num_experts_per_token=_TOP.value,
        d_ff_expert=_D_FF_EXPERT.value, num_shared_experts=0,
        **_known(MoESpec, expert_matmul=_EXPERT_MATMUL.value)))
  else:
    moe = dict(num_dense_layers=_LAYERS.value, moe=MoESpec(num_experts=0))
  return ModelSpec(vocab_size=_VOCAB.value, d_model=_D_MODEL.value, num_layers=_LAYERS.value,
                   layer_pattern=_PATTERN.value, num_heads=_HEADS.value,
                   num_kv_heads=_KV_HEADS.value, head_dim=_HEAD_DIM.value, d_ff=_D_FF.value,
                   max_seq_len=capacity(), qk_norm=True,
                   tie_embeddings=False, dtype="float32", param_dtype="float32",
                   scan_layers=_SCAN.value, **moe)


def _known(cls, **fields) -> dict:
  """The fields `cls` has: compare_samplers runs this script on an older checkout too."""
  return {k: v for k, v in fields.items() if k in cls.__dataclass_fields__}


def run_once(engine, batch: int, first_task: int) -> float:
  t0 = time.perf_counter()
  trajs = engine.run(list(range(first_task, first_task + batch)))
  seconds = time.perf_counter() - t0
  generated = sum(t.num_generated for t in trajs)
  if generated != batch * _GEN.value:
    raise RuntimeError(f"generated {generated} tokens, expected {batch} x {_GEN.value}: "
                       f"end reasons {sorted({t.end_reason for t in trajs})}.")
  return seconds


def main(argv):
  del argv
  spec = model_spec()
  model = Model(spec)
  params = model.init(jax.random.key(0))
  batch = _BATCH.value
  rspec = rollout_config.validate(_rollout_config(batch), spec, seed=0)
  engine = engine_lib.RolloutEngine(model, params, rspec,
                                    BenchTokenizer(_VOCAB.value, _PROMPT.value), OneTurnEnv)
  try:
    compile_seconds = run_once(engine, batch, 0)  # Compiles every step shape.
    before = {k: getattr(engine.stats, k, 0) for k in _COUNTED}
    seconds = [run_once(engine, batch, (r + 1) * batch) for r in range(_REPEATS.value)]
    counted = {k: getattr(engine.stats, k, 0) - before[k] for k in _COUNTED}
  finally:
    engine.close()
  median = statistics.median(seconds)
  report = {
      "tokens_per_s": batch * _GEN.value / median, "batch": batch, "prompt": _PROMPT.value,
      "gen": _GEN.value, "max_len": capacity(), "seconds": median, "seconds_all": seconds,
      "compile_seconds": compile_seconds,
      "ms_per_decode_step": 1e3 * counted["decode_s"] / max(counted["decode_steps"], 1),
      "decode_steps_per_run": counted["decode_steps"] / len(seconds),
      "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
      "moe": bool(_EXPERTS.value),
      "decode_steps_per_call": _STEPS_PER_CALL.value,
      "decode_calls_per_run": counted["decode_calls"] / len(seconds),
      "scan_layers": _SCAN.value, "top_k": _TOP_K.value, "top_p": _TOP_P.value,
      "backend": jax.default_backend(),
      "seconds_split": {k: counted[k] / len(seconds) for k in _SPLIT},
  }
  print(json.dumps(report) if _JSON.value else json.dumps(report, indent=1))


def _rollout_config(batch: int):
  c = rollout_config.default_rollout_config()
  c.num_slots = batch
  c.max_len = capacity()
  c.prefill_chunk = min(_CHUNK.value, capacity())
  c.prompt_store_rows = max(4, min(batch, _PREFILL_ROWS.value, 64))
  c.prefill_rows = min(_PREFILL_ROWS.value, c.prompt_store_rows, batch)
  c.temperature, c.top_k, c.top_p = _TEMPERATURE.value, _TOP_K.value, _TOP_P.value
  c.group_size = 1
  c.max_turns = 1
  c.max_new_tokens_per_turn = _GEN.value
  if "decode_steps_per_call" in c:  # An older checkout (compare_samplers' baseline) lacks it.
    c.decode_steps_per_call = _STEPS_PER_CALL.value
  c.env_threads = 2
  return c


if __name__ == "__main__":
  app.run(main)
