"""The learner's config section (`config.rl`): one frozen dataclass per subsection.

Each dataclass holds its defaults and checks (agentic_rl/config_schema.py); the ConfigDict
that config files edit is generated from them (`default_rl_config`), and `validate` builds
`RLSpec` back by field name, so a bad value is a `ValueError` naming `config.rl.<field>`.
The spec is hashable: safe as a jit static argument.

Route A (consistency first) and route B (throughput first) are both settings of this
section, e.g.

  route A: advantage.estimator='gae' (model.value_head=True) or 'turn_level',
           replay.routing/blocks/sampling_mask=True, correction.type='none'.
  route B: advantage.estimator='grpo' | 'rloo' | 'dr_grpo', larger groups,
           correction.type='tis' | 'mis_token' | 'mis_sequence' | 'icepop'.

Knobs other sections own are not repeated here: the group size is `config.rollout.group_size`
and the turn bound is `config.rollout.max_turns` (`RLSpec.group_size`, `RLSpec.max_turns`).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from agentic_rl.config_schema import check, derived, from_config_dict, one_of, to_config_dict

ADVANTAGE_ESTIMATORS = ("grpo", "grpo_no_std", "dr_grpo", "rloo", "turn_level", "gae")
OBJECTIVES = ("ppo_clip", "gspo")
OLD_LOGP_SOURCES = ("learner", "sampler")
AGGREGATIONS = ("token", "sequence", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
CORRECTIONS = ("none", "tis", "mis_token", "mis_sequence", "icepop")
SEQUENCE_RATIOS = ("product", "geometric_mean")
PRIORITIES = ("uniform", "middling", "band")


def _unit(field: str, value: float) -> None:
  check(0.0 <= value <= 1.0, field, value, "a number in [0, 1]")


def _nonnegative(field: str, value: float) -> None:
  check(value >= 0.0, field, value, "a number >= 0")


def _positive_int(field: str, value: int) -> None:
  check(value > 0, field, value, "a positive integer")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  estimator: str = "grpo"
  eps: float = 1e-6  # Added to group std before dividing.
  gamma: float = 1.0  # GAE discount per generated token.
  gae_lambda: float = 0.95
  turn_gamma: float = 1.0  # turn_level: discount per turn of the process-signal return.
  turn_weight: float = 1.0  # turn_level: weight of the turn advantage next to the outcome one.
  turn_normalize_std: bool = True  # turn_level: divide both parts by their group std.

  def __post_init__(self):
    one_of(self.estimator, "estimator", ADVANTAGE_ESTIMATORS)
    check(self.eps > 0, "eps", self.eps, "a positive number")
    for name in ("gamma", "gae_lambda", "turn_gamma"):
      _unit(name, getattr(self, name))
    _nonnegative("turn_weight", self.turn_weight)


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
  type: str = "ppo_clip"
  clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO clip-higher).
  clip_high: float = 0.28
  gspo_clip_low: float = 3e-4  # GSPO's sequence ratio is a geometric mean: far tighter bounds.
  gspo_clip_high: float = 4e-4
  # The denominator of the PPO ratio when the batch brings no old_logp_bt: 'learner' = the
  # learner's own log-probs before this update (on-policy, ratio 1 at the first step; the
  # mismatch is left to `correction`); 'sampler' = the sampler's log-probs (the clip then
  # also bounds the mismatch).
  old_logp_source: str = "learner"

  def __post_init__(self):
    one_of(self.type, "type", OBJECTIVES)
    for name in ("clip_low", "gspo_clip_low"):
      v = getattr(self, name)
      check(0.0 <= v < 1.0, name, v,
            "a number in [0, 1) (the ratio's lower bound 1 - clip_low must stay positive)")
    for name in ("clip_high", "gspo_clip_high"):
      _nonnegative(name, getattr(self, name))
    one_of(self.old_logp_source, "old_logp_source", OLD_LOGP_SOURCES)

  @property
  def clip_range(self) -> tuple[float, float]:
    """(low, high) clip widths of this objective."""
    if self.type == "gspo":
      return self.gspo_clip_low, self.gspo_clip_high
    return self.clip_low, self.clip_high


@dataclasses.dataclass(frozen=True)
class LossConfig:
  # token: mean over all tokens; sequence: mean of per-sequence means; constant: sum /
  # (num_sequences * constant_normalizer), 0 = the padded length T.
  aggregation: str = "token"
  constant_normalizer: int = 0
  kl_coef: float = 0.0  # KL to the frozen reference policy; >0 keeps ref params in the state.
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0
  value_coef: float = 0.5  # gae only.
  value_clip: float = 0.0  # gae only; >0 clips the value around old_values_bt when given.
  # Add the model's MoE load-balancing loss (config.model.moe) to the RL loss. Off: RL
  # replays the sampler's routing, and the reward, not balance, should move the router.
  # Its value is logged (moe_aux_loss) either way.
  moe_aux_loss: bool = False

  def __post_init__(self):
    one_of(self.aggregation, "aggregation", AGGREGATIONS)
    check(self.constant_normalizer >= 0, "constant_normalizer", self.constant_normalizer,
          "an integer >= 0 (0 = the batch's padded length)")
    for name in ("kl_coef", "entropy_coef", "value_coef", "value_clip"):
      _nonnegative(name, getattr(self, name))
    one_of(self.kl_estimator, "kl_estimator", KL_ESTIMATORS)


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
  type: str = "none"
  tis_cap: float = 2.0  # TIS: weight min(r, C).
  mis_low: float = 0.5  # MIS: keep (weight r) only where r lies in [mis_low, mis_high].
  mis_high: float = 2.0
  # mis_sequence: the sequence's ratio. A product of T token ratios drifts like exp(T * mean
  # log-ratio): at a 4e-3 mean |log r| a 500-token turn leaves [0.5, 2] and is rejected
  # almost always. The geometric mean is the per-token ratio, comparable across lengths.
  mis_sequence_ratio: str = "geometric_mean"
  icepop_low: float = 0.5  # IcePop: [alpha, beta].
  icepop_high: float = 5.0

  def __post_init__(self):
    one_of(self.type, "type", CORRECTIONS)
    check(self.tis_cap > 0, "tis_cap", self.tis_cap, "a positive number (TIS weight min(r, C))")
    _nonnegative("mis_low", self.mis_low)
    check(self.mis_high > self.mis_low, "mis_high", self.mis_high,
          f"a number > correction.mis_low={self.mis_low}")
    one_of(self.mis_sequence_ratio, "mis_sequence_ratio", SEQUENCE_RATIOS)
    _nonnegative("icepop_low", self.icepop_low)
    check(self.icepop_high > self.icepop_low, "icepop_high", self.icepop_high,
          f"a number > correction.icepop_low={self.icepop_low}")


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  routing: bool = True  # Force the sampler's recorded experts (R3).
  blocks: bool = True  # Force the sampler's recorded sparse-attention blocks.
  sampling_mask: bool = True  # Keep Sampling Mask: apply the sampler's top-k/top-p mask.


@dataclasses.dataclass(frozen=True)
class MismatchConfig:
  num_position_buckets: int = 8  # Equal-width buckets over [0, model.max_seq_len).
  ratio_low: float = 0.5  # Tokens whose p_learner/p_sampler lies outside count as outliers.
  ratio_high: float = 2.0

  def __post_init__(self):
    _positive_int("num_position_buckets", self.num_position_buckets)
    check(self.ratio_low > 0, "ratio_low", self.ratio_low, "a positive number")
    check(self.ratio_high > self.ratio_low, "ratio_high", self.ratio_high,
          f"a number > mismatch.ratio_low={self.ratio_low}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with warmup then cosine decay: the RL phase's and (config.train.sft_optim) SFT's."""

  learning_rate: float = 1e-6
  warmup_steps: int = 10
  # Total schedule length (warmup included), cosine after warmup; 0 = the phase's length
  # (config.rl.num_steps for RL, config.train.sft_steps for SFT).
  decay_steps: int = 1000
  end_lr_ratio: float = 0.1  # Final lr = learning_rate * end_lr_ratio.
  weight_decay: float = 0.01  # Not applied to vectors (norm scales, biases, routing biases).
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  clip_norm: float = 1.0  # Global-norm gradient clipping; 0 turns it off.
  num_micro_batches: int = 1  # Gradient accumulation; batch size must divide evenly.

  def __post_init__(self):
    check(self.learning_rate > 0, "learning_rate", self.learning_rate, "a positive number")
    check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
    check(self.decay_steps == 0 or self.decay_steps > self.warmup_steps, "decay_steps",
          self.decay_steps, f"0 (the phase's length) or an integer > warmup_steps="
          f"{self.warmup_steps}")
    _unit("end_lr_ratio", self.end_lr_ratio)
    _nonnegative("weight_decay", self.weight_decay)
    for name in ("b1", "b2"):
      v = getattr(self, name)
      check(0.0 <= v < 1.0, name, v, "a number in [0, 1)")
    check(self.eps > 0, "eps", self.eps, "a positive number")
    check(self.clip_norm >= 0, "clip_norm", self.clip_norm, "a number >= 0 (0 = no clipping)")
    _positive_int("num_micro_batches", self.num_micro_batches)

  def schedule_steps(self, phase_steps: int) -> int:
    """The schedule's length for a phase of `phase_steps` optimiser steps."""
    return self.decay_steps or max(int(phase_steps), self.warmup_steps + 1)


@dataclasses.dataclass(frozen=True)
class TaskSelectionConfig:
  """The training loop's TaskPool: a pool of tasks revisited until retired, by priority."""

  window: int = 64  # Pass-rate tracker: last N outcomes per task.
  prior_pass_rate: float = 0.5  # Belief for a task with no outcome yet...
  prior_weight: float = 1.0  # ...worth this many outcomes.
  priority: str = "middling"  # uniform | middling (weight p(1-p)) | band (inside [low, high]).
  band_low: float = 0.2
  band_high: float = 0.8
  priority_floor: float = 0.02  # Minimum weight, so no task starves.
  dynamic_sampling: bool = True  # Drop groups whose rewards are all equal; refill.
  max_sampling_rounds: int = 4  # Refill rounds before giving up on filling the batch.
  # Informative groups beyond a step's batch open the next step's batch (at most groups - 1,
  # so every step samples; dropped at a checkpoint, so a resumed run matches). Off: on the
  # quickstart it sampled 30% fewer episodes but gained less on every seed (paired -3.7,
  # -2.3, -7.8 points against the same seeds without it, launch.compare_runs).
  carry_informative: bool = False
  pool_size: int = 64  # Tasks held; 0 = no pool: every pick is a fresh task from the stream.
  max_visits: int = 4  # A task retires after this many groups (or once all its outcomes agree).
  curriculum: tuple[str, ...] = ()  # Tier names, easiest first; () = off (the default tier).
  curriculum_window: int = 64  # Promotion looks at the current tier's last N episodes...
  promote_pass_rate: float = 0.7  # ...and moves new tasks to the next tier at this rate.
  # A task's prior is its family's pass rate (worth prior_weight outcomes), itself shrunk
  # toward prior_pass_rate as if the family had this many more outcomes.
  family_prior_weight: float = 4.0

  def __post_init__(self):
    _positive_int("window", self.window)
    _unit("prior_pass_rate", self.prior_pass_rate)
    _nonnegative("prior_weight", self.prior_weight)
    one_of(self.priority, "priority", PRIORITIES)
    _unit("band_low", self.band_low)
    check(self.band_low <= self.band_high <= 1.0, "band_high", self.band_high,
          f"a number in [task_selection.band_low={self.band_low}, 1]")
    _nonnegative("priority_floor", self.priority_floor)
    _positive_int("max_sampling_rounds", self.max_sampling_rounds)
    check(self.pool_size >= 0, "pool_size", self.pool_size, "an integer >= 0 (0 = no pool)")
    _positive_int("max_visits", self.max_visits)
    check(all(tier for tier in self.curriculum) and
          len(set(self.curriculum)) == len(self.curriculum), "curriculum", self.curriculum,
          "a tuple of distinct, non-empty tier names (() = no curriculum)")
    _positive_int("curriculum_window", self.curriculum_window)
    _unit("promote_pass_rate", self.promote_pass_rate)
    _nonnegative("family_prior_weight", self.family_prior_weight)


@dataclasses.dataclass(frozen=True)
class RLSpec:
  """`config.rl`, joined with the knobs it reads from other sections: the learner's view."""

  num_steps: int = 0  # RL steps (a rollout batch and its updates each); 0 = no RL phase.
  # Passes over each rollout batch, each in `minibatches` shuffled optimiser updates. Above
  # one update per batch, the old policy is the behaviour policy (objective.old_logp_source)
  # scored before the first update, so the clip acts from the second update on.
  ppo_epochs: int = 1
  minibatches: int = 1
  advantage: AdvantageConfig = AdvantageConfig()
  objective: ObjectiveConfig = ObjectiveConfig()
  loss: LossConfig = LossConfig()
  correction: CorrectionConfig = CorrectionConfig()
  replay: ReplayConfig = ReplayConfig()
  mismatch: MismatchConfig = MismatchConfig()
  optim: OptimConfig = OptimConfig()
  task_selection: TaskSelectionConfig = TaskSelectionConfig()
  group_size: int = derived(1, "config.rollout.group_size")  # Samples per task.
  max_turns: int = derived(8, "config.rollout.max_turns")  # Bound on turn indices.
  value_head: bool = derived(False, "config.model.value_head")  # GAE needs the critic.
  # Whether the sampler truncates its distribution (top-k below the vocabulary, top-p
  # below 1). When not, every recorded mask is all True and the learner skips replaying it.
  sampling_truncated: bool = derived(True, "config.rollout.top_k and top_p")

  def __post_init__(self):
    check(self.num_steps >= 0, "num_steps", self.num_steps, "an integer >= 0")
    _positive_int("ppo_epochs", self.ppo_epochs)
    _positive_int("minibatches", self.minibatches)
    _positive_int("group_size", self.group_size)
    _positive_int("max_turns", self.max_turns)
    if self.advantage.estimator == "dr_grpo":
      check(self.loss.aggregation == "constant", "loss.aggregation", self.loss.aggregation,
            "'constant' with advantage.estimator='dr_grpo' (Dr. GRPO removes both the std "
            "and the per-sequence length normalisation; use 'grpo_no_std' to keep another "
            "aggregation)")
    if self.advantage.estimator == "gae":
      check(self.value_head, "advantage.estimator", self.advantage.estimator,
            "a critic with 'gae': set config.model.value_head=True")

  @property
  def updates_per_step(self) -> int:
    """Optimiser updates per rollout batch."""
    return self.ppo_epochs * self.minibatches

  @property
  def uses_values(self) -> bool:
    return self.advantage.estimator == "gae"

  @property
  def clip_range(self) -> tuple[float, float]:
    return self.objective.clip_range

  def replace(self, **changes) -> "RLSpec":
    return dataclasses.replace(self, **changes)


def default_rl_config() -> ml_collections.ConfigDict:
  """The defaults, as the ConfigDict config files edit."""
  return to_config_dict(RLSpec())


def validate(rl_config, model_config=None, rollout_config=None) -> RLSpec:
  """`config.rl` checked and joined with what it reads from `config.model` (value_head) and
  `config.rollout` (group_size, max_turns). Each may be a ConfigDict or a built spec;
  without one, that section's defaults apply."""
  joined = {}
  if model_config is not None:
    joined["value_head"] = bool(_get(model_config, "value_head"))
  if rollout_config is not None:
    joined["group_size"] = _get(rollout_config, "group_size")
    joined["max_turns"] = _get(rollout_config, "max_turns")
    sampling = [_get(rollout_config, k, None) for k in ("top_k", "top_p", "temperature")]
    if None not in sampling:  # Else unknown: the mask is replayed.
      top_k, top_p, temperature = sampling
      vocab = _get(model_config, "vocab_size", None) if model_config is not None else None
      joined["sampling_truncated"] = bool(
          temperature == 0  # Greedy records the argmax as its mask.
          or top_p < 1.0 or (top_k > 0 and (vocab is None or top_k < vocab)))
  return from_config_dict(RLSpec, rl_config, "config.rl", **joined)


_REQUIRED = object()


def _get(section, name: str, default=_REQUIRED):
  if isinstance(section, (ml_collections.ConfigDict, dict)):
    return section[name] if default is _REQUIRED else section.get(name, default)
  return getattr(section, name) if default is _REQUIRED else getattr(section, name, default)
