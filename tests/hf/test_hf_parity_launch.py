"""launch.hf_parity on a saved tiny Qwen3-MoE: the JSON it prints, --tokens/--logits_out, and
the hybrid retrofit, which at full coverage (window and budget >= T) is the dense model."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.hf import model_fixture  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp("qwen3_moe")
  model_fixture.build("qwen3_moe").save_pretrained(folder)
  return str(folder)


def _parity(*args):
  out = subprocess.run([sys.executable, "-m", "launch.hf_parity", "--json", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_parity_json_tokens_and_logits_out(hf_dir, tmp_path):
  tokens = np.random.default_rng(3).integers(0, 96, (3, 17), dtype=np.int32)
  np.save(tmp_path / "t.npy", tokens)
  report = _parity("--hf_dir", hf_dir, "--tokens", str(tmp_path / "t.npy"), "--logits_out",
                   str(tmp_path / "l.npy"))
  assert report["model_type"] == "qwen3_moe" and report["tokens"] == [3, 17]
  assert report["max_abs_logit_diff"] < 1e-4 and report["decode_max_abs_logit_diff"] < 1e-4
  assert report["params"] > 0
  logits = np.load(tmp_path / "l.npy")
  assert logits.shape == (3, 17, 96) and logits.dtype == np.float32


def test_the_retrofit_at_full_coverage_is_the_dense_model_and_costs_kl_below_it(hf_dir):
  full = _parity("--hf_dir", hf_dir, "--length", "24", "--layer_pattern", "SSSG",
                 "--sliding_window", "64", "--block_size", "4", "--topk_tokens", "64")
  assert full["layer_pattern"] == "SSSG"
  assert full["kl_to_dense"] < 1e-9 and full["max_abs_logit_diff"] < 1e-4
  narrow = _parity("--hf_dir", hf_dir, "--length", "24", "--layer_pattern", "SSSG",
                   "--sliding_window", "4", "--block_size", "4", "--topk_tokens", "8")
  assert narrow["kl_to_dense"] > 1e-4  # Windows and budgets below T change the function.
