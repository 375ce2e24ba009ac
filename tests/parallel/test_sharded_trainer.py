"""The trainer's route on a mesh of 8 emulated devices against one device (subprocess:
tests/parallel/sharded_trainer_check.py): the train state born sharded, the engine's
rollouts with sharded caches, and one RL step with expert-parallel MoE."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(*mesh_flags) -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "tests.parallel.sharded_trainer_check",
                        *mesh_flags], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1200)
  assert out.returncode == 0, out.stderr[-4000:]
  return {r["flag"]: r for r in map(json.loads, out.stdout.strip().splitlines())}


def _assert_equivalent(r: dict):
  assert r["init_max_abs_diff"] == 0.0  # Born sharded, the same values.
  assert r["state_leaves_sharded"] > r["state_leaves"] // 2
  assert r["moments_sharded"] > 0  # Adam moments follow their params.
  assert r["cache_devices"] == 8 and r["cache_leaves_sharded"] > 0
  assert r["batch_rows_sharded"] > 0
  # The same seeds sample the same tokens; log-probs agree to float32 reduction order.
  assert r["tokens_equal"] and r["trajectories"] == 8
  assert r["sampler_logp_max_abs_diff"] < 1e-4
  assert r["step_params_change"] > 1e-3  # The step moved the params (4 Adam updates)...
  # ...as one device moves them, to 0.5% of the move: Adam divides by sqrt(v), so an
  # element whose gradient is near eps turns float32 reduction-order noise into a visible
  # share of its update (measured: 7e-6 and 9e-6 of a 4e-3 move).
  assert r["step_params_max_abs_diff"] < 5e-3 * r["step_params_change"]
  assert r["step_loss_abs_diff"] < 1e-5
  # Expert parallel at a capacity nothing exceeds: counted, and zero.
  assert r["overflow_frac"] == 0.0
  assert r["sampler_overflow"][0] == 0 and r["sampler_overflow"][1] > 0
  assert r["stepped_off_rules"] == 0  # The step kept the rules' shardings.
  # Sampler = learner holds on the mesh as it does on one device.
  assert r["mismatch_k3"] < 1e-6 and r["one_device_mismatch_k3"] < 1e-6


@pytest.mark.slow  # ~60 s; tests/parallel/test_expert_parallel.py covers the default suite.
def test_fsdp_and_expert_parallel_route_equals_one_device():
  _assert_equivalent(_check("data=2,fsdp=2,expert=2")["data=2,fsdp=2,expert=2"])


@pytest.mark.slow
def test_fsdp_tensor_and_expert_parallel_route_equals_one_device():
  _assert_equivalent(_check("fsdp=2,tensor=2,expert=2")["fsdp=2,tensor=2,expert=2"])


# The main job on a mesh: launch.train on the tiny SWE config, on one device, on 8 emulated
# devices in one process, and on 2 processes x 4 devices, the latter two with the mesh
# (data 2, fsdp 2, expert 2). SFT batches are deterministic, so one process's SFT params
# compare with one device's; RL samples, so its step is checked for running and logging
# overflow, and the two processes for ending with the same params.
_MESH_RUN = ("--config.rl.num_steps=1", "--config.train.sft_batch_size=8",
             "--config.train.groups_per_step=4", "--config.model.moe.capacity_factor=8.0")
_MESH = ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.expert=2",
         "--config.model.moe.dispatch=all_to_all")


def _launch(workdir, devices: int, *overrides, processes: int = 1) -> list[str]:
  from tests.train.run_train import TINY_CONFIG, env
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  multi = (("--config.train.num_processes=2", f"--config.train.coordinator_address={address}")
           if processes > 1 else ())
  run_env = dict(env(), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "launch.train", f"--config={TINY_CONFIG}", f"--workdir={workdir}",
       *_MESH_RUN, *overrides, *multi,
       *((f"--config.train.process_id={i}",) if processes > 1 else ())],
      cwd=ROOT, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(processes)]
  outs = []
  for p in procs:
    out, _ = p.communicate(timeout=1800)
    assert p.returncode == 0, out[-4000:]
    outs.append(out)
  return outs


def _sft_params(workdir):
  """The params each run saved at the end of SFT (global step 2), read on one device."""
  from agentic_rl.train.trainer import load_params_with
  from tests.train.tiny_config import tiny_config
  params, _ = load_params_with(tiny_config(), os.path.join(workdir, "checkpoints", "2"),
                               "the SFT checkpoint")
  return params


@pytest.mark.slow
def test_main_job_on_a_mesh_in_one_and_two_processes_equals_one_device(tmp_path):
  import jax
  import numpy as np
  from tests.train.run_train import metrics

  one, mesh, two = (str(tmp_path / n) for n in ("one", "mesh", "two"))
  _launch(one, 1)
  _launch(mesh, 8, *_MESH)
  outs = _launch(two, 4, *_MESH, processes=2)
  digests = [[l for l in out.splitlines() if l.startswith(f"process {i} final params")]
             for i, out in enumerate(outs)]
  assert all(digests) and digests[0][0].split()[-1] == digests[1][0].split()[-1]
  # Two processes each draw SFT rows from their own demonstrations, so only the one-process
  # mesh run sees one device's batches.
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                       _sft_params(one), _sft_params(mesh))
  assert max(jax.tree.leaves(diffs)) < 1e-4
  for workdir in (mesh, two):
    rl = [m for m in metrics(workdir) if "moe/overflow_frac" in m]
    assert rl and rl[-1]["moe/overflow_frac"] == 0.0
    assert rl[-1]["rollout/moe_overflow_frac"] == 0.0


@pytest.mark.parametrize("field,value,message", [
    ("fsdp", 2, "config.mesh.data=-1: expected a size that fills 1 devices"),
    ("expert", 2, "config.mesh.data=-1: expected a size that fills 1 devices"),
])
def test_a_mesh_the_devices_cannot_take_fails_before_anything_compiles(tmp_path, field, value,
                                                                        message):
  from agentic_rl.config_schema import ConfigError
  from agentic_rl.train.trainer import Trainer
  from tests.train.tiny_config import tiny_config
  config = tiny_config()
  setattr(config.mesh, field, value)
  with pytest.raises(ConfigError, match=message):
    Trainer(config, str(tmp_path))


def test_an_expert_axis_the_experts_do_not_divide_is_named(tmp_path):
  from agentic_rl.parallel import mesh as mesh_lib
  from agentic_rl.parallel.mesh_config import MeshSpec
  from agentic_rl.model import config as model_config
  from tests.train.tiny_config import tiny_config
  import jax
  spec = model_config.validate(tiny_config().model)  # 8 experts
  with pytest.raises(ValueError, match="config.mesh.expert=3 does not divide"):
    mesh_lib.build_mesh(MeshSpec(data=1, expert=3), spec, jax.devices() * 3)
