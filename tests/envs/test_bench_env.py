"""launch.bench_env prints the documented JSON, and its audit log verifies."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_env_json(tmp_path):
  audit = str(tmp_path / "bench.jsonl")
  p = subprocess.run([sys.executable, "-m", "launch.bench_env", "--json", "--episodes", "6",
                      "--threads", "3", "--isolation", "fallback", "--audit_log", audit],
                     cwd=REPO, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  out = json.loads(p.stdout)
  assert out["isolation"] == "fallback" and out["episodes"] == 6
  assert out["tool_calls"] == out["audit_lines"] > 0 and out["audit_verified"] is True
  assert out["tool_calls_per_s"] > 0 and out["solve_rate"] == 1.0
  for tool in ("ls", "test", "view", "replace", "submit"):
    lat = out["latency_ms"][tool]
    assert lat["n"] > 0 and 0 <= lat["p50"] <= lat["p90"] <= lat["p99"]
  v = subprocess.run([sys.executable, "-m", "launch.audit", "verify", audit], cwd=REPO,
                     capture_output=True, text=True, timeout=60)
  assert v.returncode == 0 and f"chain of {out['tool_calls']} lines verified" in v.stdout
