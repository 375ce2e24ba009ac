"""The run state a checkpoint's extras hold: every field the old loop wrote reads back;
an unknown one is refused by name."""

import pytest

from agentic_rl.train.run_state import RunState

# What train/loop.py wrote as extras before the trainer split (3a676d8), retired keys too.
_OLD_EXTRAS = {
    "phase": "rl", "sft_step": 4, "rl_step": 7, "heldout_sft": {"heldout/solve_rate": 0.5},
    "heldout_last": {"heldout/solve_rate": 0.6}, "history": [{"step": 0}],
    "rl_wall_seconds": 12.5, "mismatch_kl": [1e-4], "pool": {"tasks": []},
    "stream": {"tiny": 3}, "sft_plateau": {"best_step": 2}, "sft_best_step": 2,
    "init_checkpoint": {"file": "x"}, "fingerprint": {"layer_pattern": "SSSG"},
    "wall_seconds": 99.0, "tracker": {}}


def test_the_old_loop_s_extras_read_back():
  run, fingerprint = RunState.from_extras(dict(_OLD_EXTRAS), "CKPT")
  assert fingerprint == {"layer_pattern": "SSSG"}
  assert (run.phase, run.sft_step, run.rl_step, run.global_step) == ("rl", 4, 7, 11)
  assert run.stream == {"tiny": 3} and run.sft_best_step == 2 and run.mismatch_kl == [1e-4]
  again, _ = RunState.from_extras(run.to_extras({"layer_pattern": "SSSG"}), "CKPT")
  assert again == run


def test_an_unknown_field_is_refused_by_name():
  with pytest.raises(ValueError, match=r"CKPT: the run state holds fields \['foo'\]"):
    RunState.from_extras({"phase": "sft", "foo": 1}, "CKPT")
  with pytest.raises(ValueError, match="phase must be 'sft' or 'rl'"):
    RunState.from_extras({"phase": "warmup"}, "CKPT")
