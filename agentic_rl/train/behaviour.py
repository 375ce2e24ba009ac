"""What the agent does in its held-out episodes, read from its tool calls: how often it
edits more than once, retries after a failing test, and how its failures end.

An edit is an allowed call of an edit tool (`EDIT_TOOLS`). An episode *retried* when an
edit follows a `test` that itself followed an edit: it read a result of its own change and
changed the code again. Counts add over processes; rates are derived from the sums.
"""

from __future__ import annotations

import math

import numpy as np

from agentic_rl.envs.env import SOLVED_REWARD
from agentic_rl.train.evaluation import Z95

EDIT_TOOLS = ("replace",)
TEST_TOOLS = ("test",)
# Counted per evaluation, in this order (one all-gather of the vector).
COUNTS = ("episodes", "multi_edit", "retried", "retried_solved", "solved", "wrong_submits",
          "out_of_turns")


def episode_counts(traj) -> dict[str, int]:
  """This episode's contribution to each of COUNTS (0 or 1)."""
  tools = [info.get("tool") for info in traj.tool_infos
           if info and info.get("decision") == "allowed"]
  edits, retried, edited, tested_after_edit = 0, False, False, False
  for tool in tools:
    if tool in EDIT_TOOLS:
      retried = retried or tested_after_edit
      edits += 1
      edited, tested_after_edit = True, False
    elif tool in TEST_TOOLS and edited:
      tested_after_edit = True
  solved = traj.reward >= SOLVED_REWARD
  return {"episodes": 1, "multi_edit": int(edits >= 2), "retried": int(retried),
          "retried_solved": int(retried and solved), "solved": int(solved),
          "wrong_submits": int(traj.end_reason == "submit" and not solved),
          "out_of_turns": int(traj.end_reason == "turn_budget")}


def count_vector(trajs) -> np.ndarray:
  """COUNTS summed over `trajs`, int64 [len(COUNTS)]."""
  total = np.zeros(len(COUNTS), np.int64)
  for t in trajs:
    c = episode_counts(t)
    total += np.asarray([c[k] for k in COUNTS], np.int64)
  return total


def _ratio(num: int, den: int) -> float | None:
  return num / den if den else None  # None: no episode to take a share of (JSON-safe).


def behaviour_scores(counts: np.ndarray, prefix: str = "heldout/") -> dict:
  """Counts and rates from a COUNTS vector (summed over processes)."""
  c = dict(zip(COUNTS, (int(v) for v in counts)))
  n = c["episodes"]
  return {**{f"{prefix}{k}": v for k, v in c.items() if k != "episodes"},
          f"{prefix}multi_edit_share": _ratio(c["multi_edit"], n),
          f"{prefix}retried_share": _ratio(c["retried"], n),
          # Of the episodes that retried, the share solved.
          f"{prefix}retry_success_rate": _ratio(c["retried_solved"], c["retried"]),
          # Of the solved episodes, the share that needed a retry.
          f"{prefix}solved_with_retry_share": _ratio(c["retried_solved"], c["solved"]),
          f"{prefix}wrong_submit_share": _ratio(c["wrong_submits"], n),
          f"{prefix}out_of_turns_share": _ratio(c["out_of_turns"], n)}


def share_change(before: dict, after: dict, num: str, den: str,
                 prefix: str = "heldout/") -> dict | None:
  """after - before of the share num/den, with a 95% normal interval of two independent
  proportions (the two evaluations sample their episodes apart); None without data."""
  n0, n1 = before.get(prefix + den), after.get(prefix + den)
  if not n0 or not n1:
    return None
  p0, p1 = before[prefix + num] / n0, after[prefix + num] / n1
  se = math.sqrt(p0 * (1 - p0) / n0 + p1 * (1 - p1) / n1)
  return {"before": p0, "after": p1, "change": p1 - p0, "stderr": se,
          "ci95": [p1 - p0 - Z95 * se, p1 - p0 + Z95 * se], "n_before": n0, "n_after": n1}
