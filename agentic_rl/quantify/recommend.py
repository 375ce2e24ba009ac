"""The route and stage schedule the measurements support (`launch.recommend`).

Inputs: launch.measure_mismatch's report.json (routes a and b), launch.sparse_coverage's
coverage.json and launch.throughput_report's throughput.json; any may be missing, and the
reasons say so. The rules, each reason citing its number:

  mismatch    route B is acceptable when its k3 <= MAX_K3 and its share of ratios outside
              [0.5, 2] <= MAX_OUTSIDE: its correction (TIS) then has little to correct
  throughput  route B pays when its decode step at the runs' p90 length is at least
              MIN_SPEEDUP x route A's
  coverage    the sparse layers keep enough when the indexer covers >= MIN_COVERAGE of the
              dense attention mass at the config's (block_size, topk_tokens)

Both B conditions hold: "B until step N, then A" (throughput early, consistency late;
N = SWITCH_SHARE of the RL steps, `--config.train.switch_to_route_a_at=N`). Either fails:
route A throughout. Coverage below the bar with B chosen: B, with the warning to raise k.
"""

from __future__ import annotations

MAX_K3 = 1e-3
MAX_OUTSIDE = 1e-3
MIN_SPEEDUP = 1.2
MIN_COVERAGE = 0.9
SWITCH_SHARE = 0.75


def recommend(mismatch: dict | None, coverage: dict | None, throughput: dict | None, *,
              num_steps: int, block_size: int, topk_tokens: int) -> dict:
  """{"route": "A" | "B then A", "switch_to_route_a_at": N | None, "reasons": [...],
  "flags": "--config... to add"}."""
  reasons, b_ok, b_pays = [], None, None
  routes = (mismatch or {}).get("routes", {})
  if "a" in routes and "b" in routes:
    a, b = routes["a"], routes["b"]
    b_ok = b["k3"] <= MAX_K3 and b["ratio_outside_frac"] <= MAX_OUTSIDE
    reasons.append(
        f"mismatch: route B's k3 is {b['k3']:.3g} (route A's {a['k3']:.3g}) and "
        f"{100 * b['ratio_outside_frac']:.3g}% of its ratios lie outside [0.5, 2]; "
        + ("within" if b_ok else "over") + f" the bars (k3 <= {MAX_K3:g}, "
        f"<= {100 * MAX_OUTSIDE:g}% outside).")
  else:
    reasons.append("mismatch: no measure_mismatch report with routes a and b; run "
                   "launch.measure_mismatch first.")
  projection = (throughput or {}).get("route_b_projection", {})
  if "p90" in projection:
    p = projection["p90"]
    b_pays = p["route_b_speedup"] >= MIN_SPEEDUP
    reasons.append(
        f"throughput: at the runs' p90 length of {p['length']} tokens a route B decode "
        f"step takes {p['route_b_ms']:.2f} ms against route A's {p['route_a_ms']:.2f} ms, "
        f"{p['route_b_speedup']:.2f}x; " + ("at least" if b_pays else "under")
        + f" the {MIN_SPEEDUP:g}x that pays for B.")
  else:
    reasons.append("throughput: no throughput_report with route timings; run "
                   "launch.throughput_report on a training run first.")
  covered = None
  for row in (coverage or {}).get("rows", []):
    if row["block_size"] == block_size and row["topk_tokens"] == topk_tokens:
      covered = row["coverage"]
  if covered is not None:
    reasons.append(f"coverage: at B={block_size}, k={topk_tokens} the indexer keeps "
                   f"{100 * covered:.1f}% of the dense attention mass (bar "
                   f"{100 * MIN_COVERAGE:g}%).")
  elif coverage is not None:
    reasons.append(f"coverage: the sparse_coverage grid has no row at the config's B="
                   f"{block_size}, k={topk_tokens}; add them to --block_sizes/--topk_tokens.")
  if b_ok and b_pays:
    n = max(1, int(round(SWITCH_SHARE * num_steps)))
    if covered is not None and covered < MIN_COVERAGE:
      reasons.append(f"warning: raise model.topk_tokens while on route B: "
                     f"{100 * covered:.1f}% coverage is under the bar.")
    return {"route": "B then A", "switch_to_route_a_at": n, "reasons": reasons,
            "flags": f"--config.train.switch_to_route_a_at={n}"}
  why = ("its mismatch is over the bar" if b_ok is False else
         "it does not pay at these lengths" if b_pays is False else
         "the measurements to justify it are missing")
  reasons.append(f"route A throughout: route B {why}.")
  return {"route": "A", "switch_to_route_a_at": None, "reasons": reasons,
          "flags": "--config configs/route_a_consistency.py (or --config.train."
                   "switch_to_route_a_at=0)"}


def markdown(rec: dict) -> str:
  lines = [f"# Route recommendation: {rec['route']}", ""]
  if rec["switch_to_route_a_at"] is not None:
    lines += [f"Route B until RL step {rec['switch_to_route_a_at']}, then route A: "
              f"`{rec['flags']}`.", ""]
  else:
    lines += [f"`{rec['flags']}`", ""]
  lines += [f"- {r}" for r in rec["reasons"]]
  return "\n".join(lines) + "\n"
