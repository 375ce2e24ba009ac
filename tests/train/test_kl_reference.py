"""KL to a reference from launch.train: the start params (here a params file) are the
reference, it stays frozen while the policy moves, and the KL term reads what it should."""

import jax
import numpy as np
import pytest

from agentic_rl.model import config as model_config_lib
from agentic_rl.model import transformer
from agentic_rl.train import learner_lengths
from agentic_rl.train import params_file
from agentic_rl.train.checkpointing import Checkpointer, resolve_checkpoint
from tests.train import run_train
from tests.train.tiny_config import tiny_config


def test_kl_to_the_start_params_runs_end_to_end(tmp_path):
  spec = model_config_lib.validate(tiny_config().model)
  start = transformer.Model(spec).init(jax.random.key(123))
  params_file.save_params(str(tmp_path / "base"), start, {"description": "random start"})
  workdir = str(tmp_path / "run")
  summary, stdout = run_train.train(
      workdir, "--config.train.sft_steps=0", f"--config.train.init_checkpoint={tmp_path}/base",
      "--config.rl.loss.kl_coef=0.5", "--config.rl.num_steps=2",
      "--config.rl.optim.learning_rate=1e-4", "--config.rl.optim.warmup_steps=2")
  assert summary["init_checkpoint"]["file"].endswith("base/params.safetensors")
  rl = [m for m in run_train.metrics(workdir) if "rollout/reward_mean" in m]
  assert len(rl) == 2
  # The schedule counts rollout batches, warmup is 2: the first batch's updates (2 epochs x
  # 2 minibatches) all run at half the peak, the second's at the peak.
  assert [m["learning_rate"] for m in rl] == [pytest.approx(5e-5), pytest.approx(1e-4)]
  assert [m["updates"] for m in rl] == [4, 4]
  # Learner batches pad to one of the lengths compiled before the RL clock.
  lengths = learner_lengths.learner_lengths((), tiny_config().rollout.max_len)
  assert all(m["learner/padded_length"] in lengths for m in rl), lengths
  assert "learner steps compiled" in stdout
  # The rollout's time split and every sampled episode's tokens, from the engine.
  for m in rl:
    assert m["rollout/generated_tokens"] >= m["batch/generated_tokens"] > 0
    assert 0 < m["rollout/decode_seconds"] + m["rollout/prefill_seconds"] < m["rollout/seconds"]
  kl = [m["kl_to_ref"] for m in rl]
  # The first update starts at the reference (the start params): its KL is 0, and the
  # first batch's mean stays near it; a reference other than the start reads ~1.
  assert abs(kl[0]) < 1e-3, kl
  # Then the policy moves further away from it through the second step's updates.
  assert kl[1] > kl[0], kl

  directory, step = resolve_checkpoint(workdir)
  reader = Checkpointer(directory, read_only=True)
  raw = reader._manager.restore(step)
  reader.close()
  state = raw["state"]["train"]
  for (path, ref), moved, init in zip(jax.tree_util.tree_leaves_with_path(state["ref_params"]),
                                      jax.tree.leaves(state["params"]),
                                      jax.tree.leaves(start)):
    np.testing.assert_array_equal(ref, np.asarray(init), err_msg=jax.tree_util.keystr(path))
  assert any(not np.array_equal(m, np.asarray(i))
             for m, i in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(start)))
