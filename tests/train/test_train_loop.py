"""The main job end to end: SFT, RL, evaluation, logs, checkpoints, resume, SIGTERM.

Runs launch/train.py in subprocesses on a shrunk quickstart config. Metrics
that time things (seconds, per-second rates) differ between runs; every other
metric of a resumed run must equal the uninterrupted run's, and so must the final params.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.train.run_train import TINY_CONFIG as _CONFIG_SCRIPT
from tests.train.run_train import env as _env


def _command(workdir, *overrides):
  return [sys.executable, "-m", "launch.train", f"--config={_CONFIG_SCRIPT}",
          f"--workdir={workdir}", *overrides]


def _metrics(workdir):
  lines = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  # Wall-clock measures, and the peak of live KV bytes, which depends on how
  # trajectories happened to overlap in time (env threads), not on what they hold.
  timing = ("seconds", "per_s", "wall", "peak_kv_bytes")
  return [{k: v for k, v in l.items() if not any(t in k for t in timing)} for l in lines]


def _wait_for_metric_step(workdir, step, proc, timeout=900):
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + timeout
  while time.time() < deadline:
    assert proc.poll() is None, proc.stdout.read()
    if os.path.exists(path):
      steps = [json.loads(l)["step"] for l in open(path) if l.strip().endswith("}")]
      if steps and max(steps) >= step:
        return
    time.sleep(0.5)
  raise TimeoutError(f"step {step} never logged")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("full"))
  out = subprocess.run(_command(workdir), env=_env(), capture_output=True, text=True,
                       timeout=1800)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return workdir, out.stdout


@pytest.mark.slow
def test_run_writes_summary_logs_and_checkpoints(uninterrupted):
  workdir, stdout = uninterrupted
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  for key in ("heldout_solve_rate_sft", "heldout_solve_rate_final", "mismatch_kl_mean",
              "wall_seconds", "config", "heldout_episodes", "heldout_stderr_sft",
              "heldout_stderr_final", "rl_wall_seconds", "heldout_gain", "heldout_gain_ci95"):
    assert key in summary
  # tiny config: 2 held-out tasks x 2 samples.
  assert summary["heldout_episodes"] == 4 and 0 < summary["rl_wall_seconds"]
  low, high = summary["heldout_gain_ci95"]
  assert low <= summary["heldout_gain"] <= high
  with open(os.path.join(workdir, "curves.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert "95% interval" in stdout
  assert summary["rl_steps"] == 3 and summary["sft_steps"] == 2
  # Same forward, fp32, full replay: the sampler and learner agree to fp32 round-off.
  assert summary["mismatch_kl_mean"] < 1e-6
  metrics = _metrics(workdir)
  assert [m["step"] for m in metrics if "sft/loss" in m] == [1, 2]
  rl = [m for m in metrics if "rollout/reward_mean" in m]
  assert [m["step"] for m in rl] == [3, 4, 5]
  for key in ("mismatch/k3", "mismatch/routing_agreement", "grad_norm", "skipped_steps",
              "rollout/mean_length", "tools/calls_total", "loss"):
    assert key in rl[0], key
  raw = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert all(l["rollout/peak_kv_bytes"] > 0 for l in raw if "rollout/reward_mean" in l)
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert "rl 3/3 | reward" in stdout and "summary" in stdout
  audit = subprocess.run([sys.executable, "-m", "launch.audit", "verify",
                          os.path.join(workdir, "audit.0.jsonl")], env=_env(),
                         capture_output=True, text=True)
  assert audit.returncode == 0, audit.stdout + audit.stderr


@pytest.mark.slow
def test_kill_9_then_resume_equals_uninterrupted(uninterrupted, tmp_path):
  reference = _metrics(uninterrupted[0])
  workdir = str(tmp_path / "killed")
  proc = subprocess.Popen(_command(workdir), env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  _wait_for_metric_step(workdir, 4, proc)  # past SFT and one RL step
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  out = subprocess.run(_command(workdir), env=_env(), capture_output=True, text=True,
                       timeout=1800)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "resumed from" in out.stdout
  assert _metrics(workdir) == reference
  a = json.load(open(os.path.join(workdir, "summary.json")))
  b = json.load(open(os.path.join(uninterrupted[0], "summary.json")))
  assert a["params_sha256"] == b["params_sha256"]


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
  workdir = str(tmp_path / "term")
  proc = subprocess.Popen(_command(workdir, "--config.rl.num_steps=50"), env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  _wait_for_metric_step(workdir, 3, proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert "SIGTERM: checkpoint saved" in out
  steps = [int(p) for p in os.listdir(os.path.join(workdir, "checkpoints")) if p.isdigit()]
  logged = max(m["step"] for m in _metrics(workdir))
  assert max(steps) == logged


def _free_port():
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_to_identical_params(tmp_path):
  address = f"127.0.0.1:{_free_port()}"
  workdir = str(tmp_path / "two")
  procs = [subprocess.Popen(
      _command(workdir, "--config.rl.num_steps=2", "--config.train.num_processes=2",
               f"--config.train.process_id={i}",
               f"--config.train.coordinator_address={address}"),
      env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  digests = []
  for i, p in enumerate(procs):
    out, _ = p.communicate(timeout=1800)
    assert p.returncode == 0, out[-4000:]
    line = [l for l in out.splitlines() if l.startswith(f"process {i} final params sha256")]
    assert line, out[-3000:]
    digests.append(line[0].split()[-1])
  assert digests[0] == digests[1]
  summary = json.load(open(os.path.join(workdir, "summary.json")))
  assert summary["rl_steps"] == 2


def test_sft_schedule_spans_the_sft_steps_not_the_rl_phase(tmp_path):
  import math
  from agentic_rl.rl import train_step as train_step_lib
  from agentic_rl.train.loop import Trainer
  from tests.train.tiny_config import tiny_config

  config = tiny_config()
  config.train.sft_steps, config.train.sft_learning_rate = 300, 1e-2
  config.rl.optim.warmup_steps, config.rl.optim.decay_steps = 2, 20  # RL: a 20-step cosine.
  trainer = Trainer(config, str(tmp_path))
  try:
    spec = trainer.sft_spec(trainer._ensure_route(0))
    lr = train_step_lib.learning_rate_schedule(spec)
    end = 1e-2 * config.rl.optim.end_lr_ratio
    # Hand-computed cosine from step 2 to 300: halfway (step 151) sits midway to the end value.
    want = end + (1e-2 - end) * 0.5 * (1 + math.cos(math.pi * 149 / 298))
    assert float(lr(151)) == pytest.approx(want, rel=1e-5)
    assert float(lr(2)) == pytest.approx(1e-2, rel=1e-6)
  finally:
    trainer._route.engine.close()
    trainer._route.eval_engine.close()
    trainer.audit.close()
