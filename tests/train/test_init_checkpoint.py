"""Starting a run from another run's checkpoint, and scoring the RL start like for like.

By running launch/train.py: a run started from an SFT run's checkpoint, with no step of
its own, must end on exactly that checkpoint's params; launch/evaluate.py on that
checkpoint must reproduce the run's own held-out scores.
"""

import json
import os
import shutil

import numpy as np
import pytest

from agentic_rl.train.checkpointing import Checkpointer, resolve_checkpoint
from tests.train import run_train


def test_resolve_checkpoint_accepts_workdir_folder_and_step(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "run" / "checkpoints"), async_save=False)
  for step in (3, 7):
    ckpt.save(step, {"w": np.full((2,), step, np.float32)}, extras={"step": step})
  ckpt.close()
  folder = str(tmp_path / "run" / "checkpoints")
  assert resolve_checkpoint(str(tmp_path / "run")) == (folder, 7)
  assert resolve_checkpoint(folder) == (folder, 7)
  assert resolve_checkpoint(os.path.join(folder, "3")) == (folder, 3)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    resolve_checkpoint(str(tmp_path / "missing"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
    resolve_checkpoint(str(tmp_path / "empty"))
  # Read-only: opening another run's checkpoints creates nothing.
  with pytest.raises(FileNotFoundError):
    Checkpointer(str(tmp_path / "nothing_here"), read_only=True)
  assert not (tmp_path / "nothing_here").exists()


def _train(workdir, *overrides):
  return run_train.train(workdir, "--config.rl.num_steps=0", *overrides)


def _start_scores(workdir):
  return [r for r in run_train.metrics(workdir) if "heldout_sft/solve_rate" in r]


def test_init_checkpoint_and_rescoring_a_copied_start(tmp_path):
  sft_dir = str(tmp_path / "sft")
  sft, _ = _train(sft_dir)  # tiny config: 2 SFT steps, scored on 2 held-out tasks.
  assert sft["heldout_comparable"]

  # launch/evaluate.py on the saved params, same eval settings: the run's own scores.
  out = run_train.run_module("launch.evaluate", f"--config={run_train.TINY_CONFIG}",
                             f"--checkpoint={sft_dir}", f"--workdir={tmp_path / 'eval'}")
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  scored = json.loads(out.stdout.strip().splitlines()[-1])
  samples = scored["heldout/samples_per_task"]
  assert scored["checkpoint"]["step"] == 2
  curve = scored["heldout/pass_at_k_curve"]
  assert curve["1"] == pytest.approx(sft["heldout_solve_rate_sft"])
  assert curve[str(samples)] == pytest.approx(sft["heldout_pass_at_k_sft"])
  assert scored["heldout/sharpening_headroom"] == pytest.approx(curve[str(samples)] - curve["1"])
  assert scored["heldout/mean_reward"] == pytest.approx(sft["heldout_mean_reward_sft"])
  assert len(scored["heldout/solves_per_task"]) == scored["heldout/num_tasks"]
  # A checkpoint of another model: the error names the flag and the path.
  out = run_train.run_module("launch.evaluate", f"--config={run_train.TINY_CONFIG}",
                             f"--checkpoint={sft_dir}", f"--workdir={tmp_path / 'eval2'}",
                             "--config.model.d_ff=96")
  assert out.returncode != 0
  assert f"--checkpoint={sft_dir!r}" in out.stderr, out.stderr[-3000:]

  # RL-only run from the SFT run's workdir, scored on 3 tasks: with no step of its own it
  # ends on exactly the SFT params, and records where they came from.
  rl_dir = str(tmp_path / "rl")
  rl, stdout = _train(rl_dir, f"--config.train.init_checkpoint={sft_dir}",
                      "--config.train.sft_steps=0", "--config.train.eval_tasks=3")
  assert rl["params_sha256"] == sft["params_sha256"]
  assert rl["init_checkpoint"]["step"] == 2 and rl["init_checkpoint"]["phase"] == "rl"
  assert "params from" in stdout
  assert [r["heldout_sft/num_tasks"] for r in _start_scores(rl_dir)] == [3]

  # A copied SFT checkpoint resumed under other eval settings is re-scored, not reused.
  copy_dir = tmp_path / "copy"
  shutil.copytree(os.path.join(sft_dir, "checkpoints"), copy_dir / "checkpoints")
  copied, _ = _train(str(copy_dir), "--config.train.eval_tasks=3")
  assert [r["heldout_sft/num_tasks"] for r in _start_scores(str(copy_dir))] == [3]
  assert copied["heldout_comparable"] and copied["params_sha256"] == sft["params_sha256"]


def test_init_checkpoint_errors_name_the_path(tmp_path):
  out = run_train.run_module("launch.train", f"--config={run_train.TINY_CONFIG}",
                             f"--workdir={tmp_path / 'run'}",
                             f"--config.train.init_checkpoint={tmp_path / 'nope'}")
  assert out.returncode != 0
  assert f"{tmp_path / 'nope'} does not exist" in out.stderr
