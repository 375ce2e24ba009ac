"""The `config.train` section (the loop around rollout and learner) and route overrides."""

from __future__ import annotations

import ml_collections


def default_train_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.sft_steps = 0  # SFT warm-start steps on the scripted expert; 0 turns SFT off.
  c.sft_demos = 64  # Expert episodes recorded for SFT (train split).
  c.sft_batch_size = 8
  c.sft_learning_rate = 3e-3
  # Plateau stop: every sft_eval_every steps, score the expert's demonstrations of
  # sft_validation_demos train tasks outside the SFT set (token NLL); stop after
  # sft_patience scores without a new best by sft_min_delta, and keep the best params.
  # sft_eval_every = 0 runs all sft_steps.
  c.sft_eval_every = 0
  c.sft_validation_demos = 64
  c.sft_patience = 3
  c.sft_min_delta = 0.002
  c.groups_per_step = 4  # Task groups per RL step (each of config.rollout.group_size samples).
  c.eval_every = 10  # RL steps between held-out evaluations (and at the end).
  c.eval_tasks = 32  # Held-out tasks per evaluation.
  # 0 = greedy. Above 0 the held-out solve rate is the policy's pass@1 at this temperature,
  # averaged over eval_samples draws per task (the policy RL trains is the sampled one).
  c.eval_temperature = 0.0
  c.eval_samples = 1
  # A run's workdir, checkpoints/ folder or step folder whose params start this run (e.g.
  # an SFT run's checkpoint for an RL-only run). Read only when the workdir has no
  # checkpoint of its own; optimiser state, step and data order start fresh. "" = none.
  c.init_checkpoint = ""
  c.checkpoint_every = 5  # Steps between checkpoints (SFT and RL steps alike).
  c.keep_checkpoints = 3
  c.log_samples_every = 10  # Steps between sample trajectories written to TensorBoard.
  c.num_samples_logged = 2
  # Stage schedule: from this RL step on, apply config.route_a (throughput early,
  # consistency late). -1: never switch.
  c.switch_to_route_a_at = -1
  # Multi-process runs (see WORKSPACE.md): empty address + 1 process = single process.
  c.coordinator_address = ""
  c.num_processes = 1
  c.process_id = 0
  return c


def route_a_overrides() -> ml_collections.ConfigDict:
  """Route A, consistency first: dense full attention, fp32 cache, full replay, no IS hack."""
  o = ml_collections.ConfigDict()
  o.model = ml_collections.ConfigDict()
  o.model.layer_pattern = "SSSF"  # Sparse G layers become dense F; same parameters.
  o.model.cache_dtype = "float32"
  o.model.dtype = "float32"
  o.rl = ml_collections.ConfigDict()
  o.rl.correction = ml_collections.ConfigDict({"type": "none"})
  o.rl.replay = ml_collections.ConfigDict({"routing": True, "blocks": True,
                                           "sampling_mask": True})
  return o


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `config` with every leaf of `overrides` set (nested sections merge)."""
  out = ml_collections.ConfigDict(config.to_dict())

  def merge(dst, src, prefix):
    for key, value in src.items():
      if isinstance(value, ml_collections.ConfigDict):
        if key not in dst:
          raise ValueError(f"override {prefix}{key}: the config has no section {prefix}{key}.")
        merge(dst[key], value, f"{prefix}{key}.")
      else:
        if key not in dst:
          raise ValueError(f"override {prefix}{key}: the config has no field {prefix}{key}.")
        dst[key] = value

  merge(out, overrides, "")
  return out


def validate_train_config(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  known = set(default_train_config().keys())
  unknown = sorted(set(c.keys()) - known)
  if unknown:
    raise ValueError(f"config.train has unknown fields {unknown}; expected {sorted(known)}.")
  for field in ("sft_steps", "switch_to_route_a_at"):
    if not isinstance(c[field], int) or c[field] < (0 if field == "sft_steps" else -1):
      raise ValueError(f"config.train.{field}={c[field]!r}: expected an integer "
                       f"{'>= 0' if field == 'sft_steps' else '>= -1'}.")
  for field in ("sft_eval_every",):
    if not isinstance(c[field], int) or c[field] < 0:
      raise ValueError(f"config.train.{field}={c[field]!r}: expected an integer >= 0 "
                       f"(0 = no plateau stop).")
  if (isinstance(c.sft_min_delta, bool) or not isinstance(c.sft_min_delta, (int, float))
      or c.sft_min_delta < 0):
    raise ValueError(f"config.train.sft_min_delta={c.sft_min_delta!r}: expected a number "
                     f">= 0.")
  for field in ("sft_validation_demos", "sft_patience", "sft_demos", "sft_batch_size", "groups_per_step",
                "eval_every", "eval_tasks", "eval_samples", "checkpoint_every", "keep_checkpoints",
                "log_samples_every", "num_processes"):
    if not isinstance(c[field], int) or c[field] <= 0:
      raise ValueError(f"config.train.{field}={c[field]!r}: expected a positive integer.")
  if (isinstance(c.eval_temperature, bool) or not isinstance(c.eval_temperature, (int, float))
      or c.eval_temperature < 0):
    raise ValueError(f"config.train.eval_temperature={c.eval_temperature!r}: expected a "
                     f"number >= 0 (0 = greedy).")
  if not isinstance(c.init_checkpoint, str):
    raise ValueError(f"config.train.init_checkpoint={c.init_checkpoint!r}: expected a path "
                     f"string ('' = start from freshly initialised params).")
  if c.eval_temperature == 0 and c.eval_samples != 1:
    raise ValueError(f"config.train.eval_samples={c.eval_samples}: greedy evaluation "
                     f"(eval_temperature=0) draws the same episode every time; use 1.")
  if c.groups_per_step % c.num_processes:
    raise ValueError(f"config.train.groups_per_step={c.groups_per_step} must be divisible by "
                     f"num_processes={c.num_processes}: each process rolls out its share.")
  if not 0 <= c.process_id < c.num_processes:
    raise ValueError(f"config.train.process_id={c.process_id}: expected 0 <= id < "
                     f"num_processes={c.num_processes}.")
  return c
