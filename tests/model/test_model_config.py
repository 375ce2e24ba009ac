"""`config.model` defined once: ModelSpec (with its nested moe section) <-> ConfigDict."""

import pytest

from agentic_rl.config_schema import ConfigError
from agentic_rl.model.config import ModelSpec, MoESpec, default_model_config, validate
from tests.dict_sections import DictSections

# The ConfigDict layout config files and configs/assets/base_tiny_bpe/config.json edit,
# as it was when default_model_config was written by hand, plus the Hugging Face families'
# options (issue 18), whose defaults leave the project's own model unchanged.
DEFAULTS = {
    "vocab_size": 320, "d_model": 64, "num_layers": 4, "layer_pattern": "SSSG",
    "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "rope_theta": 10_000.0,
    "norm_eps": 1e-6, "tie_embeddings": True, "value_head": False, "max_seq_len": 512,
    "sliding_window": 32, "block_size": 8, "topk_tokens": 32, "num_dense_layers": 1,
    "d_ff": 128,
    "rope_scaling": {"kind": "none", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_len": 8192},
    "qk_norm": False, "attention_bias": False, "mlp_bias": False, "s_gate": "sigmoid",
    "moe_layer_step": 1, "dense_layers": (),
    "moe": {"num_experts": 8, "num_experts_per_token": 2, "d_ff_expert": 32,
            "num_shared_experts": 1, "gate": "softmax", "renormalize": True,
            "aux_loss_coef": 1e-2, "use_routing_bias": False, "routing_bias_rate": 1e-3,
            "dispatch": "dropless", "capacity_factor": 1.25, "expert_matmul": "auto"},
    "dtype": "float32", "param_dtype": "float32", "cache_dtype": "float32",
    "kernel_backend": "reference", "pallas_interpret": False, "remat": "none",
    "readout_chunk": 256,
    "scan_layers": False,
}


def test_the_generated_config_dict_keeps_the_layout():
  got = default_model_config().to_dict()
  assert got == DEFAULTS
  # Same types too: a float default stays a float (1e-2 == 0.01 either way).
  assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in DEFAULTS.items()}
  assert validate(default_model_config()) == ModelSpec()


def test_the_spec_is_hashable_and_validate_is_repeatable():
  a, b = validate(default_model_config()), validate(default_model_config())
  assert a == b and hash(a) == hash(b)  # A jit static argument.
  assert {a: 1}[b] == 1
  assert a.moe == MoESpec() and a.layer_types == ("S", "S", "S", "G")


def test_values_are_coerced_and_layer_types_follow_the_pattern():
  c = default_model_config()
  c.rope_theta, c.norm_eps, c.moe.aux_loss_coef = 500_000, 0, 1  # ints from a command line
  c.num_layers, c.layer_pattern = 6, "sg"
  spec = validate(c)
  assert isinstance(spec.rope_theta, float) and isinstance(spec.moe.aux_loss_coef, float)
  assert spec.layer_types == ("S", "G", "S", "G", "S", "G")
  dense = spec.all_dense()
  assert dense.layer_types == ("F",) * 6 and dense.num_layers == 6
  assert dense.replay_keys(5) == ("experts",) and spec.replay_keys(5) == ("experts", "blocks")


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update({"num_head": 4}),
     "config.model has unknown field num_head; valid fields: attention_bias, block_size, "),
    (lambda c: c.moe.update({"num_expert": 4}),
     "config.model.moe has unknown field num_expert; valid fields: aux_loss_coef, "
     "capacity_factor, d_ff_expert, dispatch, expert_matmul, gate, num_experts, "
     "num_experts_per_token, "
     "num_shared_experts, renormalize, routing_bias_rate, use_routing_bias."),
    (lambda c: c.moe.update({"num_experts_per_token": 9}),
     "config.model.moe.num_experts_per_token=9: expected between 1 and moe.num_experts=8."),
    (lambda c: c.moe.update({"gate": "relu"}),
     "config.model.moe.gate='relu': expected one of ('softmax', 'sigmoid')."),
    (lambda c: c.moe.update({"num_experts": -1}),
     "config.model.moe.num_experts=-1: expected 0 (no MoE) or more."),
    (lambda c: c.update({"num_heads": 5}),
     "config.model.num_heads=5: expected a multiple of num_kv_heads=2"),
    (lambda c: c.update({"d_model": 0}), "config.model.d_model=0: expected a positive integer."),
    (lambda c: c.update({"d_model": 64.0}), "config.model.d_model=64.0: expected an integer."),
    (lambda c: c.update({"layer_pattern": "SSXG"}),
     "config.model.layer_pattern='SSXG': expected letters from ('S', 'G', 'F')"),
    (lambda c: c.update({"layer_pattern": ""}), "config.model.layer_pattern='': expected"),
])
def test_bad_values_name_their_full_path(edit, message):
  c = default_model_config().to_dict()  # A plain dict: ConfigDict refuses some bad types.
  edit(DictSections(c))
  with pytest.raises(ConfigError) as e:
    validate(c)
  assert message in str(e.value), str(e.value)


def test_a_bad_layer_letter_names_the_unknown_letters():
  c = default_model_config()
  c.layer_pattern = "sxq"
  with pytest.raises(ValueError, match=r"config.model.layer_pattern='SXQ'.*unknown layer "
                                       r"types \['Q', 'X'\]"):
    validate(c)


def test_moe_off_skips_the_expert_checks():
  c = default_model_config()
  c.moe.num_experts, c.moe.num_experts_per_token, c.moe.d_ff_expert = 0, 0, 0
  spec = validate(c)
  assert not any(spec.is_moe_layer(i) for i in range(spec.num_layers))


def test_the_layer_kind_table_drives_cache_replay_and_route_a():
  """One table (LAYER_KINDS) says what each layer type brings; the cache layout, the
  replay records and route A's pattern follow it."""
  from agentic_rl.model import cache as cache_lib
  from agentic_rl.model.config import LAYER_KINDS, dense_pattern
  config = default_model_config()
  config.layer_pattern = "SGF"
  config.num_layers = 3
  config.moe.num_experts = 0
  spec = validate(config)
  cache = cache_lib.init_cache(spec, batch_size=1, max_len=64)
  for layer, letter in enumerate("SGF"):
    kind = LAYER_KINDS[letter]
    assert ("pos" in cache["layers"][layer]) == kind.ring_cache
    assert ("block_keys" in cache["layers"][layer]) == kind.block_summaries
    assert spec.replay_keys(layer) == kind.replay
  assert [spec.replay_keys(i) for i in range(3)] == [(), ("blocks",), ()]
  assert dense_pattern("sgfG") == "SFFF"
  assert dense_pattern("SXG") == "SXF"  # Unknown letters are left for validation to name.
