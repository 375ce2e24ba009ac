"""MetricsLogger: numbers as themselves, arrays as one scalar per entry, nothing dropped."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.rl import mismatch
from agentic_rl.train.metrics_logger import MetricsLogger


def _lines(workdir):
  return [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]


def test_arrays_become_one_scalar_per_entry(tmp_path):
  log = MetricsLogger(str(tmp_path), tensorboard=False)
  logged = log.scalars(3, {"loss": jnp.float32(0.5), "by_turn/k3": np.array([0.1, 0.2]),
                           "grid": np.arange(4.0).reshape(2, 2), "flag": np.bool_(True),
                           "bad": float("nan"), "none": None, "text": "route_b",
                           "half": jnp.array([1.5, 2.0], jnp.bfloat16)})
  log.close()
  want = {"loss": 0.5, "by_turn/k3/0": 0.1, "by_turn/k3/1": 0.2, "grid/0/0": 0.0,
          "grid/0/1": 1.0, "grid/1/0": 2.0, "grid/1/1": 3.0, "flag": 1.0, "bad": None,
          "half/0": 1.5, "half/1": 2.0}
  assert logged == want
  (line,) = _lines(tmp_path)
  assert line.pop("step") == 3
  assert line == want


def test_the_mismatch_breakdowns_reach_the_file(tmp_path):
  # finalize's arrays: per turn (3 turns) and per position bucket (2 buckets).
  sums = {"tokens": jnp.float32(4), "k1": jnp.float32(0.4), "k3": jnp.float32(0.2),
          "abs": jnp.float32(0.8), "abs_max": jnp.float32(0.5), "outside": jnp.float32(1)}
  for scope, n in (("turn/", 3), ("pos/", 2)):
    sums.update({scope + k: jnp.arange(n, dtype=jnp.float32) + 1 for k in
                 ("tokens", "k1", "k3", "abs", "abs_max", "outside")})
  log = MetricsLogger(str(tmp_path), tensorboard=False)
  log.scalars(1, mismatch.finalize(sums))
  log.close()
  (line,) = _lines(tmp_path)
  assert [line[f"mismatch/by_turn/k3/{j}"] for j in range(3)] == [1.0, 1.0, 1.0]
  assert [line[f"mismatch/by_position/num_tokens/{p}"] for p in range(2)] == [1.0, 2.0]
  assert line["mismatch/k3"] == pytest.approx(0.05)
  assert "mismatch/by_turn/k3" not in line  # As entries, not a dropped whole.
