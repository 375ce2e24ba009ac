"""Learning curves of an RL run as one PNG: reward, train / held-out solve rate with 95%
error bars, mismatch KL, and rollout / learner throughput per step.

The loop keeps a small JSON-able history (one `history_row` per step) and calls
`write_curves` on it; the figure is drawn with the Agg canvas directly, so it needs no
display and leaves pyplot's global state alone.
"""

from __future__ import annotations

import math
import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from agentic_rl.train.evaluation import Z95

# Held-out behaviour (train/behaviour.py), drawn at each evaluation: (key, label).
BEHAVIOUR_SERIES = (("heldout/multi_edit_share", "two or more edits"),
                    ("heldout/retry_success_rate", "retry success"),
                    ("heldout/wrong_submit_share", "wrong submits"),
                    ("heldout/out_of_turns_share", "out of turns"))
# Where each step's rollout time went (RolloutStats): (key, label).
TIME_SERIES = (("rollout/decode_seconds", "decode"), ("rollout/prefill_seconds", "prefill"),
               ("rollout/fork_seconds", "fork"), ("rollout/env_wait_seconds", "env wait"),
               ("learner/seconds", "learner"))
CURVE_KEYS = ("rollout/reward_mean", "rollout/solve_rate", "rollout/solve_stderr",
              "heldout/solve_rate", "heldout/solve_stderr", "mismatch/k3",
              "rollout/tokens_per_s", "learner/generated_tokens_per_s",
              *(k for k, _ in BEHAVIOUR_SERIES), *(k for k, _ in TIME_SERIES))


def history_row(step, logged: dict) -> dict:
  """{"step": step, key: float} for the curve keys present in `logged`.

  Values become plain floats (numpy / jax scalars are not JSON-able); missing keys, None
  (a share of nothing) and non-finite values are left out, so the row stays strict JSON
  and the plot, which skips them anyway, sees the same thing.
  """
  row = {"step": int(step)}
  for key in CURVE_KEYS:
    if logged.get(key) is not None:
      value = float(logged[key])
      if math.isfinite(value):
        row[key] = value
  return row


def _finite(value) -> bool:
  return value is not None and math.isfinite(float(value))


def _series(history: list[dict], key: str, err_key: str | None = None):
  """(steps, values[, stderrs]) of the rows where `key` is present and finite.

  A missing or non-finite stderr becomes NaN, which matplotlib draws as no bar rather
  than a misleading zero-width one.
  """
  rows = [r for r in history if _finite(r.get(key))]
  steps = [int(r["step"]) for r in rows]
  values = [float(r[key]) for r in rows]
  if err_key is None:
    return steps, values
  errs = [float(r[err_key]) if _finite(r.get(err_key)) else math.nan for r in rows]
  return steps, values, errs


def _finish(ax, drawn: bool, legend: bool) -> None:
  """Legend where several series share the axes; a visible note where none had data."""
  if not drawn:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
            color="gray")
  elif legend:
    ax.legend()


def _plot_lines(ax, history: list[dict], series: tuple, legend: bool) -> list[float]:
  """One labelled line per (key, label) that has data; returns every plotted value."""
  plotted = []
  for key, label in series:
    steps, values = _series(history, key)
    if steps:
      ax.plot(steps, values, marker=".", label=label)
      plotted += values
  _finish(ax, bool(plotted), legend)
  return plotted


def curves_figure(history: list[dict], *, title: str = "") -> Figure:
  """The 2x3 learning-curve figure of `history` (one dict per RL step, see CURVE_KEYS):
  (a) reward, (b) solve rates, (e) held-out behaviour on the top row; (c) mismatch,
  (d) throughput, (f) time split below.

  Each line / error-bar series carries a label (reward, train, held-out, mismatch k3,
  rollout, learner, the behaviour and time labels) so callers and tests can find it by
  name; series without data are not drawn.
  """
  if not history:
    raise ValueError("learning curves need a non-empty history (one dict per RL step)")
  for i, row in enumerate(history):
    if "step" not in row:
      raise ValueError(f"history row {i} has no 'step'; got keys {sorted(row)}")

  fig = Figure(figsize=(18, 8), layout="constrained")
  FigureCanvasAgg(fig)
  ax_reward, ax_solve, ax_behaviour, ax_kl, ax_tps, ax_time = fig.subplots(2, 3).flat

  _plot_lines(ax_reward, history, (("rollout/reward_mean", "reward"),), legend=False)
  ax_reward.set(title="(a) Rollout reward", xlabel="RL step", ylabel="mean reward")

  drawn = False
  # Train has a bar every step, so thin ones without caps keep the held-out bars readable.
  for key, label, style in (("rollout/solve_rate", "train",
                             dict(fmt=".-", capsize=0, elinewidth=0.8)),
                            ("heldout/solve_rate", "held-out",
                             dict(fmt="o--", capsize=4, elinewidth=1.5))):
    steps, values, errs = _series(history, key, key.replace("solve_rate", "solve_stderr"))
    if steps:
      ax_solve.errorbar(steps, values, yerr=[Z95 * e for e in errs], label=label, **style)
      drawn = True
  _finish(ax_solve, drawn, legend=True)
  ax_solve.set(title="(b) Solve rate (bars: ±1.96 stderr)", xlabel="RL step",
               ylabel="solve rate")

  kl = _plot_lines(ax_kl, history, (("mismatch/k3", "mismatch k3"),), legend=False)
  # The KL spans orders of magnitude, but a log axis cannot show zero or negative
  # estimates (k3 can dip below zero from rounding), so those keep a linear axis.
  if kl and min(kl) > 0:
    ax_kl.set_yscale("log")
  ax_kl.set(title="(c) Rollout / learner mismatch KL (k3)", xlabel="RL step",
            ylabel="KL estimate")

  _plot_lines(ax_tps, history, (("rollout/tokens_per_s", "rollout"),
                                ("learner/generated_tokens_per_s", "learner")), legend=True)
  ax_tps.set(title="(d) Throughput", xlabel="RL step", ylabel="tokens / s")

  # Before RL is the first point (step 0), after RL the last.
  _plot_lines(ax_behaviour, history, BEHAVIOUR_SERIES, legend=True)
  ax_behaviour.set(title="(e) Held-out behaviour", xlabel="RL step",
                   ylabel="share of episodes (retry success: of retries)")
  _plot_lines(ax_time, history, TIME_SERIES, legend=True)
  ax_time.set(title="(f) Time per RL step", xlabel="RL step", ylabel="seconds")

  for ax in fig.axes:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
  if title:
    fig.suptitle(title)
  return fig


def write_curves(history: list[dict], path: str, *, title: str = "") -> str:
  """Writes the learning curves of `history` to the PNG `path` and returns `path`."""
  fig = curves_figure(history, title=title)
  parent = os.path.dirname(path)
  if parent:
    os.makedirs(parent, exist_ok=True)
  fig.savefig(path, format="png", dpi=100)
  return path
