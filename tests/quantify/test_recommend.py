"""quantify/recommend.py: each rule on hand-made reports; launch.recommend's files."""

import json

from agentic_rl.quantify import recommend as rc
from tests.quantify.launch_command import run_launch


def _mismatch(k3_b, outside_b=0.0):
  return {"routes": {"a": {"k3": 1e-13, "ratio_outside_frac": 0.0},
                     "b": {"k3": k3_b, "ratio_outside_frac": outside_b}}}


def _throughput(speedup):
  return {"route_b_projection": {"p90": {"length": 700, "route_a_ms": 10.0 * speedup,
                                         "route_b_ms": 10.0, "route_b_speedup": speedup}}}


COVERAGE = {"rows": [{"block_size": 8, "topk_tokens": 64, "coverage": 0.95}]}
KW = dict(num_steps=40, block_size=8, topk_tokens=64)


def test_b_then_a_when_b_is_close_and_pays():
  rec = rc.recommend(_mismatch(1e-7), COVERAGE, _throughput(1.5), **KW)
  assert rec["route"] == "B then A" and rec["switch_to_route_a_at"] == 30
  assert rec["flags"] == "--config.train.switch_to_route_a_at=30"
  text = " ".join(rec["reasons"])
  assert "k3 is 1e-07" in text and "1.50x" in text and "95.0%" in text


def test_a_when_b_drifts_or_does_not_pay_or_is_unmeasured():
  drift = rc.recommend(_mismatch(5e-3), COVERAGE, _throughput(1.5), **KW)
  assert drift["route"] == "A" and "mismatch is over the bar" in drift["reasons"][-1]
  outside = rc.recommend(_mismatch(1e-7, outside_b=0.01), COVERAGE, _throughput(1.5), **KW)
  assert outside["route"] == "A"
  slow = rc.recommend(_mismatch(1e-7), COVERAGE, _throughput(1.1), **KW)
  assert slow["route"] == "A" and "does not pay" in slow["reasons"][-1]
  assert "1.10x; under the 1.2x" in slow["reasons"][1]
  none = rc.recommend(None, None, None, **KW)
  assert none["route"] == "A" and "run launch.measure_mismatch first" in none["reasons"][0]
  assert "run launch.throughput_report" in none["reasons"][1]


def test_low_coverage_warns_on_route_b():
  low = {"rows": [{"block_size": 8, "topk_tokens": 64, "coverage": 0.7}]}
  rec = rc.recommend(_mismatch(1e-7), low, _throughput(1.5), **KW)
  assert rec["route"] == "B then A" and "raise model.topk_tokens" in rec["reasons"][-1]
  other = rc.recommend(_mismatch(1e-7), {"rows": []}, _throughput(1.5), **KW)
  assert "no row at the config's B=8, k=64" in " ".join(other["reasons"])


def test_the_command_reads_the_reports(tmp_path):
  (tmp_path / "report.json").write_text(json.dumps(_mismatch(1e-7)))
  (tmp_path / "coverage.json").write_text(json.dumps(COVERAGE))
  (tmp_path / "throughput.json").write_text(json.dumps(_throughput(1.5)))
  out = run_launch("recommend", "--workdir", str(tmp_path), "--config.model.topk_tokens=64",
                   "--config.rl.num_steps=34", "--json")
  assert out.returncode == 0, out.stderr[-2000:]
  rec = json.loads(out.stdout.strip().splitlines()[-1])
  assert rec["route"] == "B then A" and rec["switch_to_route_a_at"] == 26  # 0.75 x 34.
  assert (tmp_path / "recommendation.md").read_text().startswith(
      "# Route recommendation: B then A")
