"""launch.check_sharding on the quickstart model: it restarts itself with 8 emulated devices,
and the sharded, expert-parallel model equals one device while no expert overflows."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(*args):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-m", "launch.check_sharding", "--json",
                        "--config", "configs/quickstart.py", *args], cwd=ROOT,
                       env=dict(env, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # ~1 min: compiles the quickstart model twice over 8 devices.
def test_expert_parallel_quickstart_equals_one_device():
  r = _check("--mesh", "data=2,fsdp=2,expert=2", "--config.model.moe.capacity_factor=8")
  assert r["devices"] == 8 and r["ep_path"] == "all_to_all" and r["overflow_frac"] == 0.0
  assert r["forward_max_abs_diff"] < 5e-5 and r["grad_max_abs_diff"] < 1e-5
  assert r["sampler_logp_max_abs_diff"] < 5e-5 and r["params_sharded"] > 0


@pytest.mark.slow
def test_overflow_is_reported_not_hidden():
  r = _check("--mesh", "expert=8", "--config.model.moe.capacity_factor=0.5")
  assert r["overflow_frac"] > 0.1  # Half an even share per expert: many drops.
