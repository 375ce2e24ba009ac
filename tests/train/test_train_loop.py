"""The main job end to end: SFT, RL, evaluation, logs, checkpoints, resume, SIGTERM.

Runs launch/train.py in subprocesses on a shrunk quickstart config. Metrics
that time things (seconds, per-second rates) differ between runs; every other
metric of a resumed run must equal the uninterrupted run's, and so must the final params.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest

from tests.train.run_train import TINY_CONFIG as _CONFIG_SCRIPT
from tests.train.run_train import env as _env


def _command(workdir, *overrides):
  return [sys.executable, "-m", "launch.train", f"--config={_CONFIG_SCRIPT}",
          f"--workdir={workdir}", *overrides]


def _metrics(workdir):
  lines = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  # Wall-clock measures, the peak of live KV bytes and the engine's device call counts:
  # they depend on how trajectories happened to overlap in time (which env threads had
  # answered when the engine batched a prefill or a decode), not on what they hold.
  timing = ("seconds", "per_s", "wall", "peak_kv_bytes", "prefill_calls", "decode_calls",
            "prefill_shape_tokens", "prefill_fill")
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
              "rollout/mean_length", "tools/calls_total", "loss",
              # The mismatch's breakdowns, one scalar per turn, position bucket and layer.
              "mismatch/by_turn/k3/0", "mismatch/by_position/abs_logp_diff_max/0",
              "mismatch/by_layer/routing_agreement/0"):
    assert key in rl[0], key
  raw = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  assert all(l["rollout/peak_kv_bytes"] > 0 for l in raw if "rollout/reward_mean" in l)
  # episodes.jsonl: one shape per sampled episode, tagged with its step.
  shapes = [json.loads(l) for l in open(os.path.join(workdir, "episodes.jsonl"))]
  for m in rl:
    mine = [e for e in shapes if e["step"] == m["step"]]
    assert len(mine) == m["rollout/episodes"]
    assert all(e["total_tokens"] >= e["prompt_tokens"] + sum(e["model_tokens"]) for e in mine)
  # Every sampled episode over the step's rollout seconds.
  assert all(l["rollout/trajectories_per_s"] == pytest.approx(
      l["rollout/episodes"] / l["rollout/seconds"]) for l in raw if "rollout/reward_mean" in l)
  assert os.listdir(os.path.join(workdir, "tensorboard"))
  assert "rl 3/3 | reward" in stdout and "summary" in stdout
  audit = subprocess.run([sys.executable, "-m", "launch.audit", "verify",
                          os.path.join(workdir, "audit.0.jsonl")], env=_env(),
                         capture_output=True, text=True)
  assert audit.returncode == 0, audit.stdout + audit.stderr
  _check_values(workdir, summary, metrics)


def _check_values(workdir, summary, metrics):
  """The run's numbers against each other, its checkpoint and hand computations."""
  from agentic_rl.train.checkpointing import Checkpointer, resolve_checkpoint
  config = summary["config"]
  rl = [m for m in metrics if "rollout/reward_mean" in m]
  # Held-out scores: the start's (logged once SFT handed over) and the last evaluation's.
  start = [m for m in metrics if "heldout_sft/solve_rate" in m]
  evals = [m for m in rl if "heldout/solve_rate" in m]
  assert [m["step"] for m in start] == [2] and [m["step"] for m in evals] == [4, 5]
  assert summary["heldout_solve_rate_sft"] == start[0]["heldout_sft/solve_rate"]
  assert summary["heldout_solve_rate_final"] == evals[-1]["heldout/solve_rate"]
  assert summary["heldout_pass_at_k_final"] == evals[-1]["heldout/pass_at_k"]
  # The gain, paired per task, by hand from the checkpoint's per-task solves.
  directory, step = resolve_checkpoint(workdir)
  reader = Checkpointer(directory, read_only=True)
  raw = reader._manager.restore(step)
  reader.close()
  extras = raw["extras"]
  before = (np.asarray(extras["heldout_sft"]["heldout/solves_per_task"])
            / extras["heldout_sft"]["heldout/samples_per_task"])
  after = (np.asarray(extras["heldout_last"]["heldout/solves_per_task"])
           / extras["heldout_last"]["heldout/samples_per_task"])
  assert len(before) == len(after) == config["train"]["eval_tasks"]
  assert before.mean() == pytest.approx(summary["heldout_solve_rate_sft"])
  assert after.mean() == pytest.approx(summary["heldout_solve_rate_final"])
  diff = after - before
  stderr = diff.std(ddof=1) / np.sqrt(len(diff))
  assert summary["heldout_gain"] == pytest.approx(diff.mean(), abs=1e-12)
  assert summary["heldout_gain_stderr"] == pytest.approx(stderr, abs=1e-12)
  assert summary["heldout_gain_ci95"] == pytest.approx(
      [diff.mean() - 1.959964 * stderr, diff.mean() + 1.959964 * stderr], abs=1e-12)
  # The summary's params are the checkpoint's: its digest recomputed from the saved arrays.
  digest = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(raw["state"]["train"]["params"]):
    digest.update(jax.tree_util.keystr(path).encode())
    digest.update(np.ascontiguousarray(leaf).tobytes())
  assert summary["params_sha256"] == digest.hexdigest()
  # Mismatch KL: the mean and max of the steps' k3.
  k3 = [m["mismatch/k3"] for m in rl]
  assert summary["mismatch_kl_mean"] == pytest.approx(np.mean(k3))
  assert summary["mismatch_kl_max"] == pytest.approx(np.max(k3))
  # Per RL step: every sampled episode counted, PPO updates, the learning rate by hand
  # (linear warmup over rollout batches, then cosine), and the loss as its terms.
  c_rl, optim = config["rl"], config["rl"]["optim"]
  episodes = config["train"]["groups_per_step"] * config["rollout"]["group_size"]
  peak, warmup = optim["learning_rate"], optim["warmup_steps"]
  # decay_steps 0: the schedule spans the RL phase, its last batch at the end rate.
  decay = optim["decay_steps"] or max(c_rl["num_steps"], warmup + 1)
  end = peak * optim["end_lr_ratio"]
  for n, m in enumerate(rl):
    # One sampling round (tiny config): every group of the step sampled once.
    assert m["rollout/episodes"] == episodes and m["batch/episodes"] <= episodes
    assert 0 <= m["rollout/solve_rate"] <= m["rollout/reward_mean"] <= 1
    assert m["updates"] == c_rl["ppo_epochs"] * c_rl["minibatches"]
    if n + 1 < warmup:  # Step n is the schedule's update n + 1: the first one learns.
      lr = peak * (n + 1) / warmup
    else:
      lr = end + (peak - end) * 0.5 * (1 + np.cos(np.pi * (n + 1 - warmup) / (decay - warmup)))
    assert m["learning_rate"] == pytest.approx(lr, rel=1e-5, abs=1e-12), n
    loss = m["pg_loss"] - c_rl["loss"]["entropy_coef"] * m["entropy"]
    loss += m["moe_aux_loss"] * c_rl["loss"]["moe_aux_loss"]
    loss += c_rl["loss"]["kl_coef"] * m["kl_to_ref"]
    loss += c_rl["loss"]["value_coef"] * m.get("value_loss", 0.0)
    assert m["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6), n
    assert m["clip_frac_first_epoch"] == 0.0  # Ratio 1 at each batch's first update.
    assert m["mismatch/routing_agreement"] == 1.0
  # The KL reference is SFT's final policy: RL's first update runs at it, so its KL is 0
  # to fp32 round-off (a reference other than SFT's final policy reads ~1); the batch's
  # mean is not, as its later updates move at the first warmup rate.
  assert rl[0]["learning_rate"] > 0.0 and abs(rl[0]["kl_to_ref_first_update"]) < 1e-6, rl[0]
  assert abs(rl[0]["kl_to_ref"]) < 0.1, rl[0]
  assert rl[-1]["kl_to_ref"] > rl[0]["kl_to_ref"]


@pytest.mark.slow
def test_throughput_report_reads_the_run(uninterrupted):
  workdir = uninterrupted[0]
  out = subprocess.run([sys.executable, "-m", "launch.throughput_report",
                        f"--config={_CONFIG_SCRIPT}", f"--workdir={workdir}", "--repeats=1",
                        "--json"], env=_env(), capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  rl = [m for m in _metrics(workdir) if "rollout/reward_mean" in m]
  assert report["episodes"] == sum(m["rollout/episodes"] for m in rl)
  assert report["distributions"]["turns"]["count"] == report["episodes"]
  split = report["time_split"]
  assert split["steps"] == len(rl) and split["seconds"]["decode"] > 0
  assert 0 <= split["idle_slot_share"] < 1
  assert report["route_b_projection"]["p50"]["route_b_speedup"] > 0
  for name in ("throughput.json", "throughput.md", "throughput_hist.png"):
    assert os.path.exists(os.path.join(workdir, name)), name


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
  episodes = [open(os.path.join(w, "episodes.jsonl")).read() for w in (workdir, uninterrupted[0])]
  assert episodes[0] == episodes[1]
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


def test_sft_schedule_spans_the_sft_steps_not_the_rl_phase():
  import math
  from agentic_rl.rl import config as rl_config_lib
  from agentic_rl.rl import train_step as train_step_lib
  from agentic_rl.train import config as train_config_lib
  from agentic_rl.train import sft as sft_lib
  from tests.train.tiny_config import tiny_config

  config = tiny_config()
  config.train.sft_steps = 300
  config.train.sft_optim.learning_rate, config.train.sft_optim.warmup_steps = 1e-2, 2
  config.rl.optim.warmup_steps, config.rl.optim.decay_steps = 2, 20  # RL: a 20-step cosine.
  spec = sft_lib.sft_learner_spec(
      rl_config_lib.validate(config.rl, config.model, config.rollout),
      train_config_lib.validate_train_config(config.train))
  lr = train_step_lib.learning_rate_schedule(spec)
  end = 1e-2 * config.train.sft_optim.end_lr_ratio
  # Hand-computed cosine from update 2 to 300 (update n = count + 1): update 151 is 149
  # of its 298 steps in; the peak comes at update 2, and update 1 learns at half of it.
  want = end + (1e-2 - end) * 0.5 * (1 + math.cos(math.pi * 149 / 298))
  assert float(lr(150)) == pytest.approx(want, rel=1e-5)
  assert float(lr(1)) == pytest.approx(1e-2, rel=1e-6)
  assert float(lr(0)) == pytest.approx(0.5e-2, rel=1e-6)


def test_summary_gain_is_final_minus_start_hand_computed():
  """summary.json's held-out gain on a hand example: after minus before, paired per task."""
  from agentic_rl.train import reporting
  from agentic_rl.train.run_state import RunState

  # Start: 2 samples per task, solves 0, 1, 2 (means 0, 1/2, 1; pass@1 1/2). Final: 4
  # samples, solves 2, 1, 4 (means 1/2, 1/4, 1; pass@1 7/12). Per-task differences
  # +1/2, -1/4, 0: gain +1/12; their sample variance (25 + 16 + 1) / 144 / 2 = 21/144,
  # so stderr = sqrt(21) / 12 / sqrt(3) = sqrt(7) / 12.
  start = {"heldout/solves_per_task": [0, 1, 2], "heldout/samples_per_task": 2,
           "heldout/solve_rate": 0.5}
  final = {"heldout/solves_per_task": [2, 1, 4], "heldout/samples_per_task": 4,
           "heldout/solve_rate": 7 / 12}
  run = RunState(phase="rl", heldout_sft=start, heldout_last=final, rl_step=3, sft_step=2,
                 mismatch_kl=[1e-3, float("nan"), 3e-3])
  summary = reporting.summarize(run, start_wall=time.time(),
                                params={"w": np.zeros(2, np.float32)},
                                config=ml_collections.ConfigDict({"seed": 0}), comparable=True)
  stderr = np.sqrt(7) / 12
  assert summary["heldout_gain"] == pytest.approx(1 / 12)
  assert summary["heldout_gain"] == pytest.approx(
      summary["heldout_solve_rate_final"] - summary["heldout_solve_rate_sft"])
  assert summary["heldout_gain_stderr"] == pytest.approx(stderr)
  assert summary["heldout_gain_ci95"] == pytest.approx(
      [1 / 12 - 1.959964 * stderr, 1 / 12 + 1.959964 * stderr])
  assert summary["mismatch_kl_mean"] == pytest.approx(2e-3)
  assert summary["mismatch_kl_max"] == pytest.approx(3e-3)
