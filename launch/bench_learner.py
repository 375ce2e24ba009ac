"""The learner's speed: the RL train step of a config on a synthetic batch, against this
CPU's own fp32 matmul peak.

    python -m launch.bench_learner --config configs/quickstart.py --json
    python -m launch.bench_learner --config.model.d_model=512 --batch 16 --seq_len 512 --json

The batch: --batch sequences of --seq_len padded tokens (random ids), each row's length drawn
uniformly from [--min_len, --seq_len] (default: every row full), the second half of each
row generated (loss mask 1), groups of config.rollout.group_size with mixed rewards, replay
recorded by a forward of the same params (as the sampler records it), and a packed sampling
mask of all-zero rows (the learner replays it when config.rollout truncates). The
step is config.rl's: PPO epochs of minibatch updates, micro-batches, AdamW, each minibatch
cut to the learner length (config.train.learner_lengths at --seq_len) its rows need, as
the RL phase runs it. "tokens" counts real tokens; "padded_tokens" what the updates ran.

FLOPs are XLA's cost analysis of each update compiled at the length the step cut it to,
summed over a step (averaged over the timed steps), plus the scoring forward when the step
has one (analysed the same way). The peak is the best of several jitted fp32 [N, N] x
[N, N] matmuls timed here and now. peak_bytes is XLA's memory analysis of the largest of
those updates (arguments + outputs + temporaries, less donated aliases).

Prints {"tokens_per_s", "flops_per_s", "matmul_peak_flops_per_s", "fraction_of_peak",
"peak_bytes", "seconds", "compile_seconds", "tokens", "padded_tokens", "updates",
"params"}.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model import config as model_config
from agentic_rl.model import transformer
from agentic_rl.records import sampling_mask
from agentic_rl.records.batch import Batch
from agentic_rl.rl import config as rl_config
from agentic_rl.rl import learner
from agentic_rl.rl import train_step as train_step_lib
from agentic_rl.rollout import config as rollout_config
from agentic_rl.train import learner_lengths
from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "Config file.")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per RL step.")
_SEQ = flags.DEFINE_integer("seq_len", 512, "Padded tokens per sequence.")
_MIN_LEN = flags.DEFINE_integer("min_len", 0, "Shortest row (0: every row --seq_len).")
_CUT = flags.DEFINE_bool("cut_minibatches", True,
                         "Cut each minibatch to the learner length its rows need (the RL "
                         "phase's step); false runs every update at --seq_len.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps (the median is reported).")
_MATMUL = flags.DEFINE_integer("matmul_size", 2048, "N of the peak-measuring matmul.")
_JSON = flags.DEFINE_bool("json", False, "Print only the JSON report.")


def matmul_peak(n: int, repeats: int = 5) -> float:
  """FLOP/s of the best of `repeats` jitted fp32 [n, n] x [n, n] matmuls."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  mm = jax.jit(jnp.matmul)
  mm(a, b).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    mm(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best


def synthetic_batch(model, params, spec, rspec, batch: int, length: int,
                    min_len: int = 0) -> Batch:
  rng = np.random.default_rng(0)
  lengths_b = (np.full(batch, length) if min_len <= 0
               else rng.integers(min(min_len, length), length + 1, batch))
  tokens = rng.integers(1, model.spec.vocab_size, (batch, length)).astype(np.int32)
  arange_t = np.arange(length, dtype=np.int32)
  real_bt = arange_t[None, :] < lengths_b[:, None]
  tokens = np.where(real_bt, tokens, 0)
  positions = np.where(real_bt, arange_t[None, :], -1).astype(np.int32)
  loss_mask = (real_bt & (arange_t[None, :] >= lengths_b[:, None] // 2)).astype(np.float32)
  loss_mask[:, 0] = 0.0
  group = max(rspec.group_size, 1)
  rewards = (rng.random(batch) < 0.5).astype(np.float32)
  _, _, aux = jax.jit(model.forward)(params, tokens, positions)
  width = sampling_mask.packed_width(model.spec.vocab_size)
  return Batch(
      tokens_bt=jnp.asarray(tokens), positions_bt=jnp.asarray(positions),
      loss_mask_bt=jnp.asarray(loss_mask),
      sampler_logp_bt=jnp.asarray(loss_mask * -np.log(model.spec.vocab_size)),
      turn_index_bt=jnp.zeros((batch, length), jnp.int32), rewards_b=jnp.asarray(rewards),
      group_id_b=jnp.asarray(np.arange(batch) // group, jnp.int32),
      process_reward_bt=jnp.zeros((batch, length), jnp.float32),
      temperature_b=jnp.full((batch,), rspec.recorded_temperature, jnp.float32),
      replay=transformer.replay_from_aux(aux),
      sampling_mask_btw=jnp.zeros((batch, length, width), jnp.uint8))


def main(argv):
  del argv
  config = _CONFIG.value
  mspec = model_config.validate(config.model)
  model = transformer.Model(mspec)
  rspec = rollout_config.validate(config.rollout, mspec, seed=config.seed)
  spec = rl_config.validate(config.rl, config.model, config.rollout)
  params = model.init(jax.random.key(config.seed))
  ref = params if spec.loss.kl_coef > 0 else None
  state = train_step_lib.init_train_state(model, params, spec, ref_params=ref)
  params = jax.tree.map(lambda x: x.copy(), params)  # The timed steps spend their own.
  batch = synthetic_batch(model, params, spec, rspec, _BATCH.value, _SEQ.value,
                          _MIN_LEN.value)
  lengths = (learner_lengths.learner_lengths(config.train.learner_lengths, _SEQ.value)
             if _CUT.value else ())
  # Donated, as the run's step is: each timed step spends the state the last one made.
  step = train_step_lib.make_train_step(model, spec, donate=True, lengths=lengths)
  states = [train_step_lib.init_train_state(model, params, spec, ref_params=ref)]

  def timed():
    t0 = time.perf_counter()
    new_state, metrics = step(states[-1], batch)
    jax.block_until_ready((new_state, metrics))
    states.append(new_state)
    padded.append(float(metrics.get("learner/minibatch_length", batch.length)))
    return time.perf_counter() - t0

  padded = []
  t0 = time.perf_counter()
  step.precompile(states[-1], batch)
  compile_seconds = time.perf_counter() - t0 + timed()
  seconds = statistics.median(timed() for _ in range(_STEPS.value))

  # Each update's compiled cost, on its minibatch at the length the step cut it to, summed
  # over a step and averaged over the timed steps (each shuffles its rows anew).
  row_lengths = train_step_lib.row_lengths_of(batch)
  update = train_step_lib.make_update(model, spec, donate=True)
  u = spec.updates_per_step
  flops, peak_bytes, compiled_at = 0.0, 0, {}
  for k in range(1, _STEPS.value + 1):
    plan = (train_step_lib.minibatch_rows(spec, _BATCH.value, k * u) if u > 1
            else [np.arange(_BATCH.value)])  # One update: the batch whole, never cut.
    for rows in plan:
      length = (train_step_lib.minibatch_length(row_lengths[rows], lengths, batch.length)
                if u > 1 else batch.length)
      if length not in compiled_at:
        sub = jax.tree.map(lambda x: x[:len(rows)], batch).truncated(length)
        compiled_at[length] = update.lower(state, sub, None).compile()
      flops += float(compiled_at[length].cost_analysis()["flops"]) / _STEPS.value
  for compiled in compiled_at.values():
    memory = compiled.memory_analysis()
    peak_bytes = max(peak_bytes, int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                                     + memory.temp_size_in_bytes - memory.alias_size_in_bytes))
  if spec.updates_per_step > 1:  # The scoring forward (old policy, KL reference).
    score = jax.jit(lambda p, r, b: learner.with_old_policy(model, p, b, spec, r))
    flops += float(score.lower(state.params, state.ref_params, batch).compile()
                   .cost_analysis()["flops"])
  peak = matmul_peak(_MATMUL.value)
  tokens = int(row_lengths.sum())
  report = {
      "tokens_per_s": tokens / seconds, "flops_per_s": flops / seconds,
      "matmul_peak_flops_per_s": peak, "fraction_of_peak": flops / seconds / peak,
      "peak_bytes": peak_bytes, "seconds": seconds, "compile_seconds": compile_seconds,
      "tokens": tokens, "padded_tokens": _BATCH.value * statistics.mean(padded[1:]),
      "updates": spec.updates_per_step, "flops_per_step": flops,
      "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
      "backend": jax.default_backend(),
  }
  print(json.dumps(report) if _JSON.value else json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
