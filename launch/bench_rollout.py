"""Rollout throughput on the SWE environment, and the two cache-reuse ratios.

    python -m launch.bench_rollout --config configs/quickstart.py --json

1. Engine run. The scripted expert plays each task once on a shadow env (not
   timed) and its actions are replayed by teacher forcing: every token still
   runs through the engine's prefill and decode with the config's model, so
   the run has the SWE tasks' real trajectory lengths (turns, action and
   observation sizes, tool latencies in the real sandbox). Reports generated
   tokens/s, trajectories/s, slot utilisation, the decode / prefill / env time
   split and the peak KV bytes.
2. Prefix reuse. At a total context of 256 / 1K / 4K tokens, appending one
   observation (the median SWE observation length of run 1) to a slot whose
   cache holds the prefix, vs prefilling the whole context into an empty slot.
3. Group prefill. The real SWE prompt for G samples: prefill once into the
   prompt store and copy into G slots, vs G separate prefills.

Both comparisons use the engine's own compiled steps and include the host
transfer of each call's replay data, as the engine does.
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

from agentic_rl.envs import config as env_config_lib
from agentic_rl.envs import datasets
from agentic_rl.envs import expert
from agentic_rl.envs import swe_env
from agentic_rl.model import config as model_config
from agentic_rl.model import transformer
from agentic_rl.rollout import config as rollout_config
from agentic_rl.rollout import engine as engine_lib
from agentic_rl.rollout import engine_stats
from agentic_rl.rollout import teacher as teacher_lib
from agentic_rl.rollout import tokenizer as tokenizer_lib
from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "Config file.")
_JSON = flags.DEFINE_bool("json", False, "Print only the JSON report.")
_TASKS = flags.DEFINE_integer("num_tasks", 48, "SWE tasks (groups) in the timed run.")
_TIER = flags.DEFINE_string("tier", "easy", "SWE difficulty tier.")
_SLOTS = flags.DEFINE_integer("num_slots", 0, "Override config.rollout.num_slots (0: keep).")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 0, "Override config.rollout.prefill_chunk.")
_GROUP = flags.DEFINE_integer("group_size", 0, "Override config.rollout.group_size.")
_COMPARE_G = flags.DEFINE_integer("compare_group_size", 4, "G of the group-prefill comparison.")
_CONTEXTS = flags.DEFINE_list("contexts", ["256", "1024", "4096"], "Contexts for prefix reuse.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats of each comparison (median).")


def _rollout_spec(config, spec):
  c = config.rollout if "rollout" in config else rollout_config.default_rollout_config()
  c = c.copy_and_resolve_references()
  if "rollout" not in config:
    # The engine must hold a whole SWE trajectory (~2K tokens) and the 4K comparison.
    c.max_new_tokens_per_turn = 512
    c.max_turns = 32
  for field, flag in (("num_slots", _SLOTS), ("prefill_chunk", _CHUNK),
                      ("group_size", _GROUP)):
    if flag.value:
      c[field] = flag.value
  return rollout_config.validate(c, spec)


def _fetch(out):
  """What the engine transfers after each call: the draws and the replay data."""
  return jax.device_get((out.sampled, out.replay))


def _prefill_tokens(steps, params, cache, row, tokens, start, rows_p):
  """Chunked prefill of `tokens` into cache row `row` from position `start`."""
  chunk = steps.chunk
  for lo in range(0, len(tokens), chunk):
    piece = tokens[lo:lo + chunk]
    tok = np.zeros((rows_p, chunk), np.int32)
    pos = np.full((rows_p, chunk), -1, np.int32)
    tok[0, :len(piece)] = piece
    pos[0, :len(piece)] = np.arange(start + lo, start + lo + len(piece))
    rows = np.asarray([row] + [r for r in range(rows_p + 1) if r != row][:rows_p - 1], np.int32)
    cache, out = steps.prefill(params, cache, jnp.asarray(rows), jnp.asarray(tok),
                               jnp.asarray(pos), jnp.zeros(rows_p, jnp.uint32),
                               jnp.full(rows_p, -1, jnp.int32))
    _fetch(out)
  return cache, out


def _reset(steps, cache, rows, num_rows):
  mask = np.zeros(num_rows, bool)
  mask[list(rows)] = True
  return steps.reset_rows(cache, jnp.asarray(mask))


def prefix_reuse(engine, params, contexts, obs_tokens, repeats, rng):
  """{context: seconds of append vs re-prefill}, with the engine's steps and slot count.

  The cache holds model.max_seq_len positions (the engine's own max_len may be
  shorter), the same for every context, so the 4K comparison runs whatever
  config.rollout.max_len is.
  """
  spec, steps = engine.spec, engine.steps
  p = spec.prefill_rows
  capacity = engine.model.spec.max_seq_len
  cache = engine.model.init_cache(spec.num_slots, capacity)
  results = {}
  for context in contexts:
    if context > capacity or context <= obs_tokens:
      results[str(context)] = {"skipped": f"context {context} needs obs_tokens < context "
                                          f"<= model.max_seq_len={capacity}"}
      continue
    tokens = rng.integers(0, 256, context).astype(np.int32)
    prefix, obs = tokens[:context - obs_tokens], tokens[context - obs_tokens:]
    reuse_s, full_s = [], []
    for _ in range(repeats + 1):  # The first round warms up.
      cache = _reset(steps, cache, [0], spec.num_slots)
      cache, _ = _prefill_tokens(steps, params, cache, 0, prefix, 0, p)
      jax.block_until_ready(cache)
      t0 = time.perf_counter()
      cache, out_reuse = _prefill_tokens(steps, params, cache, 0, obs, len(prefix), p)
      jax.block_until_ready(cache)
      reuse_s.append(time.perf_counter() - t0)
      logits_reuse = np.asarray(out_reuse.last_logits_bv[0])
      cache = _reset(steps, cache, [0], spec.num_slots)
      jax.block_until_ready(cache)
      t0 = time.perf_counter()
      cache, out_full = _prefill_tokens(steps, params, cache, 0, tokens, 0, p)
      jax.block_until_ready(cache)
      full_s.append(time.perf_counter() - t0)
      logits_full = np.asarray(out_full.last_logits_bv[0])
    reuse, full = statistics.median(reuse_s[1:]), statistics.median(full_s[1:])
    results[str(context)] = {
        "reuse_s": reuse, "reprefill_s": full, "speedup": full / reuse,
        "prefix_tokens": int(len(prefix)), "appended_tokens": int(obs_tokens),
        "cache_capacity": capacity,
        # Both paths end in the same state: the next-token logits agree.
        "max_abs_logit_diff": float(np.max(np.abs(logits_reuse - logits_full)))}
  return results


def group_prefill(engine, params, prompt, group, repeats):
  """Seconds for G samples' prompt: one prefill + G copies, vs G prefills."""
  spec, steps = engine.spec, engine.steps
  p = spec.prefill_rows
  cache = engine.model.init_cache(spec.num_slots, spec.max_len)
  store = engine.model.init_cache(spec.prompt_store_rows, spec.max_len)
  prompt = np.asarray(prompt, np.int32)
  shared_s, separate_s = [], []
  for _ in range(repeats + 1):
    store = _reset(steps, store, [0], spec.prompt_store_rows)
    jax.block_until_ready(store)
    t0 = time.perf_counter()
    store, out = _prefill_tokens(steps, params, store, 0, prompt, 0, p)
    logits_v = out.last_logits_bv[0]
    for g in range(group):
      cache, sampled = steps.fork(cache, store, jnp.int32(0), jnp.int32(g), logits_v,
                                  jnp.uint32(g), jnp.int32(len(prompt) - 1), jnp.int32(-1))
      jax.device_get(sampled)
    jax.block_until_ready(cache)
    shared_s.append(time.perf_counter() - t0)
    cache = _reset(steps, cache, range(group), spec.num_slots)
    jax.block_until_ready(cache)
    t0 = time.perf_counter()
    for g in range(group):
      cache, _ = _prefill_tokens(steps, params, cache, g, prompt, 0, p)
    jax.block_until_ready(cache)
    separate_s.append(time.perf_counter() - t0)
  shared, separate = statistics.median(shared_s[1:]), statistics.median(separate_s[1:])
  return {"group_size": group, "prompt_tokens": int(len(prompt)), "shared_s": shared,
          "separate_s": separate, "speedup": separate / shared}


def main(argv):
  del argv
  config = _CONFIG.value
  spec = model_config.validate(config.model)
  rspec = _rollout_spec(config, spec)
  tokenizer = (tokenizer_lib.make_tokenizer(config.tokenizer) if "tokenizer" in config
               else tokenizer_lib.ByteTokenizer())
  env_cfg = env_config_lib.validate_env_config(config.env if "env" in config else None,
                                               max_turns=rspec.max_turns)
  model = transformer.Model(spec)
  params = model.init(jax.random.key(config.get("seed", 0)))
  env_factory = lambda: swe_env.SweEnv(env_cfg)

  source = datasets.SweTaskSource("train", tiers=(_TIER.value,), config=env_cfg)
  tasks = [source[i] for i in range(_TASKS.value + 1)]  # The first one warms up.
  t0 = time.perf_counter()
  actions = teacher_lib.record_expert_actions(tasks, env_factory, expert.play_expert)
  expert_s = time.perf_counter() - t0
  by_seed = {task.seed: a for task, a in zip(tasks, actions)}
  teacher_factory = lambda task: teacher_lib.ReplayTeacher(by_seed[task.seed])

  warm = engine_lib.RolloutEngine(model, params, rspec, tokenizer, env_factory,
                                  teacher_factory=teacher_factory)
  warm.run(tasks[:1])
  warm.warm_up()  # Every cache-length bucket, as the RL loop compiles before its clock.
  warm.close()
  compiled = warm.compiled_step_count()
  engine = engine_lib.RolloutEngine(model, params, rspec, tokenizer, env_factory,
                                    teacher_factory=teacher_factory, steps=warm.steps)
  trajectories = engine.run(tasks[1:])
  engine.close()
  stats = engine.stats.as_dict()
  recompiled = engine.compiled_step_count() - compiled

  # Tokens each observation prefill appended: the pending last model token, the tool
  # turn and the next assistant header (everything between two model turns, plus one).
  obs_lengths = [start - end + 1 for t in trajectories
                 for (_, end), (start, _) in zip(t.turn_spans[:-1], t.turn_spans[1:])]
  obs_tokens = int(statistics.median(obs_lengths)) if obs_lengths else 128
  rng = np.random.default_rng(0)
  contexts = [int(c) for c in _CONTEXTS.value]
  reuse = prefix_reuse(engine, params, contexts, obs_tokens, _REPEATS.value, rng)
  prompt = trajectories[0].tokens[:trajectories[0].prompt_length]
  group = group_prefill(engine, params, prompt, min(_COMPARE_G.value, rspec.num_slots),
                        _REPEATS.value)

  report = {
      "tokens_per_s": stats["tokens_per_s"],
      "trajectories_per_s": stats["trajectories_per_s"],
      "slot_utilization": stats["slot_utilization"],
      "decode_occupancy": stats["decode_occupancy"],
      "steady_slot_utilization": stats["steady_slot_utilization"],
      "prefix_reuse_speedup": {k: v.get("speedup") for k, v in reuse.items()},
      "group_prefill_speedup": group["speedup"],
      "time_split_s": {k: stats[k] for k in engine_stats.TIME_BUCKETS},
      "time_split_share": {k: stats[k] / max(stats["wall_s"], 1e-9)
                           for k in engine_stats.TIME_BUCKETS},
      "env_thread_s": stats["env_thread_s"],
      "wall_s": stats["wall_s"],
      "peak_kv_bytes": stats["peak_kv_bytes"],
      "allocated_kv_bytes": stats["allocated_kv_bytes"],
      "generated_tokens": stats["generated_tokens"],
      "prefilled_tokens": stats["prefilled_tokens"],
      # Real tokens of what the prefill calls computed (rows x chunk, padding included).
      "prefill_fill": stats["prefill_fill"],
      "trajectories": stats["trajectories"],
      "decode_steps": stats["decode_steps"],
      "prefill_calls": stats["prefill_calls"],
      "mean_trajectory_tokens": float(np.mean([t.length for t in trajectories])),
      "mean_turns": float(np.mean([t.num_turns for t in trajectories])),
      "median_observation_tokens": obs_tokens,
      "end_reasons": {r: sum(t.end_reason == r for t in trajectories)
                      for r in sorted({t.end_reason for t in trajectories})},
      "mean_reward": float(np.mean([t.reward for t in trajectories])),
      "recompilations_during_run": recompiled,
      "prefix_reuse": reuse,
      "group_prefill": group,
      "expert_precompute_s": expert_s,
      "isolation": sorted({info["isolation"] for t in trajectories for info in t.tool_infos
                           if info and "isolation" in info}),
      "setup": {"num_slots": rspec.num_slots, "prefill_chunk": rspec.prefill_chunk,
                "prefill_rows": rspec.prefill_rows, "group_size": rspec.group_size,
                "max_len": rspec.max_len, "layer_types": "".join(spec.layer_types),
                "temperature": rspec.temperature, "top_k": rspec.top_k, "top_p": rspec.top_p,
                "tasks": len(tasks) - 1, "tier": _TIER.value,
                "backend": jax.default_backend(), "devices": len(jax.devices())},
  }
  if _JSON.value:
    print(json.dumps(report))
  else:
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
