"""Params as a safetensors file: exact round trip, and errors that say what does not fit."""

import jax
import numpy as np
import pytest

from agentic_rl.train import params_file


def _params():
  rng = np.random.default_rng(0)
  return {"embed": {"table": rng.normal(size=(7, 4)).astype(np.float32)},
          "layers": [{"w": rng.normal(size=(4, 4)).astype(np.float32),
                      "scale": np.ones(4, np.float32)} for _ in range(2)]}


def test_round_trip_is_exact_and_keeps_the_tree(tmp_path):
  params = _params()
  path = params_file.save_params(str(tmp_path / "base"), params, {"sft_step": 12, "note": "x"})
  assert path.endswith("base/params.safetensors")
  loaded = params_file.load_params(str(tmp_path / "base"), params)
  assert jax.tree.structure(loaded) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  assert params_file.read_metadata(str(tmp_path / "base")) == {"sft_step": 12, "note": "x"}
  assert set(params_file.flatten(params)) == {"embed/table", "layers/0/w", "layers/0/scale",
                                             "layers/1/w", "layers/1/scale"}


def test_a_file_that_does_not_fit_the_model_says_what_differs(tmp_path):
  params = _params()
  params_file.save_params(str(tmp_path), params)
  other = _params()
  other["embed"]["table"] = np.zeros((8, 4), np.float32)  # another vocabulary
  other["layers"][1]["bias"] = np.zeros(4, np.float32)
  del other["layers"][0]["scale"]
  with pytest.raises(ValueError) as err:
    params_file.load_params(str(tmp_path), other, "config.train.init_checkpoint")
  text = str(err.value)
  assert "config.train.init_checkpoint=" in text
  assert "missing 1: ['layers/1/bias']" in text
  assert "unexpected 1: ['layers/0/scale']" in text
  assert "embed/table: file (7, 4) float32, model (8, 4) float32" in text


def test_no_file_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no params.safetensors"):
    params_file.load_params(str(tmp_path), _params(), "--checkpoint")
  assert params_file.params_path(str(tmp_path)) is None


def test_only_named_fresh_parts_may_be_absent(tmp_path):
  params = _params()
  params_file.save_params(str(tmp_path), params)
  with_head = {**_params(), "value_head": {"kernel": np.full((4, 1), 3.0, np.float32)}}
  loaded = params_file.load_params(str(tmp_path), with_head, fresh_prefixes=("value_head/",))
  np.testing.assert_array_equal(loaded["value_head"]["kernel"], 3.0)  # Kept fresh.
  np.testing.assert_array_equal(loaded["layers"][0]["w"], params["layers"][0]["w"])
  with pytest.raises(ValueError, match="missing 1: \\['value_head/kernel'\\]"):
    params_file.load_params(str(tmp_path), with_head)


def test_a_scanned_model_saves_and_loads_the_unrolled_layout(tmp_path):
  """config.model.scan_layers changes the tree in memory, not the file: one file loads
  into either layout, and a scanned tree saves the names an unrolled one does."""
  from agentic_rl.model import layer_stack
  from agentic_rl.model.config import ModelSpec
  from agentic_rl.model.transformer import Model
  spec = ModelSpec(vocab_size=32, d_model=16, num_layers=8, num_heads=2, num_kv_heads=1,
                   head_dim=8, d_ff=16, num_dense_layers=0)
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype),
                        Model(spec).param_shapes())
  scanned = spec.replace(scan_layers=True)
  stacked = layer_stack.stack_layers(params, scanned)
  assert params_file.flatten(stacked).keys() == params_file.flatten(params).keys()
  params_file.save_params(str(tmp_path / "scanned"), stacked)
  params_file.save_params(str(tmp_path / "unrolled"), params)
  for folder in ("scanned", "unrolled"):
    like = jax.tree.map(np.zeros_like, stacked)
    loaded = params_file.load_params(str(tmp_path / folder), like)
    assert jax.tree.structure(loaded) == jax.tree.structure(stacked)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(stacked)):
      np.testing.assert_array_equal(a, b)
    loaded = params_file.load_params(str(tmp_path / folder), params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
      np.testing.assert_array_equal(a, b)
  # A fresh part, named as in the file (slot 1's S gates: layers 1 and 5), keeps the
  # scanned `like`'s values; the rest comes from the file.
  del stacked["layers"]["slot_1"]["attn"]["b_gate_n"]
  params_file.save_params(str(tmp_path / "no_gate"), stacked)
  gates = tuple(f"layer_{scanned.layer_scan.layer(1, r)}/attn/b_gate_n" for r in range(2))
  assert gates == ("layer_1/attn/b_gate_n", "layer_5/attn/b_gate_n")
  full = layer_stack.stack_layers(params, scanned)
  like = jax.tree.map(lambda x: np.full_like(x, 7.0), full)
  loaded = params_file.load_params(str(tmp_path / "no_gate"), like, fresh_prefixes=gates)
  np.testing.assert_array_equal(loaded["layers"]["slot_1"]["attn"]["b_gate_n"], 7.0)
  np.testing.assert_array_equal(loaded["layers"]["slot_2"]["attn"]["b_gate_n"],
                                full["layers"]["slot_2"]["attn"]["b_gate_n"])
