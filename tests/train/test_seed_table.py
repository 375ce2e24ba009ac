"""launch/seed_table.py: rows from hand-made summaries, and one real seed end to end."""

import json

import pytest

from launch.seed_table import format_table, seed_row, verdict
from tests.train import run_train


def _summary(sft, final, comparable=True):
  return {"heldout_solve_rate_sft": sft, "heldout_solve_rate_final": final,
          "heldout_pass_at_k_sft": 0.5, "heldout_pass_at_k_final": 0.75,
          "mismatch_kl_mean": 3e-10, "rl_steps": 40, "wall_seconds": 512.0,
          "heldout_comparable": comparable}


def test_rows_gain_and_threshold():
  met = seed_row(0, _summary(0.25, 0.4375), min_gain_pp=15.0)
  assert met["gain_pp"] == pytest.approx(18.75) and met["meets_gain"]
  short = seed_row(1, _summary(0.25, 0.375), min_gain_pp=15.0)
  assert short["gain_pp"] == pytest.approx(12.5) and not short["meets_gain"]
  # A gain measured on different eval sets does not count.
  assert not seed_row(2, _summary(0.0, 0.5, comparable=False), 15.0)["meets_gain"]
  table = format_table([met, short]).splitlines()
  assert table[0].split()[:4] == ["seed", "sft", "final", "gain_pp"]
  assert table[1].split()[:4] == ["0", "0.250", "0.438", "18.750"]
  assert "3e-10" in table[1]
  # The share of solved episodes that needed a retry, before and after, with its interval.
  retry = {"before": 0.05, "after": 0.25, "ci95": [0.1, 0.3]}
  row = seed_row(0, {**_summary(0.25, 0.4375), "heldout_solved_with_retry_change": retry}, 15.0)
  assert (row["retry_share sft"], row["retry_share final"]) == (0.05, 0.25)
  assert row["retry_share_change_ci95"] == [0.1, 0.3]


def test_verdict_needs_every_seed_and_the_mean():
  rows = [seed_row(0, _summary(0.40, 0.56), 5.0), seed_row(1, _summary(0.40, 0.46), 5.0)]
  v = verdict(rows, 5.0, 10.0)  # Gains 16 and 6: each >= 5, mean 11 >= 10.
  assert v["mean_gain_pp"] == pytest.approx(11.0) and v["all_meet_gain"] and v["meets_bar"]
  rows[1] = seed_row(1, _summary(0.40, 0.43), 5.0)  # 16 and 3: one seed short.
  assert not verdict(rows, 5.0, 10.0)["meets_bar"]
  rows = [seed_row(0, _summary(0.40, 0.48), 5.0), seed_row(1, _summary(0.40, 0.50), 5.0)]
  v = verdict(rows, 5.0, 10.0)  # 8 and 10: each >= 5, mean 9 < 10.
  assert v["all_meet_gain"] and not v["meets_bar"]


def test_one_seed_end_to_end(tmp_path):
  out = run_train.run_module("launch.seed_table", f"--workdir={tmp_path}", "--seeds=3", "--",
                             f"--config={run_train.TINY_CONFIG}", "--config.rl.num_steps=1")
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  (row,) = report["rows"]
  summary = json.load(open(tmp_path / "seed_3" / "summary.json"))
  assert summary["config"]["seed"] == 3 and row["rl_steps"] == 1
  assert row["sft"] == summary["heldout_solve_rate_sft"]
  assert row["final"] == summary["heldout_solve_rate_final"]
