"""config.rl: defaults validate, every option is reachable, bad values name their field."""

import pytest

from agentic_rl.model import config as model_config_lib
from agentic_rl.rl import config as rl_config_lib


def test_defaults_validate():
  spec = rl_config_lib.validate(rl_config_lib.default_rl_config())
  assert spec.advantage.estimator == "grpo" and spec.objective.type == "ppo_clip"
  assert spec.clip_range == (0.2, 0.28)
  assert spec.correction.tis_cap == 2.0
  assert (spec.correction.icepop_low, spec.correction.icepop_high) == (0.5, 5.0)
  hash(spec)  # usable as a jit static argument


@pytest.mark.parametrize("field,choices", [
    ("advantage.estimator", rl_config_lib.ADVANTAGE_ESTIMATORS),
    ("objective.type", rl_config_lib.OBJECTIVES),
    ("objective.old_logp_source", rl_config_lib.OLD_LOGP_SOURCES),
    ("loss.aggregation", rl_config_lib.AGGREGATIONS),
    ("loss.kl_estimator", rl_config_lib.KL_ESTIMATORS),
    ("correction.type", rl_config_lib.CORRECTIONS),
    ("correction.mis_sequence_ratio", rl_config_lib.SEQUENCE_RATIOS),
    ("task_selection.priority", rl_config_lib.PRIORITIES),
])
def test_every_choice_is_reachable(field, choices):
  section, name = field.split(".")
  for choice in choices:
    c = rl_config_lib.default_rl_config()
    c[section][name] = choice
    if choice == "dr_grpo":
      c.loss.aggregation = "constant"
    model = model_config_lib.default_model_config()
    model.value_head = True
    rl_config_lib.validate(c, model)


@pytest.mark.parametrize("field,value", [
    ("advantage.estimator", "ppo"),
    ("advantage.gamma", 1.5),
    ("objective.type", "trpo"),
    ("objective.clip_low", 1.0),
    ("objective.clip_high", -0.1),
    ("loss.aggregation", "mean"),
    ("loss.kl_coef", -1.0),
    ("loss.kl_estimator", "k4"),
    ("correction.type", "clip"),
    ("correction.tis_cap", 0.0),
    ("correction.mis_high", 0.1),
    ("correction.icepop_high", 0.4),
    ("mismatch.num_position_buckets", 0),
    ("optim.learning_rate", 0.0),
    ("optim.decay_steps", 5),
    ("optim.num_micro_batches", 0),
    ("optim.b2", 1.0),
    ("task_selection.priority", "hardest"),
    ("task_selection.band_high", 0.1),
    ("correction.mis_sequence_ratio", "median"),
])
def test_bad_value_names_the_field(field, value):
  c = rl_config_lib.default_rl_config()
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(ValueError, match=f"config.rl.{field}="):
    rl_config_lib.validate(c)


def test_dr_grpo_requires_constant_aggregation():
  c = rl_config_lib.default_rl_config()
  c.advantage.estimator = "dr_grpo"
  with pytest.raises(ValueError, match="config.rl.loss.aggregation='token'"):
    rl_config_lib.validate(c)
  c.loss.aggregation = "constant"
  assert rl_config_lib.validate(c).advantage.estimator == "dr_grpo"


def test_gae_requires_value_head():
  c = rl_config_lib.default_rl_config()
  c.advantage.estimator = "gae"
  model = model_config_lib.default_model_config()
  with pytest.raises(ValueError, match="config.model.value_head=True"):
    rl_config_lib.validate(c, model)
  model.value_head = True
  assert rl_config_lib.validate(c, model).uses_values


def test_gspo_uses_its_own_clip_range():
  c = rl_config_lib.default_rl_config()
  c.objective.type = "gspo"
  assert rl_config_lib.validate(c).clip_range == (3e-4, 4e-4)


def test_knobs_other_sections_own_are_joined_not_repeated():
  import ml_collections
  rollout = ml_collections.ConfigDict({"group_size": 6, "max_turns": 5})
  spec = rl_config_lib.validate(rl_config_lib.default_rl_config(), None, rollout)
  assert (spec.group_size, spec.max_turns) == (6, 5)
  for section, field in (("task_selection", "group_size"), ("advantage", "max_turns")):
    c = rl_config_lib.default_rl_config().to_dict()
    c[section][field] = 3
    with pytest.raises(ValueError, match=f"config.rl.{section} has unknown field {field}"):
      rl_config_lib.validate(c)
  c = rl_config_lib.default_rl_config().to_dict()
  c["group_size"] = 3
  with pytest.raises(ValueError, match="config.rl.group_size is set from "
                                       "config.rollout.group_size"):
    rl_config_lib.validate(c)
  with pytest.raises(ValueError, match=r"^config.rollout.max_turns=0: expected a positive"):
    rl_config_lib.validate(rl_config_lib.default_rl_config(), None,
                           {"group_size": 2, "max_turns": 0})


@pytest.mark.parametrize("dead", ["heldout_fraction", "heldout_seed", "eval_samples_per_task",
                                  "pass_threshold"])
def test_dead_knobs_are_gone(dead):
  c = rl_config_lib.default_rl_config().to_dict()
  c["task_selection"][dead] = 0
  with pytest.raises(ValueError, match=f"unknown field {dead}; valid fields: "):
    rl_config_lib.validate(c)


def test_num_steps_is_declared_and_checked():
  c = rl_config_lib.default_rl_config()
  assert c.num_steps == 0
  c.num_steps = -1
  with pytest.raises(ValueError, match="config.rl.num_steps=-1"):
    rl_config_lib.validate(c)


def test_mis_sequence_defaults_to_the_geometric_mean():
  """A product of token ratios leaves [mis_low, mis_high] on long sequences even when every
  token's ratio is close to 1; the geometric mean (the default) keeps them."""
  import jax.numpy as jnp
  import numpy as np
  from agentic_rl.rl import corrections

  spec = rl_config_lib.validate(rl_config_lib.default_rl_config())
  assert spec.correction.mis_sequence_ratio == "geometric_mean"
  log_ratio_bt = jnp.full((1, 500), 4e-3, jnp.float32)  # Each token's ratio: e^0.004.
  mask_bt = jnp.ones((1, 500), jnp.float32)
  c = spec.correction
  _, rejected_geo, _ = corrections.masked_sequence_weights(log_ratio_bt, mask_bt, c.mis_low,
                                                           c.mis_high, "geometric_mean")
  _, rejected_prod, _ = corrections.masked_sequence_weights(log_ratio_bt, mask_bt, c.mis_low,
                                                            c.mis_high, "product")
  # By hand: the product is e^2 = 7.39 > 2 (rejected); the geometric mean e^0.004 is kept.
  assert not bool(np.asarray(rejected_geo).any()) and bool(np.asarray(rejected_prod).all())
