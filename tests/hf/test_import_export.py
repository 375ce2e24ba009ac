"""launch.import_hf and launch.export_hf on tiny random transformers checkpoints: the import
writes what runs start from, the export writes what transformers loads, import then export is
exact, bad input stops before anything is written, and the import streams."""

import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.numpy import load_file  # noqa: E402

from agentic_rl.interop import hf_export, hf_import, run_config  # noqa: E402
from agentic_rl.interop.hf_source import CheckpointError  # noqa: E402
from agentic_rl.model import families  # noqa: E402
from agentic_rl.model.config import validate  # noqa: E402
from agentic_rl.model.families.hf_config import UnsupportedConfig  # noqa: E402
from agentic_rl.train import params_file  # noqa: E402
from tests.hf import model_fixture  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Each family saved by transformers: qwen3 sharded (with an index), the others whole."""
  out = {}
  for model_type in model_fixture.FAMILY_CONFIGS:
    folder = tmp_path_factory.mktemp(model_type)
    model = model_fixture.build(model_type)
    shard = "40KB" if model_type == "qwen3" else "50GB"
    model.save_pretrained(folder, max_shard_size=shard)
    out[model_type] = (str(folder), model)
  assert os.path.isfile(os.path.join(out["qwen3"][0], "model.safetensors.index.json"))
  return out


def _hf_tensors(folder):
  index = os.path.join(folder, "model.safetensors.index.json")
  files = (sorted(set(json.load(open(index))["weight_map"].values()))
           if os.path.isfile(index) else ["model.safetensors"])
  out = {}
  for f in files:
    out.update(load_file(os.path.join(folder, f)))
  return out


@pytest.mark.parametrize("model_type", list(model_fixture.FAMILY_CONFIGS))
def test_import_then_export_is_exact_and_transformers_loads_it(saved, tmp_path, model_type):
  import torch
  import transformers
  folder, hf_model = saved[model_type]
  imported = hf_import.import_checkpoint(folder, str(tmp_path / "imported"))
  assert sorted(os.listdir(tmp_path)) == ["imported"]  # No partial folder left behind.
  with open(os.path.join(imported, "config.json")) as f:
    spec = validate(json.load(f)["model"])
  arrays = load_file(os.path.join(imported, "params.safetensors"))
  out = hf_export.export_params({k: v.dtype for k, v in arrays.items()}, arrays.__getitem__,
                                spec, str(tmp_path / "exported"),
                                hf_config_base=hf_import.read_hf_config(folder),
                                shard_bytes=30_000)
  before, after = _hf_tensors(folder), _hf_tensors(out)
  if spec.tie_embeddings:
    before.pop("lm_head.weight", None)
  assert sorted(before) == sorted(after)
  for name, value in before.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32, attn_implementation="eager").eval()
  tokens = np.random.default_rng(0).integers(0, spec.vocab_size, (2, 12))
  np.testing.assert_array_equal(model_fixture.logits(reloaded, tokens),
                                model_fixture.logits(hf_model, tokens))


def test_the_import_is_what_a_run_starts_from(saved, tmp_path):
  """The folder loads through params_file (init_checkpoint's reader) into the model its
  config.json describes, and its config.py builds a config that validates."""
  folder, _ = saved["qwen3_moe"]
  out = subprocess.run([sys.executable, "-m", "launch.import_hf", "--hf_dir", folder,
                        "--workdir", str(tmp_path / "q"), "--dtype", "bfloat16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.loads(out.stdout.strip().splitlines()[-1])["workdir"] == str(tmp_path / "q")
  from agentic_rl.model.transformer import Model
  spec = validate(json.load(open(tmp_path / "q" / "config.json"))["model"])
  assert spec.param_dtype == "bfloat16" and spec.moe.num_experts == 4
  like = Model(spec).init(__import__("jax").random.key(0))
  params = params_file.load_params(str(tmp_path / "q"), like)
  assert params["layer_1"]["moe"]["w_gate_edf"].dtype.name == "bfloat16"


def _copy(folder, dest, edit_config=None, drop=None):
  import shutil
  shutil.copytree(folder, dest)
  if edit_config:
    path = os.path.join(dest, "config.json")
    cfg = json.load(open(path))
    edit_config(cfg)
    json.dump(cfg, open(path, "w"))
  if drop:
    os.remove(os.path.join(dest, drop))
  return str(dest)


@pytest.mark.parametrize("edit,field", [
    (lambda c: c.update(rope_parameters=None, rope_theta=1e4,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_scaling.rope_type"),
    (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}),
     "rope_parameters.rope_type"),
    (lambda c: c.update(use_sliding_window=True), "use_sliding_window"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(model_type="gpt2"), "model_type"),
])
def test_an_unsupported_config_value_is_named_and_nothing_is_written(saved, tmp_path, edit,
                                                                      field):
  src = _copy(saved["llama"][0], tmp_path / "src", edit_config=edit)
  with pytest.raises(UnsupportedConfig, match=field):
    hf_import.import_checkpoint(src, str(tmp_path / "out"))
  assert sorted(os.listdir(tmp_path)) == ["src"]


def test_both_config_spellings_read_the_same(saved):
  """transformers 5.x writes rope_parameters; 4.x wrote rope_theta and rope_scaling."""
  cfg = hf_import.read_hf_config(saved["llama"][0])
  assert "rope_parameters" in cfg
  params = dict(cfg["rope_parameters"])
  old = {**{k: v for k, v in cfg.items() if k != "rope_parameters"},
         "rope_theta": params.pop("rope_theta"), "rope_scaling": params}
  new_spec, old_spec = families.spec_from_hf(cfg), families.spec_from_hf(old)
  assert new_spec == old_spec and new_spec.rope_scaling.kind == "llama3"
  assert new_spec.rope_theta == model_fixture.FAMILY_CONFIGS["llama"]["rope_theta"]
  # Both present: rope_scaling wins, as in transformers 5.
  both = {**cfg, "rope_scaling": {"rope_type": "default"}}
  assert families.spec_from_hf(both).rope_scaling.kind == "none"


def test_bad_tensors_are_named_before_anything_is_written(saved, tmp_path):
  from safetensors.numpy import save_file
  folder = saved["llama"][0]
  tensors = load_file(os.path.join(folder, "model.safetensors"))
  cases = {
      "missing": {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj.weight" not in k},
      "unexpected": {**tensors, "model.layers.0.extra.weight": np.zeros(3, np.float32)},
      "wrong shape": {**tensors, "model.norm.weight": np.zeros(5, np.float32)},
      "wrong shape or dtype": {**tensors, "model.norm.weight": np.zeros(32, np.int32)},
  }
  for i, (word, case) in enumerate(cases.items()):
    src = _copy(folder, tmp_path / f"src{i}")
    save_file(case, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=word) as err:
      hf_import.import_checkpoint(src, str(tmp_path / f"out{i}"))
    assert not os.path.exists(tmp_path / f"out{i}")
    assert ("up_proj" in str(err.value) or "extra" in str(err.value)
            or "model.norm.weight" in str(err.value))


def test_a_shard_the_index_names_but_lacks_is_named(saved, tmp_path):
  folder = saved["qwen3"][0]
  index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
  gone = sorted(set(index["weight_map"].values()))[1]
  src = _copy(folder, tmp_path / "src", drop=gone)
  with pytest.raises(CheckpointError, match=gone):
    hf_import.import_checkpoint(src, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")


def test_the_import_streams_one_tensor_at_a_time(tmp_path):
  """Peak traced allocation during the import of a sharded checkpoint stays near one param
  (a stacked expert weight is the largest), far below the model."""
  hf_model = model_fixture.build("qwen3_moe", hidden_size=64, moe_intermediate_size=64,
                                 num_experts=8, intermediate_size=128, vocab_size=512,
                                 num_hidden_layers=8)
  hf_model.save_pretrained(tmp_path / "src", max_shard_size="300KB")
  model_bytes = sum(v.numel() * 4 for v in hf_model.state_dict().values())
  largest = 8 * 64 * 64 * 4  # Our largest param: one stacked expert projection [E, D, F].
  tracemalloc.start()
  try:
    hf_import.import_checkpoint(str(tmp_path / "src"), str(tmp_path / "out"))
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert model_bytes > 20 * largest
  assert peak < 4 * largest, (peak, largest, model_bytes)  # Measured: 3.6x.


@pytest.mark.parametrize("arg", ["", ":retrofit"])
def test_check_consistency_reads_the_import_through_its_config(saved, tmp_path, arg):
  """launch.check_consistency takes the import's params via config.train.init_checkpoint,
  dense and as the retrofitted hybrid (S gates starting at pass-through)."""
  out = str(tmp_path / "imported")
  hf_import.import_checkpoint(saved["qwen3_moe"][0], out, config_py=run_config.CONFIG_PY)
  run = subprocess.run([sys.executable, "-m", "launch.check_consistency", "--config",
                        f"{out}/config.py{arg}", "--length", "24", "--prefill", "8",
                        "--chunk", "8"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads(run.stdout[run.stdout.index("{"):])
  assert report["params"] == out
  assert report["config_layer_types"] == ("SSSG" if arg else "FFFF")
  assert report["max_abs_logit_diff"] < 1e-4 and report["routing_agreement"] == 1.0


def test_a_fused_expert_checkpoint_imports_as_the_per_expert_one(saved, tmp_path):
  """transformers 5 keeps Qwen3-MoE experts fused in memory ([E, 2F, D] gate_up, [E, D, F]
  down); a file written that way imports to the same params, one expert slice at a time."""
  from safetensors.numpy import save_file
  folder, hf_model = saved["qwen3_moe"]
  fused = _copy(folder, tmp_path / "fused")
  save_file(model_fixture.state_dict(hf_model), os.path.join(fused, "model.safetensors"),
            metadata={"format": "pt"})
  assert any(k.endswith("experts.gate_up_proj") for k in load_file(
      os.path.join(fused, "model.safetensors")))
  a = hf_import.import_checkpoint(folder, str(tmp_path / "a"))
  b = hf_import.import_checkpoint(fused, str(tmp_path / "b"))
  pa, pb = (load_file(os.path.join(x, "params.safetensors")) for x in (a, b))
  assert sorted(pa) == sorted(pb)
  for name in pa:
    np.testing.assert_array_equal(pa[name], pb[name], err_msg=name)


def test_export_refuses_a_family_that_would_compute_something_else(saved, tmp_path):
  folder, _ = saved["qwen3"]
  spec = families.spec_from_hf(hf_import.read_hf_config(folder))
  with pytest.raises(ValueError, match="qk_norm"):
    hf_export.export_params({}, lambda n: None, spec, str(tmp_path / "x"), model_type="llama")
  llama = families.spec_from_hf(hf_import.read_hf_config(saved["llama"][0]))
  with pytest.raises(ValueError, match="qk_norm"):
    hf_export.export_params({}, lambda n: None, llama, str(tmp_path / "y"), model_type="qwen3")
  assert not os.listdir(tmp_path)


def test_export_keeps_the_checkpoints_context_length(saved, tmp_path):
  """Our max_seq_len is a cache capacity the import caps; the export writes the model's."""
  folder, _ = saved["qwen3"]
  base = hf_import.read_hf_config(folder)
  imported = hf_import.import_checkpoint(folder, str(tmp_path / "i"), max_seq_len=64)
  spec = validate(json.load(open(os.path.join(imported, "config.json")))[
      "model"])
  assert spec.max_seq_len == 64 < base["max_position_embeddings"]
  arrays = load_file(os.path.join(imported, "params.safetensors"))
  out = hf_export.export_params({k: v.dtype for k, v in arrays.items()}, arrays.__getitem__,
                                spec, str(tmp_path / "e"), hf_config_base=base)
  cfg = json.load(open(os.path.join(out, "config.json")))
  assert cfg["max_position_embeddings"] == base["max_position_embeddings"]
  assert cfg["dtype"] == cfg["torch_dtype"] == "float32"


def test_a_scanned_model_reads_and_writes_the_same_folders(saved, tmp_path):
  """Under config.model.scan_layers the import loads stacked (Qwen3-MoE's dense layer 0
  unrolled, its three MoE layers one scanned group), computes transformers' logits, and
  exports the tensors it was imported from."""
  import jax
  from agentic_rl.interop import hf_params
  from agentic_rl.interop.hf_source import TensorSource
  from agentic_rl.model.transformer import Model
  folder, hf_model = saved["qwen3_moe"]
  imported = hf_import.import_checkpoint(folder, str(tmp_path / "imported"))
  with open(os.path.join(imported, "config.json")) as f:
    spec = validate(json.load(f)["model"]).replace(scan_layers=True)
  assert spec.layer_scan.unrolled == 1 and spec.layer_scan.repeats == 3
  like = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), Model(spec).param_shapes())
  params = params_file.load_params(imported, like)
  assert "layer_0" in params and "layer_1" not in params
  in_memory = hf_params.load(spec, TensorSource.from_dir(folder))
  assert jax.tree.structure(in_memory) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(in_memory), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)

  tokens = np.random.default_rng(0).integers(0, spec.vocab_size, (2, 12), dtype=np.int32)
  positions = np.broadcast_to(np.arange(12, dtype=np.int32), tokens.shape)
  ours, _, _ = jax.jit(Model(spec).forward)(params, tokens, positions)
  assert np.abs(np.asarray(ours) - model_fixture.logits(hf_model, tokens)).max() < 1e-4

  flat = params_file.flatten(params)  # The unrolled names the layout rules use.
  out = hf_export.export_params({k: v.dtype for k, v in flat.items()}, flat.__getitem__,
                                spec, str(tmp_path / "exported"),
                                hf_config_base=hf_import.read_hf_config(folder))
  before, after = _hf_tensors(folder), _hf_tensors(out)
  assert sorted(before) == sorted(after)
  for name, value in before.items():
    np.testing.assert_array_equal(after[name], value, err_msg=name)
