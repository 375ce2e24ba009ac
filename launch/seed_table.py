"""The main job once per seed, then one table: held-out solve before and after RL.

    python -m launch.seed_table --workdir /tmp/seeds --seeds 0,1,2 -- \
        --config configs/quickstart.py

Everything after `--` is passed to `python -m launch.train` unchanged; each seed runs in
DIR/seed_N with `--config.seed=N` (a rerun resumes each seed's own checkpoints). Prints
the table, then one JSON line with every row, the mean gain, and whether each seed's
gain reaches --min_gain_pp and their mean --min_mean_gain_pp.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

_WORKDIR = flags.DEFINE_string("workdir", None, "One sub-directory per seed.", required=True)
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds to run.")
_MIN_GAIN = flags.DEFINE_float("min_gain_pp", 6.0,
                               "Held-out solve gain (percentage points) each seed must reach.")
_MIN_MEAN_GAIN = flags.DEFINE_float("min_mean_gain_pp", 12.0,
                                    "Gain (percentage points) the seeds' mean must reach.")

_COLUMNS = ("seed", "sft", "final", "gain_pp", "ci95_pp", "episodes", "pass@k sft",
            "pass@k final", "retry_share sft", "retry_share final", "kl_mean", "rl_steps",
            "rl_wall_s", "wall_s", "comparable")


def seed_row(seed: int, summary: dict, min_gain_pp: float) -> dict:
  """One table row from a run's summary.json."""
  sft, final = summary["heldout_solve_rate_sft"], summary["heldout_solve_rate_final"]
  gain = None if sft is None or final is None else 100.0 * (final - sft)
  ci = summary.get("heldout_gain_ci95")
  # Of the solved held-out episodes, the share that needed a retry (train/behaviour.py).
  retry = summary.get("heldout_solved_with_retry_change") or {}
  return {"seed": seed, "sft": sft, "final": final, "gain_pp": gain,
          "retry_share sft": retry.get("before"), "retry_share final": retry.get("after"),
          "retry_share_change_ci95": retry.get("ci95"),
          "ci95_pp": None if ci is None else f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]",
          "episodes": summary.get("heldout_episodes"),
          "rl_wall_s": summary.get("rl_wall_seconds"),
          "pass@k sft": summary.get("heldout_pass_at_k_sft"),
          "pass@k final": summary.get("heldout_pass_at_k_final"),
          "kl_mean": summary.get("mismatch_kl_mean"), "rl_steps": summary.get("rl_steps"),
          "wall_s": summary.get("wall_seconds"),
          "comparable": summary.get("heldout_comparable"),
          "meets_gain": gain is not None and gain >= min_gain_pp
                        and bool(summary.get("heldout_comparable"))}


def format_table(rows: list[dict]) -> str:
  def cell(v):
    if isinstance(v, bool) or v is None:
      return str(v)
    if isinstance(v, float):
      return f"{v:.3g}" if abs(v) < 1e-3 and v else f"{v:.3f}"
    return str(v)

  cells = [list(_COLUMNS)] + [[cell(r[c]) for c in _COLUMNS] for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
  return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def main(argv):
  train_args = argv[1:]
  if not any(a.startswith("--config") and not a.startswith("--config.") for a in train_args):
    raise app.UsageError("pass the run's flags after --, at least --config FILE")
  rows = []
  for seed in (int(s) for s in _SEEDS.value):
    workdir = os.path.join(_WORKDIR.value, f"seed_{seed}")
    cmd = [sys.executable, "-m", "launch.train", *train_args, f"--config.seed={seed}",
           f"--workdir={workdir}"]
    print("running:", " ".join(cmd), flush=True)
    done = subprocess.run(cmd)
    if done.returncode != 0:
      raise SystemExit(f"seed {seed}: launch.train exited with {done.returncode}; its "
                       f"checkpoints and logs are in {workdir}")
    with open(os.path.join(workdir, "summary.json")) as f:
      rows.append(seed_row(seed, json.load(f), _MIN_GAIN.value))
  print(format_table(rows))
  print(json.dumps(verdict(rows, _MIN_GAIN.value, _MIN_MEAN_GAIN.value)))


def verdict(rows: list[dict], min_gain_pp: float, min_mean_gain_pp: float) -> dict:
  """Every row, the mean gain, and whether each seed and the mean reach their bars."""
  gains = [r["gain_pp"] for r in rows]
  mean = None if any(g is None for g in gains) else sum(gains) / len(gains)
  each = all(r["meets_gain"] for r in rows)
  return {"rows": rows, "min_gain_pp": min_gain_pp, "min_mean_gain_pp": min_mean_gain_pp,
          "mean_gain_pp": mean, "all_meet_gain": each,
          "meets_bar": each and mean is not None and mean >= min_mean_gain_pp}


if __name__ == "__main__":
  app.run(main)
