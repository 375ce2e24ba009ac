"""Levers compared on the same held-out tasks: each run's final pass@1 against a reference
run's, paired per task, with the 95% interval of the difference.

    python -m launch.compare_runs --reference /tmp/lever_base --runs /tmp/lever_k2,/tmp/lever_lr

Every run must have scored the same held-out tasks with the same settings (tasks, samples,
temperature), as runs of one config do; the per-task solves come from each summary.json.
Prints one row per run, then one JSON line.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app
from absl import flags

from agentic_rl.train.evaluation import paired_gain

_REFERENCE = flags.DEFINE_string("reference", None, "The run the others are compared with.",
                                 required=True)
_RUNS = flags.DEFINE_list("runs", None, "Runs (workdirs) to compare.", required=True)
_WHICH = flags.DEFINE_enum("which", "final", ["final", "sft"],
                           "Compare the final scores, or the starting points'.")


def per_task_means(summary: dict, which: str, source: str) -> np.ndarray:
  """[tasks, 1] mean solve per held-out task of one run's `which` score."""
  solves = summary.get(f"heldout_solves_per_task_{which}")
  samples = summary.get("heldout_samples_per_task" + ("" if which == "final" else "_sft"))
  if not solves or not samples:
    raise ValueError(f"{source}: summary.json has no per-task held-out solves "
                     f"(heldout_solves_per_task_{which}); it predates them or was not scored.")
  return np.asarray(solves, np.float64)[:, None] / samples


def compare(reference: dict, runs: dict[str, dict], which: str = "final") -> list[dict]:
  """One row per run: its pass@1, the reference's, and the paired difference."""
  ref = per_task_means(reference, which, "--reference")
  rows = []
  for name, summary in runs.items():
    got = per_task_means(summary, which, name)
    if got.shape != ref.shape:
      raise ValueError(f"{name}: {got.shape[0]} held-out tasks against the reference's "
                       f"{ref.shape[0]}: compare runs scored on the same tasks.")
    diff = paired_gain(ref, got)
    rows.append({"run": name, "pass@1": float(got.mean()), "reference": float(ref.mean()),
                 "difference_pp": 100 * diff["gain"],
                 "ci95_pp": [100 * diff["ci95_low"], 100 * diff["ci95_high"]],
                 "tasks": int(ref.shape[0])})
  return rows


def _summary(workdir: str) -> dict:
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def main(argv):
  del argv
  rows = compare(_summary(_REFERENCE.value), {r: _summary(r) for r in _RUNS.value},
                 _WHICH.value)
  for r in rows:
    low, high = r["ci95_pp"]
    print(f"{r['run']}: pass@1 {r['pass@1']:.3f} vs {r['reference']:.3f} "
          f"({r['difference_pp']:+.1f} points, 95% interval [{low:+.1f}, {high:+.1f}], "
          f"{r['tasks']} tasks)")
  print(json.dumps({"reference": _REFERENCE.value, "rows": rows}))


if __name__ == "__main__":
  app.run(main)
