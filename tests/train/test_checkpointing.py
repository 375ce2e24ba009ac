"""Checkpoints restore exactly (state, RNG, grain position, extras) and survive kill -9."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import grain
import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.train.checkpointing import Checkpointer
from agentic_rl.train.metrics_logger import MetricsLogger


def _dataset():
  return grain.MapDataset.range(1000).shuffle(seed=7).to_iter_dataset()


def test_save_restore_round_trip(tmp_path):
  it = iter(_dataset())
  for _ in range(11):
    next(it)
  state = {"params": {"w": jnp.arange(6.0).reshape(2, 3)}, "step": jnp.int32(11),
           "rng": jax.random.key_data(jax.random.key(5))}
  ckpt = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
  ckpt.save(11, state, it, {"pass_rates": {"7": 0.5}})
  ckpt.wait()
  expected_next = [next(it) for _ in range(4)]

  fresh = iter(_dataset())
  zeros = jax.tree.map(jnp.zeros_like, state)
  step, restored, extras = Checkpointer(str(tmp_path / "ckpt")).restore(zeros, fresh)
  assert step == 11
  np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])
  np.testing.assert_array_equal(restored["rng"], state["rng"])
  assert extras == {"pass_rates": {"7": 0.5}}
  assert [next(fresh) for _ in range(4)] == expected_next


def test_keeps_last_n(tmp_path):
  ckpt = Checkpointer(str(tmp_path), max_to_keep=2)
  for step in range(1, 5):
    ckpt.save(step, {"x": jnp.float32(step)})
  ckpt.close()
  steps = sorted(int(p) for p in os.listdir(tmp_path) if p.isdigit())
  assert steps == [3, 4]


def test_empty_directory_restores_none(tmp_path):
  assert Checkpointer(str(tmp_path)).restore({"x": jnp.zeros(())}) is None


def test_kill_9_during_saves_leaves_a_whole_checkpoint(tmp_path):
  script = textwrap.dedent(f"""
      import sys, time
      sys.path.insert(0, {os.getcwd()!r})
      import jax.numpy as jnp
      from agentic_rl.train.checkpointing import Checkpointer
      ckpt = Checkpointer({str(tmp_path)!r}, max_to_keep=3)
      step = 0
      while True:
        step += 1
        ckpt.save(step, {{"x": jnp.full((256, 256), float(step))}})
        if step == 3:
          ckpt.wait()
          print("saved", flush=True)
  """)
  proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "saved"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  ckpt = Checkpointer(str(tmp_path))
  step, restored, _ = ckpt.restore({"x": jnp.zeros((256, 256))})
  assert step >= 3
  np.testing.assert_array_equal(restored["x"], np.full((256, 256), float(step)))


def test_metrics_log_drops_lines_past_resume_step(tmp_path):
  log = MetricsLogger(str(tmp_path), tensorboard=False)
  for step in range(1, 6):
    log.scalars(step, {"reward": step / 10, "not_a_scalar": "text"})
  log.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "rew')  # a line cut by kill -9
  MetricsLogger(str(tmp_path), resume_step=3, tensorboard=False).close()
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [l["step"] for l in lines] == [1, 2, 3]
  assert lines[0] == {"step": 1, "reward": 0.1}


def test_saving_a_step_again_replaces_it(tmp_path):
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(2, {"x": jnp.float32(1.0)}, extras={"phase": "sft"})
  ckpt.save(2, {"x": jnp.float32(2.0)}, extras={"phase": "rl"}, force=True)
  ckpt.wait()
  step, state, extras = ckpt.restore({"x": jnp.zeros(())})
  assert (step, float(state["x"]), extras) == (2, 2.0, {"phase": "rl"})
