"""launch/export_base: base.json's params hash is the sha256 of the params file written beside
it, not a digest copied from the run's summary (which may describe other params).

The Trainer is stubbed (known params and scores, no model run), so the export runs in a few
seconds; the slow recipe test in test_base_model.py runs it for real.
"""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np

from agentic_rl.train import params_file
from tests.train import run_train

# Runs launch.export_base's main with trainer.Trainer replaced by a stub.
_STUB = """
import sys
import numpy as np
from absl import app
from agentic_rl.train import trainer

PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}


class StubTrainer:
  def __init__(self, config, workdir):
    pass

  def load_params(self, path, source):
    return PARAMS, {"sft_best_step": 7, "sft_plateau": None}

  def score_params(self, params):
    return {"heldout/samples_per_task": 2, "heldout/pass_at_k_curve": {"1": 0.25, "2": 0.5},
            "heldout/solve_stderr": 0.1, "heldout/episodes": 8, "heldout/mean_reward": 0.3}

  def close(self):
    pass


trainer.Trainer = StubTrainer
from launch import export_base
app.run(export_base.main)
"""


def test_params_hash_is_the_written_files_sha256(tmp_path):
  run, out = tmp_path / "run", tmp_path / "base"
  run.mkdir()
  stale = "0" * 64  # What the run's summary says: must not reach base.json.
  with open(run / "summary.json", "w") as f:
    json.dump({"config": {"train": {"eval_tasks": 4, "eval_samples": 2,
                                    "eval_temperature": 1.0}},
               "sft_steps": 3, "wall_seconds": 1.5, "params_sha256": stale}, f)
  done = subprocess.run([sys.executable, "-c", _STUB, f"--workdir={run}", f"--out={out}"],
                        env=run_train.env(), capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  with open(out / "base.json") as f:
    base = json.load(f)
  with open(out / "params.safetensors", "rb") as f:
    want = hashlib.sha256(f.read()).hexdigest()
  assert base["params_sha256"] == want != stale
  # The file holds the exported params.
  like = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
  loaded = params_file.load_params(str(out), like)
  np.testing.assert_array_equal(loaded["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
  np.testing.assert_array_equal(loaded["b"], np.ones(3, np.float32))
  assert base["sft_best_step"] == 7 and base["heldout_episodes"] == 8
  assert base["params_mb"] == round(os.path.getsize(out / "params.safetensors") / 2 ** 20, 3)
