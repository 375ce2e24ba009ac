"""The learner's config section (`config.rl`): defaults, validation, frozen spec.

Every learner option lives here. `validate` turns a bad value into a
`ValueError` naming the field (`config.rl.<field>`), the value and what was
expected, and returns `RLSpec`, a hashable view safe as a jit static argument.

Route A (consistency first) and route B (throughput first) are both settings
of this one section, e.g.

  route A: advantage.estimator='gae' (model.value_head=True) or 'turn_level',
           replay.routing/blocks/sampling_mask=True, correction.type='none'.
  route B: advantage.estimator='grpo' | 'rloo' | 'dr_grpo', larger groups,
           correction.type='tis' | 'mis_token' | 'mis_sequence' | 'icepop'.
"""

from __future__ import annotations

import dataclasses

import ml_collections

ADVANTAGE_ESTIMATORS = ("grpo", "grpo_no_std", "dr_grpo", "rloo", "turn_level", "gae")
OBJECTIVES = ("ppo_clip", "gspo")
OLD_LOGP_SOURCES = ("learner", "sampler")
AGGREGATIONS = ("token", "sequence", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
CORRECTIONS = ("none", "tis", "mis_token", "mis_sequence", "icepop")
SEQUENCE_RATIOS = ("product", "geometric_mean")
PRIORITIES = ("uniform", "middling", "band")


def default_rl_config() -> ml_collections.ConfigDict:
  """Defaults: GRPO with clip-higher PPO, token-mean loss, full replay, no correction."""
  c = ml_collections.ConfigDict()
  # Passes over each rollout batch, each in `minibatches` shuffled optimiser updates. Above
  # one update per batch, the old policy is the behaviour policy (objective.old_logp_source)
  # scored before the first update, so the clip acts from the second update on.
  c.ppo_epochs = 1
  c.minibatches = 1

  a = c.advantage = ml_collections.ConfigDict()
  a.estimator = "grpo"
  a.eps = 1e-6  # Added to group std before dividing.
  a.gamma = 1.0  # GAE discount per generated token.
  a.gae_lambda = 0.95
  a.turn_gamma = 1.0  # turn_level: discount per turn of the process-signal return.
  a.turn_weight = 1.0  # turn_level: weight of the turn advantage next to the outcome one.
  a.turn_normalize_std = True  # turn_level: divide both parts by their group std.
  a.max_turns = 16  # Static bound on turn indices (turn_level and per-turn metrics).

  o = c.objective = ml_collections.ConfigDict()
  o.type = "ppo_clip"
  o.clip_low = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high] (DAPO clip-higher).
  o.clip_high = 0.28
  o.gspo_clip_low = 3e-4  # GSPO's sequence ratio is a geometric mean: far tighter bounds.
  o.gspo_clip_high = 4e-4
  # The denominator of the PPO ratio when the batch brings no old_logp_bt:
  # 'learner' = the learner's own log-probs before this update (on-policy, ratio 1 at
  # the first step; the mismatch is left to `correction`); 'sampler' = the sampler's
  # log-probs (the clip then also bounds the mismatch).
  o.old_logp_source = "learner"

  l = c.loss = ml_collections.ConfigDict()
  l.aggregation = "token"  # token: mean over all tokens; sequence: mean of per-sequence means;
  l.constant_normalizer = 0  # constant: sum / (num_sequences * this); 0 = padded length T.
  l.kl_coef = 0.0  # KL to the frozen reference policy; >0 needs ref params in the state.
  l.kl_estimator = "k3"
  l.entropy_coef = 0.0
  l.value_coef = 0.5  # gae only.
  l.value_clip = 0.0  # gae only; >0 clips the value around old_values_bt when given.

  k = c.correction = ml_collections.ConfigDict()
  k.type = "none"
  k.tis_cap = 2.0  # TIS: weight min(r, C).
  k.mis_low = 0.5  # MIS: keep (weight r) only where r lies in [mis_low, mis_high].
  k.mis_high = 2.0
  k.mis_sequence_ratio = "product"  # mis_sequence: product of token ratios, or geometric_mean.
  k.icepop_low = 0.5  # IcePop: [alpha, beta].
  k.icepop_high = 5.0

  r = c.replay = ml_collections.ConfigDict()
  r.routing = True  # Force the sampler's recorded experts (R3).
  r.blocks = True  # Force the sampler's recorded sparse-attention blocks.
  r.sampling_mask = True  # Keep Sampling Mask: apply the sampler's top-k/top-p mask.

  m = c.mismatch = ml_collections.ConfigDict()
  m.num_position_buckets = 8  # Equal-width buckets over [0, model.max_seq_len).
  m.ratio_low = 0.5  # Tokens whose p_learner/p_sampler lies outside count as outliers.
  m.ratio_high = 2.0

  p = c.optim = ml_collections.ConfigDict()
  p.learning_rate = 1e-6
  p.warmup_steps = 10
  p.decay_steps = 1000  # Total schedule length (warmup included); cosine after warmup.
  p.end_lr_ratio = 0.1  # Final lr = learning_rate * end_lr_ratio.
  p.weight_decay = 0.01  # Not applied to vectors (norm scales, biases, routing biases).
  p.b1 = 0.9
  p.b2 = 0.999
  p.eps = 1e-8
  p.clip_norm = 1.0  # Global-norm gradient clipping; 0 turns it off.
  p.num_micro_batches = 1  # Gradient accumulation; batch size must divide evenly.

  t = c.task_selection = ml_collections.ConfigDict()
  t.group_size = 8  # Samples per task.
  t.pass_threshold = 1.0  # A sample passes when its reward >= this.
  t.window = 64  # Pass-rate tracker: last N outcomes per task.
  t.prior_pass_rate = 0.5  # Belief for a task with no outcome yet...
  t.prior_weight = 1.0  # ...worth this many outcomes.
  t.priority = "middling"  # uniform | middling (weight p(1-p)) | band (inside [low, high]).
  t.band_low = 0.2
  t.band_high = 0.8
  t.priority_floor = 0.02  # Minimum weight, so no task starves.
  t.dynamic_sampling = True  # Drop groups whose rewards are all equal; refill.
  t.max_sampling_rounds = 4  # Refill rounds before giving up on filling the batch.
  t.heldout_fraction = 0.1
  t.heldout_seed = 0
  t.eval_samples_per_task = 4
  # TaskPool (the training loop's selector): a pool of tasks revisited until retired.
  t.pool_size = 64  # Tasks held; 0 = no pool: every pick is a fresh task from the stream.
  t.max_visits = 4  # A task retires after this many groups (or once all its outcomes agree).
  t.curriculum = ()  # Tier names, easiest first; () = off (the env's default tier only).
  t.curriculum_window = 64  # Promotion looks at the current tier's last N episodes...
  t.promote_pass_rate = 0.7  # ...and moves new tasks to the next tier once they pass this.
  # A task's prior is its family's pass rate (worth prior_weight outcomes), itself shrunk
  # toward prior_pass_rate as if the family had this many more outcomes.
  t.family_prior_weight = 4.0
  return c


@dataclasses.dataclass(frozen=True)
class RLSpec:
  """A hashable, validated view of `config.rl`."""

  ppo_epochs: int
  minibatches: int
  estimator: str
  adv_eps: float
  gamma: float
  gae_lambda: float
  turn_gamma: float
  turn_weight: float
  turn_normalize_std: bool
  max_turns: int

  objective: str
  clip_low: float
  clip_high: float
  gspo_clip_low: float
  gspo_clip_high: float
  old_logp_source: str

  aggregation: str
  constant_normalizer: int
  kl_coef: float
  kl_estimator: str
  entropy_coef: float
  value_coef: float
  value_clip: float

  correction: str
  tis_cap: float
  mis_low: float
  mis_high: float
  mis_sequence_ratio: str
  icepop_low: float
  icepop_high: float

  replay_routing: bool
  replay_blocks: bool
  replay_sampling_mask: bool

  num_position_buckets: int
  mismatch_ratio_low: float
  mismatch_ratio_high: float

  learning_rate: float
  warmup_steps: int
  decay_steps: int
  end_lr_ratio: float
  weight_decay: float
  b1: float
  b2: float
  adam_eps: float
  clip_norm: float
  num_micro_batches: int

  group_size: int
  pass_threshold: float
  window: int
  prior_pass_rate: float
  prior_weight: float
  priority: str
  band_low: float
  band_high: float
  priority_floor: float
  dynamic_sampling: bool
  max_sampling_rounds: int
  heldout_fraction: float
  heldout_seed: int
  eval_samples_per_task: int
  pool_size: int
  max_visits: int
  curriculum: tuple[str, ...]
  curriculum_window: int
  promote_pass_rate: float
  family_prior_weight: float

  @property
  def updates_per_step(self) -> int:
    """Optimiser updates per rollout batch."""
    return self.ppo_epochs * self.minibatches

  @property
  def uses_values(self) -> bool:
    return self.estimator == "gae"

  @property
  def clip_range(self) -> tuple[float, float]:
    """(low, high) clip widths of the active objective."""
    if self.objective == "gspo":
      return self.gspo_clip_low, self.gspo_clip_high
    return self.clip_low, self.clip_high

  def replace(self, **changes) -> "RLSpec":
    return dataclasses.replace(self, **changes)


def _require(ok: bool, field: str, value, expected: str):
  if not ok:
    raise ValueError(f"config.rl.{field}={value!r}: expected {expected}.")


def _number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _choice(section, name: str, field: str, choices):
  _require(section[name] in choices, field, section[name], f"one of {choices}")


def validate(rl_config: ml_collections.ConfigDict, model_config=None) -> RLSpec:
  """Checks `config.rl` (and, given `config.model`, what the two must agree on)."""
  c = rl_config
  a, o, l, k, r, m, p, t = (c.advantage, c.objective, c.loss, c.correction, c.replay,
                            c.mismatch, c.optim, c.task_selection)
  for name in ("ppo_epochs", "minibatches"):
    _require(_int(c[name]) and c[name] > 0, name, c[name], "a positive integer")
  _choice(a, "estimator", "advantage.estimator", ADVANTAGE_ESTIMATORS)
  _require(_number(a.eps) and a.eps > 0, "advantage.eps", a.eps, "a positive number")
  for name in ("gamma", "gae_lambda", "turn_gamma"):
    v = a[name]
    _require(_number(v) and 0.0 <= v <= 1.0, f"advantage.{name}", v, "a number in [0, 1]")
  _require(_number(a.turn_weight) and a.turn_weight >= 0, "advantage.turn_weight",
           a.turn_weight, "a number >= 0")
  _require(_int(a.max_turns) and a.max_turns > 0, "advantage.max_turns", a.max_turns,
           "a positive integer")

  _choice(o, "type", "objective.type", OBJECTIVES)
  for name in ("clip_low", "gspo_clip_low"):
    _require(_number(o[name]) and 0.0 <= o[name] < 1.0, f"objective.{name}", o[name],
             "a number in [0, 1) (the ratio's lower bound 1 - clip_low must stay positive)")
  for name in ("clip_high", "gspo_clip_high"):
    _require(_number(o[name]) and o[name] >= 0.0, f"objective.{name}", o[name], "a number >= 0")
  _choice(o, "old_logp_source", "objective.old_logp_source", OLD_LOGP_SOURCES)

  _choice(l, "aggregation", "loss.aggregation", AGGREGATIONS)
  _require(_int(l.constant_normalizer) and l.constant_normalizer >= 0,
           "loss.constant_normalizer", l.constant_normalizer,
           "an integer >= 0 (0 = the batch's padded length)")
  if a.estimator == "dr_grpo":
    _require(l.aggregation == "constant", "loss.aggregation", l.aggregation,
             "'constant' with advantage.estimator='dr_grpo' (Dr. GRPO removes both the "
             "std and the per-sequence length normalisation; use 'grpo_no_std' to keep "
             "another aggregation)")
  for name in ("kl_coef", "entropy_coef", "value_coef", "value_clip"):
    _require(_number(l[name]) and l[name] >= 0.0, f"loss.{name}", l[name], "a number >= 0")
  _choice(l, "kl_estimator", "loss.kl_estimator", KL_ESTIMATORS)

  _choice(k, "type", "correction.type", CORRECTIONS)
  _require(_number(k.tis_cap) and k.tis_cap > 0, "correction.tis_cap", k.tis_cap,
           "a positive number (TIS weight min(r, C))")
  _require(_number(k.mis_low) and k.mis_low >= 0, "correction.mis_low", k.mis_low,
           "a number >= 0")
  _require(_number(k.mis_high) and k.mis_high > k.mis_low, "correction.mis_high", k.mis_high,
           f"a number > correction.mis_low={k.mis_low}")
  _choice(k, "mis_sequence_ratio", "correction.mis_sequence_ratio", SEQUENCE_RATIOS)
  _require(_number(k.icepop_low) and k.icepop_low >= 0, "correction.icepop_low",
           k.icepop_low, "a number >= 0")
  _require(_number(k.icepop_high) and k.icepop_high > k.icepop_low, "correction.icepop_high",
           k.icepop_high, f"a number > correction.icepop_low={k.icepop_low}")

  for name in ("routing", "blocks", "sampling_mask"):
    _require(isinstance(r[name], bool), f"replay.{name}", r[name], "True or False")

  _require(_int(m.num_position_buckets) and m.num_position_buckets > 0,
           "mismatch.num_position_buckets", m.num_position_buckets, "a positive integer")
  _require(_number(m.ratio_low) and m.ratio_low > 0, "mismatch.ratio_low", m.ratio_low,
           "a positive number")
  _require(_number(m.ratio_high) and m.ratio_high > m.ratio_low, "mismatch.ratio_high",
           m.ratio_high, f"a number > mismatch.ratio_low={m.ratio_low}")

  _require(_number(p.learning_rate) and p.learning_rate > 0, "optim.learning_rate",
           p.learning_rate, "a positive number")
  _require(_int(p.warmup_steps) and p.warmup_steps >= 0, "optim.warmup_steps",
           p.warmup_steps, "an integer >= 0")
  _require(_int(p.decay_steps) and p.decay_steps > p.warmup_steps, "optim.decay_steps",
           p.decay_steps, f"an integer > optim.warmup_steps={p.warmup_steps}")
  _require(_number(p.end_lr_ratio) and 0.0 <= p.end_lr_ratio <= 1.0, "optim.end_lr_ratio",
           p.end_lr_ratio, "a number in [0, 1]")
  _require(_number(p.weight_decay) and p.weight_decay >= 0, "optim.weight_decay",
           p.weight_decay, "a number >= 0")
  for name in ("b1", "b2"):
    _require(_number(p[name]) and 0.0 <= p[name] < 1.0, f"optim.{name}", p[name],
             "a number in [0, 1)")
  _require(_number(p.eps) and p.eps > 0, "optim.eps", p.eps, "a positive number")
  _require(_number(p.clip_norm) and p.clip_norm >= 0, "optim.clip_norm", p.clip_norm,
           "a number >= 0 (0 = no clipping)")
  _require(_int(p.num_micro_batches) and p.num_micro_batches > 0, "optim.num_micro_batches",
           p.num_micro_batches, "a positive integer")

  _require(_int(t.group_size) and t.group_size > 0, "task_selection.group_size",
           t.group_size, "a positive integer")
  _require(_number(t.pass_threshold), "task_selection.pass_threshold", t.pass_threshold,
           "a number")
  _require(_int(t.window) and t.window > 0, "task_selection.window", t.window,
           "a positive integer")
  _require(_number(t.prior_pass_rate) and 0.0 <= t.prior_pass_rate <= 1.0,
           "task_selection.prior_pass_rate", t.prior_pass_rate, "a number in [0, 1]")
  _require(_number(t.prior_weight) and t.prior_weight >= 0, "task_selection.prior_weight",
           t.prior_weight, "a number >= 0")
  _choice(t, "priority", "task_selection.priority", PRIORITIES)
  _require(_number(t.band_low) and 0.0 <= t.band_low <= 1.0, "task_selection.band_low",
           t.band_low, "a number in [0, 1]")
  _require(_number(t.band_high) and t.band_low <= t.band_high <= 1.0,
           "task_selection.band_high", t.band_high,
           f"a number in [task_selection.band_low={t.band_low}, 1]")
  _require(_number(t.priority_floor) and t.priority_floor >= 0,
           "task_selection.priority_floor", t.priority_floor, "a number >= 0")
  _require(isinstance(t.dynamic_sampling, bool), "task_selection.dynamic_sampling",
           t.dynamic_sampling, "True or False")
  _require(_int(t.max_sampling_rounds) and t.max_sampling_rounds > 0,
           "task_selection.max_sampling_rounds", t.max_sampling_rounds, "a positive integer")
  _require(_number(t.heldout_fraction) and 0.0 <= t.heldout_fraction < 1.0,
           "task_selection.heldout_fraction", t.heldout_fraction, "a number in [0, 1)")
  _require(_int(t.heldout_seed), "task_selection.heldout_seed", t.heldout_seed, "an integer")
  _require(_int(t.eval_samples_per_task) and t.eval_samples_per_task > 0,
           "task_selection.eval_samples_per_task", t.eval_samples_per_task,
           "a positive integer")
  _require(_int(t.pool_size) and t.pool_size >= 0, "task_selection.pool_size", t.pool_size,
           "an integer >= 0 (0 = no pool)")
  _require(_int(t.max_visits) and t.max_visits > 0, "task_selection.max_visits",
           t.max_visits, "a positive integer")
  curriculum = t.curriculum
  _require(isinstance(curriculum, (tuple, list))
           and all(isinstance(tier, str) and tier for tier in curriculum)
           and len(set(curriculum)) == len(curriculum), "task_selection.curriculum",
           curriculum, "a tuple of distinct, non-empty tier names (() = no curriculum)")
  _require(_int(t.curriculum_window) and t.curriculum_window > 0,
           "task_selection.curriculum_window", t.curriculum_window, "a positive integer")
  _require(_number(t.promote_pass_rate) and 0.0 <= t.promote_pass_rate <= 1.0,
           "task_selection.promote_pass_rate", t.promote_pass_rate, "a number in [0, 1]")
  _require(_number(t.family_prior_weight) and t.family_prior_weight >= 0,
           "task_selection.family_prior_weight", t.family_prior_weight, "a number >= 0")

  if model_config is not None:
    if a.estimator == "gae" and not model_config.get("value_head", False):
      raise ValueError("config.rl.advantage.estimator='gae' needs a critic: set "
                       "config.model.value_head=True.")

  return RLSpec(
      ppo_epochs=c.ppo_epochs, minibatches=c.minibatches,
      estimator=a.estimator, adv_eps=float(a.eps), gamma=float(a.gamma),
      gae_lambda=float(a.gae_lambda), turn_gamma=float(a.turn_gamma),
      turn_weight=float(a.turn_weight), turn_normalize_std=bool(a.turn_normalize_std),
      max_turns=a.max_turns,
      objective=o.type, clip_low=float(o.clip_low), clip_high=float(o.clip_high),
      gspo_clip_low=float(o.gspo_clip_low), gspo_clip_high=float(o.gspo_clip_high),
      old_logp_source=o.old_logp_source,
      aggregation=l.aggregation, constant_normalizer=l.constant_normalizer,
      kl_coef=float(l.kl_coef), kl_estimator=l.kl_estimator,
      entropy_coef=float(l.entropy_coef), value_coef=float(l.value_coef),
      value_clip=float(l.value_clip),
      correction=k.type, tis_cap=float(k.tis_cap), mis_low=float(k.mis_low),
      mis_high=float(k.mis_high), mis_sequence_ratio=k.mis_sequence_ratio,
      icepop_low=float(k.icepop_low), icepop_high=float(k.icepop_high),
      replay_routing=r.routing, replay_blocks=r.blocks, replay_sampling_mask=r.sampling_mask,
      num_position_buckets=m.num_position_buckets, mismatch_ratio_low=float(m.ratio_low),
      mismatch_ratio_high=float(m.ratio_high),
      learning_rate=float(p.learning_rate), warmup_steps=p.warmup_steps,
      decay_steps=p.decay_steps, end_lr_ratio=float(p.end_lr_ratio),
      weight_decay=float(p.weight_decay), b1=float(p.b1), b2=float(p.b2),
      adam_eps=float(p.eps), clip_norm=float(p.clip_norm),
      num_micro_batches=p.num_micro_batches,
      group_size=t.group_size, pass_threshold=float(t.pass_threshold), window=t.window,
      prior_pass_rate=float(t.prior_pass_rate), prior_weight=float(t.prior_weight),
      priority=t.priority, band_low=float(t.band_low), band_high=float(t.band_high),
      priority_floor=float(t.priority_floor), dynamic_sampling=t.dynamic_sampling,
      max_sampling_rounds=t.max_sampling_rounds, heldout_fraction=float(t.heldout_fraction),
      heldout_seed=t.heldout_seed, eval_samples_per_task=t.eval_samples_per_task,
      pool_size=t.pool_size, max_visits=t.max_visits, curriculum=tuple(curriculum),
      curriculum_window=t.curriculum_window, promote_pass_rate=float(t.promote_pass_rate),
      family_prior_weight=float(t.family_prior_weight))
