"""Starting a run from another run's checkpoint, and scoring the RL start like for like.

The held-out scores are checked against hand-computed values; the init path by running
launch/train.py: a run started from an SFT run's checkpoint, with no step of its own,
must end on exactly that checkpoint's params.
"""

import os
import shutil

import numpy as np
import pytest

from agentic_rl.train.checkpointing import Checkpointer, resolve_checkpoint
from agentic_rl.train.loop import heldout_scores, heldout_solved_matrix
from tests.train import run_train


def test_heldout_scores_hand_computed():
  # 3 tasks x 2 samples, trajectories in any order: task 0 solved once, task 1 never,
  # task 2 twice (a reward just under 1 is a partial pass, not a solve).
  solved = heldout_solved_matrix([2, 0, 1, 0, 2, 1], [1.0, 0.5, 0.0, 1.0, 1.0, 0.999],
                                 num_tasks=3, samples=2)
  np.testing.assert_array_equal(solved, [[0, 1], [0, 0], [1, 1]])
  scores = heldout_scores(solved)
  assert scores["heldout/solve_rate"] == pytest.approx(3 / 6)
  assert scores["heldout/pass_at_k"] == pytest.approx(2 / 3)
  assert scores["heldout/samples_per_task"] == 2


def test_heldout_solved_matrix_rejects_a_wrong_sample_count():
  with pytest.raises(ValueError, match="expected 2 samples per task"):
    heldout_solved_matrix([0, 0, 1], [1.0, 1.0, 1.0], num_tasks=2, samples=2)
  with pytest.raises(ValueError, match="more than 1 samples"):
    heldout_solved_matrix([0, 0], [1.0, 0.0], num_tasks=1, samples=1)


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
