"""launch.device_check on this machine: every kernel runs (interpret mode on the CPU), and
forward and gradient agree with the reference."""

import json
import subprocess
import sys


def test_device_check_reports_every_kernel_forward_and_backward():
  out = subprocess.run([sys.executable, "-m", "launch.device_check", "--json", "--seq_len=64",
                        "--head_dim=16", "--window=16", "--topk_tokens=16", "--repeats=1"],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert report["pallas_mode"] == ("interpret" if report["backend"] == "cpu" else "compiled")
  assert set(report["kernels"]) == {"flash_causal", "flash_sliding_window", "block_sparse"}
  for name, row in report["kernels"].items():
    assert row["ran"] in ("pallas", "pallas_interpret"), name
    assert row["forward_max_abs_diff"] < 1e-4 and row["grad_max_abs_diff"] < 1e-4, (name, row)
    for key in ("pallas_ms", "reference_ms", "pallas_grad_ms", "reference_grad_ms"):
      assert row[key] > 0, (name, key)
