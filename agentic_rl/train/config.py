"""The `config.train` section (the loop around rollout and learner, its SFT phase) and the
route overrides."""

from __future__ import annotations

import dataclasses

import ml_collections

from agentic_rl.config_schema import check, from_config_dict, to_config_dict
from agentic_rl.model import config as model_config_lib
from agentic_rl.rl.config import OptimConfig
from agentic_rl.train.fingerprint import FIELDS as FINGERPRINT_FIELDS


def _positive(field: str, value: int) -> None:
  check(value > 0, field, value, "a positive integer")


@dataclasses.dataclass(frozen=True)
class TrainSpec:
  """`config.train` as checked: every field the loop reads."""

  sft_steps: int = 0  # SFT warm-start steps on the scripted expert; 0 turns SFT off.
  sft_demos: int = 64  # Expert episodes recorded for SFT (train split).
  sft_batch_size: int = 8
  # SFT's own optimiser; decay_steps=0 spans the SFT phase (sft_steps).
  sft_optim: OptimConfig = OptimConfig(learning_rate=3e-3, warmup_steps=10, decay_steps=0)
  # Plateau stop: every sft_eval_every steps, score the expert's demonstrations of
  # sft_validation_demos train tasks outside the SFT set (token NLL); stop after
  # sft_patience scores without a new best by sft_min_delta, and keep the best params.
  # sft_eval_every = 0 runs all sft_steps.
  sft_eval_every: int = 0
  sft_validation_demos: int = 64
  sft_patience: int = 3
  sft_min_delta: float = 0.002
  # Share of SFT demonstrations (and validation ones) that are recovery plays: a wrong
  # first edit carrying no loss, its failing test, the correction (the env's
  # play_recovery). Set it from the base's measured share of failed first edits.
  sft_recovery_share: float = 0.0
  groups_per_step: int = 4  # Task groups per RL step (each of config.rollout.group_size).
  # RL learner batches pad to the smallest of these lengths that holds their longest
  # trajectory; each compiles before the RL clock starts. () = quarters of
  # config.rollout.max_len rounded up to 128 (train/learner_lengths.py).
  learner_lengths: tuple[int, ...] = ()
  eval_every: int = 10  # RL steps between held-out evaluations (and at the end).
  eval_tasks: int = 32  # Held-out tasks per evaluation.
  # 0 = greedy. Above 0 the held-out solve rate is the policy's pass@1 at this temperature,
  # averaged over eval_samples draws per task (the policy RL trains is the sampled one).
  eval_temperature: float = 0.0
  eval_samples: int = 1
  # A run's workdir, checkpoints/ folder, step folder or params.safetensors folder whose
  # params start this run. Read only when the workdir has no checkpoint of its own;
  # optimiser state, step and data order start fresh. "" = none.
  init_checkpoint: str = ""
  checkpoint_every: int = 5  # Steps between checkpoints (SFT and RL steps alike).
  keep_checkpoints: int = 3
  log_samples_every: int = 10  # Steps between sample trajectories written to TensorBoard.
  num_samples_logged: int = 2
  # Stage schedule: from this RL step on, apply config.route_a (throughput early,
  # consistency late). -1: never switch.
  switch_to_route_a_at: int = -1
  # Layout fields (train/fingerprint.py FIELDS) saved params may differ in when they load
  # (resume or init_checkpoint); any other difference is an error. () = none.
  allow_fingerprint_change: tuple[str, ...] = ()
  # Multi-process runs (see WORKSPACE.md): empty address + 1 process = single process.
  coordinator_address: str = ""
  num_processes: int = 1
  process_id: int = 0

  def __post_init__(self):
    check(self.sft_steps >= 0, "sft_steps", self.sft_steps, "an integer >= 0")
    check(self.switch_to_route_a_at >= -1, "switch_to_route_a_at", self.switch_to_route_a_at,
          "an integer >= -1 (-1 = never)")
    check(self.sft_eval_every >= 0, "sft_eval_every", self.sft_eval_every,
          "an integer >= 0 (0 = no plateau stop)")
    check(self.sft_min_delta >= 0, "sft_min_delta", self.sft_min_delta, "a number >= 0")
    check(0.0 <= self.sft_recovery_share <= 1.0, "sft_recovery_share",
          self.sft_recovery_share, "a number in [0, 1]")
    for name in ("sft_validation_demos", "sft_patience", "sft_demos", "sft_batch_size",
                 "groups_per_step", "eval_every", "eval_tasks", "eval_samples",
                 "checkpoint_every", "keep_checkpoints", "log_samples_every",
                 "num_samples_logged", "num_processes"):
      _positive(name, getattr(self, name))
    check(self.eval_temperature >= 0, "eval_temperature", self.eval_temperature,
          "a number >= 0 (0 = greedy)")
    check(self.eval_temperature > 0 or self.eval_samples == 1, "eval_samples",
          self.eval_samples, "1 with greedy evaluation (eval_temperature=0 draws the same "
          "episode every time)")
    check(self.groups_per_step % self.num_processes == 0, "groups_per_step",
          self.groups_per_step, f"a multiple of num_processes={self.num_processes} (each "
          "process rolls out its share)")
    check(0 <= self.process_id < self.num_processes, "process_id", self.process_id,
          f"0 <= id < num_processes={self.num_processes}")
    check(set(self.allow_fingerprint_change) <= set(FINGERPRINT_FIELDS),
          "allow_fingerprint_change", self.allow_fingerprint_change,
          f"a tuple of fields among {FINGERPRINT_FIELDS}")


def route_a_overrides() -> ml_collections.ConfigDict:
  """Route A, consistency first, as overrides any config takes (`config.route_a`): fp32
  compute, params and cache; MoE routing, block choices and sampling masks replayed; no
  importance correction; credit from a critic (value head, GAE). The layer pattern is
  not among them: route_a_config makes the run's own G layers dense, whatever the pattern."""
  o = ml_collections.ConfigDict()
  o.model = ml_collections.ConfigDict({"dtype": "float32", "param_dtype": "float32",
                                       "cache_dtype": "float32", "value_head": True})
  o.rl = ml_collections.ConfigDict()
  o.rl.advantage = ml_collections.ConfigDict({"estimator": "gae"})
  o.rl.correction = ml_collections.ConfigDict({"type": "none"})
  o.rl.replay = ml_collections.ConfigDict({"routing": True, "blocks": True,
                                           "sampling_mask": True})
  return o


def route_a_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` under route A, the one definition: configs/route_a_consistency.py and the
  stage switch (config.train.switch_to_route_a_at) both use it. Applies config.route_a
  (route_a_overrides() when the config has none) and makes every G layer dense F, unless
  config.route_a names a layer pattern itself."""
  overrides = config.route_a if "route_a" in config else route_a_overrides()
  out = apply_overrides(config, overrides)
  if "layer_pattern" not in overrides.get("model", {}):
    out.model.layer_pattern = model_config_lib.dense_pattern(config.model.layer_pattern)
  return out


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


def default_train_config() -> ml_collections.ConfigDict:
  return to_config_dict(TrainSpec())


def validate_train_config(train_config) -> TrainSpec:
  return from_config_dict(TrainSpec, train_config, "config.train")
