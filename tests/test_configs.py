"""Every shipped config parses, validates and builds with the shapes it promises.

Full-scale configs are only ever traced with jax.eval_shape: no weight is allocated.
"""

import importlib
import pathlib

import jax
import jax.numpy as jnp
import pytest

from agentic_rl.model import cache as cache_lib
from agentic_rl.model import config as model_config
from agentic_rl.model import layer_stack
from agentic_rl.model import sizing
from agentic_rl.model import transformer

CONFIG_NAMES = sorted(p.stem for p in pathlib.Path(__file__).parents[1].joinpath(
    "configs").glob("*.py") if p.stem != "__init__")


def _load(name):
  return importlib.import_module(f"configs.{name}").get_config()


def test_configs_exist():
  assert {"quickstart", "full_scale"} <= set(CONFIG_NAMES)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_parses_and_shapes(name):
  config = _load(name)
  spec = model_config.validate(config.model)
  model = transformer.Model(spec)
  shapes = model.param_shapes()
  assert shapes["embed"]["embedding"].shape == (spec.vocab_size, spec.d_model)
  per_layer = layer_stack.unstacked(shapes)  # Under scan_layers, each layer's slice.
  for i, layer_type in enumerate(spec.layer_types):
    layer = per_layer[f"layer_{i}"]
    assert layer["attn"]["w_q_dnh"].shape == (spec.d_model, spec.num_heads, spec.head_dim)
    assert layer["attn"]["w_k_dkh"].shape == (spec.d_model, spec.num_kv_heads, spec.head_dim)
    assert ("w_gate_dn" in layer["attn"]) == (layer_type == "S")
    if spec.is_moe_layer(i):
      assert layer["moe"]["w_gate_edf"].shape == (spec.moe.num_experts, spec.d_model,
                                                  spec.moe.d_ff_expert)
    else:
      assert "ffn" in layer
  # A decode step through a full-capacity cache, traced only.
  cache = jax.eval_shape(lambda: cache_lib.init_cache(spec, 1))
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  logits, new_cache, aux = jax.eval_shape(model.forward, shapes, tokens, tokens, cache)
  assert logits.shape == (1, 1, spec.vocab_size)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), new_cache) == jax.tree.map(
      lambda x: (x.shape, x.dtype), cache)
  for i, layer_type in enumerate(spec.layer_types):
    if layer_type == "G":
      assert aux["layers"][i]["blocks"].shape == (1, spec.num_kv_heads, 1,
                                                  spec.num_selected_blocks)


def test_full_scale_is_the_reference_architecture():
  spec = model_config.validate(_load("full_scale").model)
  assert spec.num_layers >= 60
  assert spec.layer_scan == model_config.LayerScan(unrolled=4, period=4, repeats=15)
  assert spec.max_seq_len >= 1 << 20
  assert (spec.block_size, spec.topk_tokens, spec.num_selected_blocks) == (8, 4096, 512)
  assert "".join(spec.layer_types[:4]) == "SSSG"
  assert spec.layer_types.count("S") == 3 * spec.layer_types.count("G")
  report = sizing.model_report(spec)
  assert report["params_active"] < report["params_total"] / 10  # very sparse
  kv, dense = report["kv_bytes_per_token"]["1048576"], report[
      "kv_bytes_per_token_all_dense"]["1048576"]
  assert dense / kv >= 3.0


@pytest.mark.parametrize("field,value,message", [
    ("layer_pattern", "SSXG", "unknown layer types"),
    ("num_kv_heads", 3, "multiple of num_kv_heads"),
    ("topk_tokens", 30, "multiple of block_size"),
    ("head_dim", 15, "even"),
    ("dtype", "float64", "one of"),
])
def test_bad_config_names_the_field(field, value, message):
  config = _load("quickstart")
  config.model[field] = value
  with pytest.raises(ValueError, match=message) as err:
    model_config.validate(config.model)
  assert field in str(err.value)
