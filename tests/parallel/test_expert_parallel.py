"""Expert parallelism (moe.dispatch='all_to_all') on 8 emulated devices, against the
dropless single-device MoE: forward and gradients with capacity to spare, the overflow
count against a naive loop, the compiled HLO, and the whole model with routing replay."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from agentic_rl.config_schema import ConfigError
from agentic_rl.model.config import ModelSpec, MoESpec, validate
from agentic_rl.model.transformer import Model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def report():
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, "-m", "tests.parallel.expert_parallel_check"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["data=2,expert=4@8.0", "expert=8@8.0",
                                  "data=2,fsdp=2,expert=2@8.0"])
def test_with_capacity_to_spare_it_is_the_dropless_moe(report, case):
  r = report[case]
  assert r["dropped"] == 0 and r["assignments"] == r["valid_assignments"]
  assert r["forward_max_abs_diff"] < 1e-5 and r["grad_max_abs_diff"] < 1e-5


def test_overflow_is_counted_as_a_naive_loop_counts_it(report):
  r = report["data=2,expert=4@0.5"]
  assert r["dropped"] == r["naive_dropped"] > 0
  # What is kept equals the dropless MoE with the dropped assignments' gates at zero.
  assert r["forward_max_abs_diff"] < 1e-5 and r["grad_max_abs_diff"] < 1e-5


def test_the_compiled_path_moves_tokens_not_expert_weights(report):
  for case in ("data=2,expert=4@8.0", "expert=8@8.0"):
    assert report[case]["hlo_all_to_all"] > 0 and report[case]["hlo_all_gather"] == 0


@pytest.mark.parametrize("mesh", ["data=2,expert=4", "expert=8", "data=2,fsdp=2,expert=2"])
def test_the_ragged_path_is_the_dropless_moe(report, mesh):
  r = report[f"ragged:{mesh}"]
  assert r["dropped"] == 0 and r["assignments"] == r["valid_assignments"]
  assert r["forward_max_abs_diff"] < 1e-5 and r["grad_max_abs_diff"] < 1e-5


def test_tpu_and_gpu_get_the_real_ragged_all_to_all(report):
  """XLA:CPU cannot compile it, but the lowering shows what TPU/GPU run: two exchanges in
  the forward, their transposes in the backward, and no float all-gather (no weights)."""
  for mesh in ("data=2,expert=4", "expert=8"):
    r = report[f"ragged:{mesh}"]
    assert r["lowered_ragged_all_to_all"] >= 4
    assert r["lowered_float_all_gathers"] == 0


@pytest.mark.parametrize("model", ["model", "model_ragged"])
def test_the_whole_model_under_a_mesh_with_routing_replay(report, model):
  r = report[model]
  # The loss sums 96 positions' log-probs, so gradients reach tens: compare relative to
  # their largest entry (the single layers above are held to 1e-5 absolute).
  assert r["forward_max_abs_diff"] < 1e-5
  assert r["grad_max_abs_diff"] < 1e-6 * r["grad_scale"], r
  assert r["routing_equal"] and r["replay_max_abs_diff"] == 0.0
  assert r["dropped"] == [0, 0] and r["routed"] == [192, 192]


def test_bad_settings_name_the_field():
  c = validate(ModelSpec()).moe
  with pytest.raises(ConfigError, match="capacity_factor"):
    MoESpec(capacity_factor=0.0)
  with pytest.raises(ConfigError, match="dispatch"):
    c.replace(dispatch="ragged")  # The name is 'ragged_all_to_all'.


def test_all_to_all_without_a_mesh_says_how_to_get_one():
  spec = ModelSpec(layer_pattern="F", num_dense_layers=0,
                   moe=MoESpec(dispatch="all_to_all", num_shared_experts=0))
  model = Model(spec)
  params = model.init(jax.random.key(0))  # Params never need the mesh.
  tokens = np.zeros((2, 4), np.int32)
  with pytest.raises(ValueError, match="jax.set_mesh"):
    model.forward(params, tokens, np.broadcast_to(np.arange(4, dtype=np.int32), (2, 4)))
