"""A checkpoint written before the attention params took one letter per axis (w_q_dhk, ...)
still resumes and still serves as init_checkpoint: restored under its old names, renamed."""

import os

import jax
import numpy as np
import pytest

from agentic_rl.train import params_file
from agentic_rl.train.checkpointing import Checkpointer
from agentic_rl.train.run_state import RunState
from agentic_rl.train.trainer import Trainer
from tests.train.tiny_config import tiny_config

_OLD_NAME = {new: old for old, new in params_file.LEGACY_PARAM_NAMES.items()}


def _write_old_checkpoint(trainer, config, directory):
  """A checkpoint of distinct params whose tree uses the old attention names."""
  state = trainer.routes.for_step(0).init_state(seed=123)
  ckpt = Checkpointer(directory)
  old_tree = params_file.rename_keys({"train": state}, _OLD_NAME)
  names = params_file.flatten(old_tree["train"].params)
  assert any(n.endswith("/w_q_dhk") for n in names)  # The layout really is the old one.
  ckpt.save(1, old_tree, None, RunState(phase="rl", rl_step=1).to_extras(
      trainer.state_io.fingerprint(config)), force=True)
  ckpt.close()
  return state


def test_rename_keys_reaches_params_inside_optimiser_state():
  state = {"mu": {"attn": {"w_q_dnh": 1}}, "t": ({"w_o_nhd": 2}, None)}
  assert params_file.rename_keys(state, _OLD_NAME) == {"mu": {"attn": {"w_q_dhk": 1}},
                                                       "t": ({"w_o_hkd": 2}, None)}


def test_an_old_checkpoint_loads_as_init_and_resumes(tmp_path):
  config = tiny_config()
  trainer = Trainer(config, str(tmp_path / "run"))
  try:
    old_dir = str(tmp_path / "old" / "checkpoints")
    written = _write_old_checkpoint(trainer, config, old_dir)
    params, provenance = trainer.load_params(old_dir, "config.train.init_checkpoint")
    assert provenance["step"] == 1
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(written.params)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    like = trainer.routes.for_step(0).init_state(config.seed)
    resumed, run = trainer.state_io.resume(Checkpointer(old_dir), lambda step: like,
                                           lambda step: config)
    assert run.rl_step == 1
    assert jax.tree.structure(resumed) == jax.tree.structure(like)
    for got, want in zip(jax.tree.leaves(resumed.opt_state), jax.tree.leaves(written.opt_state)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  finally:
    trainer.close()


def test_a_checkpoint_of_another_model_still_names_what_differs(tmp_path):
  config = tiny_config()
  trainer = Trainer(config, str(tmp_path / "run"))
  try:
    old_dir = str(tmp_path / "old" / "checkpoints")
    _write_old_checkpoint(trainer, config, old_dir)
  finally:
    trainer.close()
  config.model.value_head = True  # A param tree with a critic the checkpoint lacks.
  other = Trainer(config, str(tmp_path / "run2"))
  try:
    with pytest.raises(RuntimeError, match="could not restore checkpoint step 1"):
      other.load_params(old_dir, "--checkpoint")
  finally:
    other.close()
  assert os.path.isdir(old_dir)
