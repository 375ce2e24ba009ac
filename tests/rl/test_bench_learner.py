"""launch.bench_learner times the RL step and reports its share of the matmul peak."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # ~45 s, most of it compiling the quickstart step.
def test_the_report_is_consistent():
  out = subprocess.run([sys.executable, "-m", "launch.bench_learner", "--json", "--batch=4",
                        "--seq_len=64", "--steps=1", "--matmul_size=256"],
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r["tokens"] == 4 * 64 and r["tokens_per_s"] == r["tokens"] / r["seconds"]
  assert r["padded_tokens"] == 4 * 64  # Every row full: no minibatch is cut.
  assert r["flops_per_step"] > 0 and r["flops_per_s"] == r["flops_per_step"] / r["seconds"]
  assert r["fraction_of_peak"] == r["flops_per_s"] / r["matmul_peak_flops_per_s"]
  assert 0 < r["fraction_of_peak"] < 1.5  # A step cannot beat a plain matmul by much.
  assert r["peak_bytes"] > 0 and r["updates"] == 4  # quickstart: 2 epochs x 2 minibatches
