"""quantify/throughput_report.py on hand-written run files (the run itself: the slow
tests/train/test_train_loop.py)."""

import json

import pytest

from agentic_rl.quantify import throughput_report as tr
from configs import quickstart


def _write(path, rows):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
    f.write('{"step": 9, "cut by a kill')  # A torn last line is skipped.


EPISODES = [
    {"step": 1, "turns": 2, "prompt_tokens": 100, "model_tokens": [10, 20],
     "observation_tokens": [30], "total_tokens": 170, "end_reason": "submit", "reward": 1.0},
    {"step": 1, "turns": 1, "prompt_tokens": 100, "model_tokens": [40],
     "observation_tokens": [50], "total_tokens": 200, "end_reason": "turn_budget",
     "reward": 0.0},
]
METRICS = [
    {"step": 1, "rollout/decode_seconds": 3.0, "rollout/prefill_seconds": 1.0,
     "rollout/fork_seconds": 0.25, "rollout/env_wait_seconds": 0.5, "rollout/host_seconds": 0.5,
     "rollout/busy_slot_seconds": 30.0, "rollout/slot_seconds": 40.0},
    {"step": 2, "rollout/decode_seconds": 1.0, "rollout/prefill_seconds": 1.0,
     "rollout/env_wait_seconds": 0.5, "rollout/host_seconds": 0.5,
     "rollout/busy_slot_seconds": 10.0, "rollout/slot_seconds": 40.0},
    {"step": 3, "heldout/solve_rate": 0.5},  # Not an RL step's rollout line.
]


def test_report_by_hand(tmp_path):
  _write(tmp_path / "episodes.jsonl", EPISODES)
  _write(tmp_path / "metrics.jsonl", METRICS)
  r = tr.report(str(tmp_path), quickstart.get_config(), time_routes=False)
  d = r["distributions"]
  assert d["turns"] == {"count": 2, "mean": 1.5, "p50": 1.5, "p90": 1.9, "max": 2.0}
  assert d["model_tokens_per_turn"]["count"] == 3 and d["model_tokens_per_turn"]["mean"] == 70 / 3
  assert d["observation_tokens"]["max"] == 50 and d["total_tokens"]["p50"] == 185
  ts = r["time_split"]
  assert ts["steps"] == 2 and ts["seconds"] == {"decode": 4.0, "prefill": 2.0, "fork": 0.25,
                                                "env_wait": 1.0, "host": 1.0}
  assert ts["share"]["decode"] == 4.0 / 8.25 and ts["idle_slot_share"] == pytest.approx(0.5)
  kv = r["kv_bytes_per_slot"]
  assert kv["budget_tokens"] == 1024  # quickstart's rollout.max_len.
  # Route B's bf16 cache holds the same tokens in half the bytes of route A's fp32 one,
  # give or take the block summaries of its sparse layer.
  assert 0.4 < kv["b"]["p50"] / kv["a"]["p50"] < 0.6
  assert kv["a"]["p50"] < kv["a"]["max"] <= kv["a"]["budget"]
  md = tr.markdown(r)
  assert "| decode | 4.0 | 0.485 |" in md and "Idle slot share: 0.5" in md
  fig = tr.write_histograms(EPISODES, str(tmp_path / "h.png"))
  assert len(fig.axes) == 4 and (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_workdir_without_a_run_is_refused(tmp_path):
  with pytest.raises(FileNotFoundError, match="episodes.jsonl: not found"):
    tr.report(str(tmp_path), quickstart.get_config(), time_routes=False)
  (tmp_path / "episodes.jsonl").write_text("")
  (tmp_path / "metrics.jsonl").write_text("")
  with pytest.raises(ValueError, match="holds no episodes"):
    tr.report(str(tmp_path), quickstart.get_config(), time_routes=False)


def test_decode_step_timing_runs_for_both_routes():
  specs = tr.route_specs(quickstart.get_config())
  assert specs["a"].layer_types[-1] == "F" and specs["b"].layer_types[-1] == "G"
  out = tr.projected_gain(specs, {"p50": 100}, repeats=1)
  assert out["p50"]["length"] == 100 and out["p50"]["route_a_ms"] > 0
  assert out["p50"]["route_b_speedup"] == pytest.approx(
      out["p50"]["route_a_ms"] / out["p50"]["route_b_ms"])
