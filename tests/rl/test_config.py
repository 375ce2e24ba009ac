"""config.rl: defaults validate, every option is reachable, bad values name their field."""

import pytest

from agentic_rl.model import config as model_config_lib
from agentic_rl.rl import config as rl_config_lib


def test_defaults_validate():
  spec = rl_config_lib.validate(rl_config_lib.default_rl_config())
  assert spec.estimator == "grpo" and spec.objective == "ppo_clip"
  assert spec.clip_range == (0.2, 0.28)
  assert spec.tis_cap == 2.0
  assert (spec.icepop_low, spec.icepop_high) == (0.5, 5.0)
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
    ("advantage.max_turns", 0),
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
    ("task_selection.heldout_fraction", 1.0),
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
  assert rl_config_lib.validate(c).estimator == "dr_grpo"


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
