"""Saved params carry the layout they were trained under; loading them under another fails."""

import os

import jax
import numpy as np
import pytest

from agentic_rl import resources
from agentic_rl.model import layer_stack
from agentic_rl.train import fingerprint as fp
from agentic_rl.train.checkpointing import Checkpointer
from agentic_rl.train.run_state import RunState
from agentic_rl.train.trainer import Trainer
from configs import quickstart
from tests.train.tiny_config import tiny_config

BASE = resources.resolve(quickstart.BASE)


def test_the_shipped_base_matches_the_quickstart_layout():
  config = quickstart.get_config()
  # A params file fixes no scan layout (it holds the unrolled one): its scan_layers is None.
  assert fp.of_config_json(os.path.join(BASE, "config.json")) == {
      **fp.fingerprint(config.model, config.tokenizer), "scan_layers": None}
  assert fp.fingerprint(config.model, config.tokenizer)["layer_pattern"] == "SSSG"


def test_scan_layers_is_checked_for_checkpoints_but_not_for_params_files():
  config = quickstart.get_config()
  unrolled = fp.fingerprint(config.model, config.tokenizer)
  config.model.scan_layers = True
  scanned = fp.fingerprint(config.model, config.tokenizer)
  assert unrolled["scan_layers"] is False and scanned["scan_layers"] is True
  with pytest.raises(ValueError, match=r"scan_layers: saved False, now True"):
    fp.check(unrolled, scanned, (), "RUN")
  # A checkpoint saved before the field existed was unrolled.
  before = {k: v for k, v in unrolled.items() if k != "scan_layers"}
  assert fp.check(before, unrolled, (), "RUN") == []
  with pytest.raises(ValueError, match=r"scan_layers: saved False, now True"):
    fp.check(before, scanned, (), "RUN")
  # A params file loads into either layout.
  file = fp.of_config_json(os.path.join(BASE, "config.json"))
  assert fp.check(file, scanned, (), "BASE") == fp.check(file, unrolled, (), "BASE") == []


def test_check_names_each_differing_field_and_honours_the_override():
  config = quickstart.get_config()
  saved = fp.fingerprint(config.model, config.tokenizer)
  config.model.cache_dtype, config.model.block_size = "bfloat16", 16
  config.tokenizer.kind = "byte"
  now = fp.fingerprint(config.model, config.tokenizer)
  with pytest.raises(ValueError) as e:
    fp.check(saved, now, (), "RUN")
  message = str(e.value)
  for field in ("block_size", "cache_dtype", "tokenizer"):
    assert field in message
  assert "layer_pattern" not in message and "allow_fingerprint_change" in message
  with pytest.raises(ValueError, match=r"tokenizer: saved 'hf:"):
    fp.check(saved, now, ("block_size", "cache_dtype"), "RUN")
  assert fp.check(saved, now, ("block_size", "cache_dtype", "tokenizer"), "RUN") == [
      "block_size", "cache_dtype", "tokenizer"]
  assert fp.check(None, now, (), "RUN") == []  # Nothing recorded: nothing to compare.


@pytest.mark.parametrize("allow", [(), ("layer_pattern",)])
def test_init_checkpoint_under_another_layout_fails_unless_allowed(tmp_path, allow):
  config = tiny_config()
  config.model.layer_pattern = "SSSF"  # The base's G layers become dense F.
  config.train.allow_fingerprint_change = allow
  trainer = Trainer(config, str(tmp_path))
  try:
    if not allow:
      with pytest.raises(ValueError, match=r"layer_pattern: saved 'SSSG', now 'SSSF'"):
        trainer.load_params(quickstart.BASE, "config.train.init_checkpoint")
    else:
      _, provenance = trainer.load_params(quickstart.BASE, "init")
      assert provenance["layout_changed"] == ["layer_pattern"]
  finally:
    trainer.close()


def test_unknown_override_fields_are_refused(tmp_path):
  config = tiny_config()
  config.train.allow_fingerprint_change = ("layer_patern",)
  with pytest.raises(ValueError, match="config.train.allow_fingerprint_change"):
    Trainer(config, str(tmp_path))


def test_a_resume_under_another_layout_fails(tmp_path):
  config = tiny_config()
  config.train.sft_steps = 1
  trainer = Trainer(config, str(tmp_path))
  try:
    state = trainer.routes.for_step(0).init_state(config.seed)
    ckpt = Checkpointer(os.path.join(tmp_path, "checkpoints"))
    trainer.state_io.save(ckpt, state, RunState(phase="sft", sft_step=1), config, force=True)
    ckpt.close()
  finally:
    trainer.close()
  config.model.cache_dtype = "bfloat16"
  resumed = Trainer(config, str(tmp_path))
  try:
    with pytest.raises(ValueError, match=r"cache_dtype: saved 'float32', now 'bfloat16'"):
      resumed.run()
  finally:
    resumed.close()


def _scannable(scan_layers: bool, allow=()):
  config = tiny_config()
  config.model.num_layers, config.model.num_dense_layers = 8, 0  # Two MoE SSSG groups.
  config.model.scan_layers = scan_layers
  config.train.allow_fingerprint_change = allow
  return config


@pytest.mark.parametrize("saved_scan", [False, True])
def test_init_checkpoint_under_the_other_scan_layout_fails_clearly_or_converts(
    tmp_path, saved_scan):
  config = _scannable(saved_scan)
  trainer = Trainer(config, str(tmp_path / "saved"))
  try:
    state = trainer.routes.for_step(0).init_state(config.seed)
    ckpt = Checkpointer(os.path.join(tmp_path, "saved", "checkpoints"))
    trainer.state_io.save(ckpt, state, RunState(phase="sft", sft_step=1), config, force=True)
    ckpt.close()
  finally:
    trainer.close()
  saved = layer_stack.unstacked(jax.device_get(state.params))
  source = str(tmp_path / "saved")
  # Refused: the fingerprint names the field, before orbax sees another param tree.
  trainer = Trainer(_scannable(not saved_scan), str(tmp_path / "refused"))
  try:
    like = trainer.routes.for_step(0).init_state(0)
    with pytest.raises(ValueError, match=rf"scan_layers: saved {saved_scan}, now "
                                         rf"{not saved_scan}"):
      trainer.state_io.load_params(source, like, trainer.config, "init")
  finally:
    trainer.close()
  # Allowed: restored in the saved layout, converted to the run's.
  config = _scannable(not saved_scan, allow=("scan_layers",))
  trainer = Trainer(config, str(tmp_path / "allowed"))
  try:
    like = trainer.routes.for_step(0).init_state(0)
    loaded, where = trainer.state_io.load_params(source, like, config, "init")
    assert where["layout_changed"] == ["scan_layers"]
    assert (layer_stack.scan_of(loaded.params) is None) == saved_scan
    assert jax.tree.structure(loaded.params) == jax.tree.structure(like.params)
    got = layer_stack.unstacked(jax.device_get(loaded.params))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved)):
      np.testing.assert_array_equal(a, b)
  finally:
    trainer.close()
