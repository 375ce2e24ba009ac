"""Tool-environment throughput: scripted-expert episodes stepped from a host thread pool.

  python -m launch.bench_env --json [--episodes N] [--threads T] [--tiers easy,medium,hard]
                                    [--isolation auto|bubblewrap|fallback] [--audit_log PATH]

Every episode is a real SweEnv with the sandbox on (one workspace, one
sandbox uid and one fork server each), played by agentic_rl/envs/expert.py.
Tasks are generated before the clock starts. Prints one JSON object:
isolation, episodes, threads, tool_calls, wall_s, tool_calls_per_s,
episodes_per_s, solve_rate, latency_ms per tool (p50/p90/p99/mean of the
env's own step time), the audit line count and whether the chain verified,
and the host's load average (other work on the host slows every number).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import sys
import time

import numpy as np

from agentic_rl.envs.audit import AuditLog, verify_audit_log
from agentic_rl.envs.config import default_env_config, validate_env_config
from agentic_rl.envs.expert import play_expert
from agentic_rl.envs.sandbox import resolve_isolation
from agentic_rl.envs.swe_env import SweEnv


def run_episodes(tasks, config, threads: int, audit_log: AuditLog | None = None):
  """Plays the expert on every task (one fresh env each) from `threads` threads."""
  def one(task):
    with SweEnv(config, audit_log) as env:
      return play_expert(env, task)
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    return list(pool.map(one, tasks))


def _percentiles_ms(xs) -> dict:
  a = np.asarray(xs, dtype=np.float64) * 1e3
  return {"n": int(a.size), "p50": round(float(np.percentile(a, 50)), 3),
          "p90": round(float(np.percentile(a, 90)), 3),
          "p99": round(float(np.percentile(a, 99)), 3), "mean": round(float(a.mean()), 3)}


def bench(episodes: int, threads: int, tiers: tuple[str, ...], isolation: str,
          audit_path: str | None, split: str = "train") -> dict:
  from agentic_rl.envs.datasets import SweTaskSource  # grain: seconds to import.
  config = default_env_config()
  config.sandbox.isolation = isolation
  config = validate_env_config(config)
  iso = resolve_isolation(config)  # Probe outside the timed region.
  source = SweTaskSource(split, tiers, config)
  tasks = [source[i] for i in range(episodes)]
  audit = AuditLog(audit_path, fsync=config.audit_fsync,
                   max_arg_chars=config.audit_max_arg_chars) if audit_path else AuditLog(None)
  lines_before = audit.lines
  t0 = time.perf_counter()
  results = run_episodes(tasks, config, threads, audit)
  wall = time.perf_counter() - t0
  audit.close()

  by_tool = collections.defaultdict(list)
  for r in results:
    for info in r.infos:
      by_tool[info["tool"] or "(malformed)"].append(info["duration_s"])
  calls = sum(len(r.turns) for r in results)
  out = {
      "isolation": iso.level,
      "isolation_description": iso.description,
      "episodes": episodes,
      "threads": threads,
      "tiers": list(tiers),
      "tool_calls": calls,
      "wall_s": round(wall, 3),
      "tool_calls_per_s": round(calls / wall, 2),
      "episodes_per_s": round(episodes / wall, 3),
      "solve_rate": sum(r.solved for r in results) / episodes,
      "mean_turns": round(calls / episodes, 2),
      "mean_trajectory_chars": round(sum(
          len(r.first_observation) + sum(len(a) + len(o) for a, o in r.turns)
          for r in results) / episodes, 1),
      "latency_ms": {tool: _percentiles_ms(xs) for tool, xs in sorted(by_tool.items())},
      "step_latency_ms": _percentiles_ms([d for xs in by_tool.values() for d in xs]),
      "audit_log": audit_path,
      "audit_lines": audit.lines - lines_before,
      "cpu_count": os.cpu_count(),
      "load_avg_1m": round(os.getloadavg()[0], 2),
  }
  if audit_path:
    v = verify_audit_log(audit_path)
    out["audit_verified"] = v.ok
    out["audit_message"] = v.message
  return out


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m launch.bench_env", description=__doc__.split("\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
  p.add_argument("--episodes", type=int, default=32)
  p.add_argument("--threads", type=int, default=4)
  p.add_argument("--tiers", default="easy,medium,hard")
  p.add_argument("--isolation", default="auto", choices=("auto", "bubblewrap", "fallback"))
  p.add_argument("--split", default="train", choices=("train", "heldout"))
  p.add_argument("--audit_log", default=None, help="write this run's audit log to PATH")
  a = p.parse_args(argv)
  if a.episodes < 1 or a.threads < 1:
    p.error("--episodes and --threads must be >= 1")
  tiers = tuple(t for t in a.tiers.split(",") if t)
  out = bench(a.episodes, a.threads, tiers, a.isolation, a.audit_log, a.split)
  print(json.dumps(out, sort_keys=True) if a.json else json.dumps(out, indent=2, sort_keys=True))
  return 0 if out["solve_rate"] == 1.0 and out.get("audit_verified", True) else 1


if __name__ == "__main__":
  sys.exit(main())
