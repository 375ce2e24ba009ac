"""The learner's speed: the RL train step of a config on a synthetic batch, against this
CPU's own fp32 matmul peak.

    python -m launch.bench_learner --config configs/quickstart.py --json
    python -m launch.bench_learner --config.model.d_model=512 --batch 16 --seq_len 512 --json

The batch: --batch sequences of --seq_len tokens (random ids), the second half of each
generated (loss mask 1), groups of config.rollout.group_size with mixed rewards, replay
recorded by a forward of the same params (as the sampler records it), and a packed sampling
mask of all-zero rows (the learner replays it when config.rollout truncates). The
step is config.rl's: PPO epochs of minibatch updates, micro-batches, AdamW.

FLOPs are XLA's cost analysis of one compiled update times the updates per step, plus the
scoring forward when the step has one (analysed the same way). The peak is the best of
several jitted fp32 [N, N] x [N, N] matmuls timed here and now. peak_bytes is XLA's memory
analysis of one update (arguments + outputs + temporaries, less donated aliases).

Prints {"tokens_per_s", "flops_per_s", "matmul_peak_flops_per_s", "fraction_of_peak",
"peak_bytes", "seconds", "compile_seconds", "tokens", "updates", "params"}.
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
from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "Config file.")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per RL step.")
_SEQ = flags.DEFINE_integer("seq_len", 512, "Tokens per sequence.")
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


def synthetic_batch(model, params, spec, rspec, batch: int, length: int) -> Batch:
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, model.spec.vocab_size, (batch, length)).astype(np.int32)
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length)).copy()
  loss_mask = np.zeros((batch, length), np.float32)
  loss_mask[:, length // 2:] = 1.0
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
  batch = synthetic_batch(model, params, spec, rspec, _BATCH.value, _SEQ.value)
  # Donated, as the run's step is: each timed step spends the state the last one made.
  step = train_step_lib.make_train_step(model, spec, donate=True)
  states = [train_step_lib.init_train_state(model, params, spec, ref_params=ref)]

  def timed():
    t0 = time.perf_counter()
    new_state, metrics = step(states[-1], batch)
    jax.block_until_ready((new_state, metrics))
    states.append(new_state)
    return time.perf_counter() - t0

  compile_seconds = timed()
  seconds = statistics.median(timed() for _ in range(_STEPS.value))

  # One update's compiled cost (the minibatch rows the step feeds it), times the updates.
  rows = _BATCH.value // spec.minibatches
  sub = jax.tree.map(lambda x: x[:rows], batch)
  update = train_step_lib.make_update(model, spec, donate=True)
  compiled = update.lower(state, sub, None).compile()
  flops = float(compiled.cost_analysis()["flops"]) * spec.updates_per_step
  memory = compiled.memory_analysis()
  peak_bytes = int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                   + memory.temp_size_in_bytes - memory.alias_size_in_bytes)
  if spec.updates_per_step > 1:  # The scoring forward (old policy, KL reference).
    score = jax.jit(lambda p, r, b: learner.with_old_policy(model, p, b, spec, r))
    flops += float(score.lower(state.params, state.ref_params, batch).compile()
                   .cost_analysis()["flops"])
  peak = matmul_peak(_MATMUL.value)
  tokens = _BATCH.value * _SEQ.value
  report = {
      "tokens_per_s": tokens / seconds, "flops_per_s": flops / seconds,
      "matmul_peak_flops_per_s": peak, "fraction_of_peak": flops / seconds / peak,
      "peak_bytes": peak_bytes, "seconds": seconds, "compile_seconds": compile_seconds,
      "tokens": tokens, "updates": spec.updates_per_step, "flops_per_step": flops,
      "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
      "backend": jax.default_backend(),
  }
  print(json.dumps(report) if _JSON.value else json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
