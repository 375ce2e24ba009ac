"""A 100-episode threaded run: its audit log verifies and has one line per tool call."""

import json
import os

from agentic_rl.envs.audit import AuditLog, verify_audit_log
from agentic_rl.envs.datasets import SweTaskSource
from launch.bench_env import run_episodes
from tests.envs.conftest import env_config


def test_audit_log_of_a_100_episode_run(tmp_path):
  path = str(tmp_path / "run.jsonl")
  src = SweTaskSource("train", ("easy", "medium", "hard"))
  tasks = [src[1000 + i] for i in range(100)]
  audit = AuditLog(path, run_id="run100")
  results = run_episodes(tasks, env_config(timeout_s=5.0), threads=4, audit_log=audit)
  audit.close()
  calls = sum(len(r.turns) for r in results)
  v = verify_audit_log(path)
  assert v.ok and v.sealed, v.message
  assert v.lines == calls and v.trajectories == 100
  with open(path) as f:
    entries = [json.loads(line) for line in f]
  # Per trajectory: turns 1..n in order, matching what the episode returned.
  by_traj = {}
  for e in entries:
    by_traj.setdefault(e["trajectory_id"], []).append(e)
  assert sorted(len(v) for v in by_traj.values()) == sorted(len(r.turns) for r in results)
  for es in by_traj.values():
    assert [e["turn"] for e in es] == list(range(1, len(es) + 1))
  assert sum(v.by_decision.values()) == calls and set(v.by_decision) == {"allowed"}
  # Deleting or editing any one line of this real log is detected at that line.
  with open(path) as f:
    lines = f.readlines()
  for k in (0, len(lines) // 2, len(lines) - 1):
    for mode in ("delete", "edit"):
      bad = lines[:]
      if mode == "delete":
        del bad[k]
      else:
        bad[k] = bad[k].replace('"allowed"', '"denied"')
      p = str(tmp_path / f"bad_{k}_{mode}.jsonl")
      with open(p, "w") as f:
        f.writelines(bad)
      if os.path.exists(path + ".seal"):
        with open(path + ".seal") as s, open(p + ".seal", "w") as d:
          d.write(s.read())
      r = verify_audit_log(p)
      assert not r.ok and r.bad_line == k + 1, (mode, k, r.message)
