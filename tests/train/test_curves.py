"""Learning curves: the PNG is written and readable, the plotted data is the history's
(NaN and missing values skipped, error bars at +-1.96 stderr), and history_row keeps
just the curve keys as plain floats."""

import json
import math

import matplotlib.image
import numpy as np
import pytest

from agentic_rl.train.curves import CURVE_KEYS, curves_figure, history_row, write_curves

Z = 1.959964
NAN = float("nan")


def _history() -> list[dict]:
  """A short run as the loop logs it: step 0 is the held-out start point only, held-out
  again at steps 2 and 4, one NaN KL, a missing stderr and a missing learner rate."""
  return [
      {"step": 0, "heldout/solve_rate": 0.10, "heldout/solve_stderr": 0.03,
       "heldout/multi_edit_share": 0.08, "heldout/retry_success_rate": 0.20,
       "heldout/wrong_submit_share": 0.50, "heldout/out_of_turns_share": 0.11},
      {"step": 1, "rollout/reward_mean": 0.20, "rollout/solve_rate": 0.15,
       "rollout/solve_stderr": 0.05, "mismatch/k3": 1e-3, "rollout/tokens_per_s": 5000.0,
       "learner/generated_tokens_per_s": 20000.0},
      {"step": 2, "rollout/reward_mean": 0.25, "rollout/solve_rate": 0.20,
       "mismatch/k3": NAN, "rollout/tokens_per_s": 5100.0,
       "heldout/solve_rate": 0.18, "heldout/solve_stderr": 0.04},
      {"step": 3, "rollout/reward_mean": NAN, "rollout/solve_rate": 0.30,
       "rollout/solve_stderr": 0.06, "mismatch/k3": 2e-3, "rollout/tokens_per_s": 5200.0,
       "learner/generated_tokens_per_s": 21000.0},
      {"step": 4, "rollout/reward_mean": 0.40, "rollout/solve_rate": 0.35,
       "rollout/solve_stderr": 0.06, "mismatch/k3": 4e-3, "rollout/tokens_per_s": 4900.0,
       "learner/generated_tokens_per_s": 19000.0, "heldout/solve_rate": 0.30,
       "heldout/solve_stderr": NAN, "heldout/multi_edit_share": 0.31,
       "heldout/retry_success_rate": 0.45, "heldout/wrong_submit_share": 0.30,
       "heldout/out_of_turns_share": 0.12, "rollout/decode_seconds": 3.0,
       "rollout/prefill_seconds": 2.0, "rollout/env_wait_seconds": 1.5,
       "learner/seconds": 6.0},
  ]


def _by_label(items, label):
  matches = [item for item in items if item.get_label() == label]
  assert len(matches) == 1, [item.get_label() for item in items]
  return matches[0]


def _assert_errorbar(container, steps, values, stderrs):
  """The data line is (steps, values); each bar spans value +- 1.96 stderr at its step."""
  data_line, _, (bars,) = container.lines
  # errorbar keeps its data line's points as object arrays; compare them as floats.
  np.testing.assert_array_equal(np.asarray(data_line.get_xdata(), float), steps)
  np.testing.assert_allclose(np.asarray(data_line.get_ydata(), float), values)
  segments = bars.get_segments()
  assert len(segments) == len(steps)
  for seg, x, y, e in zip(segments, steps, values, stderrs):
    if math.isnan(e):
      assert seg.size == 0  # no stderr logged: no bar, rather than a zero-width one
    else:
      np.testing.assert_allclose(seg[:, 0], [x, x])
      np.testing.assert_allclose(seg[:, 1], [y - Z * e, y + Z * e])


def test_write_curves_writes_a_readable_png(tmp_path):
  path = str(tmp_path / "plots" / "curves.png")  # parent folder created on demand
  assert write_curves(_history(), path, title="tiny run") == path
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  image = matplotlib.image.imread(path)
  assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_curves_figure_plots_the_history():
  fig = curves_figure(_history(), title="tiny run")
  ax_reward, ax_solve, ax_behaviour, ax_kl, ax_tps, ax_time = fig.axes
  assert fig.get_suptitle() == "tiny run"
  for ax in fig.axes:
    assert ax.get_title() and ax.get_xlabel() == "RL step" and ax.get_ylabel()

  # (a) reward: the NaN at step 3 and the absent value at step 0 are skipped.
  (reward,) = ax_reward.lines
  np.testing.assert_array_equal(reward.get_xdata(), [1, 2, 4])
  np.testing.assert_allclose(reward.get_ydata(), [0.20, 0.25, 0.40])

  # (b) train and held-out solve rates with error bars on shared axes, with a legend.
  assert len(ax_solve.containers) == 2
  _assert_errorbar(_by_label(ax_solve.containers, "train"), [1, 2, 3, 4],
                   [0.15, 0.20, 0.30, 0.35], [0.05, NAN, 0.06, 0.06])
  _assert_errorbar(_by_label(ax_solve.containers, "held-out"), [0, 2, 4],
                   [0.10, 0.18, 0.30], [0.03, 0.04, NAN])
  legend = [t.get_text() for t in ax_solve.get_legend().get_texts()]
  assert legend == ["train", "held-out"]

  # (c) mismatch KL: all positive, so a log axis; the NaN step is skipped.
  (kl,) = ax_kl.lines
  np.testing.assert_array_equal(kl.get_xdata(), [1, 3, 4])
  np.testing.assert_allclose(kl.get_ydata(), [1e-3, 2e-3, 4e-3])
  assert ax_kl.get_yscale() == "log"

  # (d) both throughputs; the learner is missing at step 2.
  rollout = _by_label(ax_tps.lines, "rollout")
  learner = _by_label(ax_tps.lines, "learner")
  np.testing.assert_array_equal(rollout.get_xdata(), [1, 2, 3, 4])
  np.testing.assert_allclose(rollout.get_ydata(), [5000, 5100, 5200, 4900])
  np.testing.assert_array_equal(learner.get_xdata(), [1, 3, 4])
  np.testing.assert_allclose(learner.get_ydata(), [20000, 21000, 19000])
  assert [t.get_text() for t in ax_tps.get_legend().get_texts()] == ["rollout", "learner"]

  # (e) held-out behaviour before (step 0) and after (step 4) RL, one line per share.
  for label, want in (("two or more edits", [0.08, 0.31]), ("retry success", [0.20, 0.45]),
                      ("wrong submits", [0.50, 0.30]), ("out of turns", [0.11, 0.12])):
    line = _by_label(ax_behaviour.lines, label)
    np.testing.assert_array_equal(line.get_xdata(), [0, 4])
    np.testing.assert_allclose(line.get_ydata(), want)
  # (f) the time split of the one step that logged it.
  for label, want in (("decode", 3.0), ("prefill", 2.0), ("env wait", 1.5), ("learner", 6.0)):
    np.testing.assert_allclose(_by_label(ax_time.lines, label).get_ydata(), [want])


def test_kl_axis_is_linear_unless_every_value_is_positive():
  history = [{"step": 1, "mismatch/k3": 1e-3}, {"step": 2, "mismatch/k3": -1e-6},
             {"step": 3, "mismatch/k3": 0.0}]
  ax_kl = curves_figure(history).axes[3]
  assert ax_kl.get_yscale() == "linear"
  np.testing.assert_allclose(ax_kl.lines[0].get_ydata(), [1e-3, -1e-6, 0.0])


def test_panels_without_data_say_so():
  fig = curves_figure([{"step": 0, "heldout/solve_rate": 0.1}, {"step": 1}])
  ax_reward, ax_solve, ax_behaviour, ax_kl, ax_tps, ax_time = fig.axes
  for ax in (ax_reward, ax_behaviour, ax_kl, ax_tps, ax_time):
    assert not ax.lines and [t.get_text() for t in ax.texts] == ["no data"]
  # Held-out alone still plots, with no stderr logged: its bar is NaN (not drawn).
  _assert_errorbar(_by_label(ax_solve.containers, "held-out"), [0], [0.1], [NAN])
  assert not ax_solve.texts


def test_empty_or_stepless_history_raises(tmp_path):
  with pytest.raises(ValueError, match="non-empty history"):
    write_curves([], str(tmp_path / "c.png"))
  with pytest.raises(ValueError, match="non-empty history"):
    curves_figure([])
  with pytest.raises(ValueError, match="row 1 has no 'step'"):
    curves_figure([{"step": 0}, {"rollout/reward_mean": 0.5}])
  assert not (tmp_path / "c.png").exists()


def test_history_row_keeps_curve_keys_as_floats():
  logged = {"rollout/reward_mean": np.float32(0.25), "rollout/solve_rate": np.float64(0.5),
            "mismatch/k3": np.asarray(1e-3, np.float32),  # 0-d array, as device_get gives
            "learner/generated_tokens_per_s": 12000,  # a plain int
            "rollout/tokens_per_s": float("nan"),  # non-finite: dropped
            "learner/loss": 1.5, "heldout/pass_at_k": 0.7}  # not a curve key: dropped
  row = history_row(np.int64(7), logged)
  assert row == {"step": 7, "rollout/reward_mean": 0.25, "rollout/solve_rate": 0.5,
                 "mismatch/k3": pytest.approx(1e-3), "learner/generated_tokens_per_s": 12000.0}
  assert type(row["step"]) is int
  assert all(type(v) is float for k, v in row.items() if k != "step")
  assert set(row) <= {"step", *CURVE_KEYS}
  json.dumps(row, allow_nan=False)  # strict JSON
  assert history_row(0, {}) == {"step": 0}


def test_history_rows_feed_write_curves(tmp_path):
  # The loop's path: history_row per step, then write_curves on the rows.
  history = [history_row(s, {"rollout/reward_mean": np.float32(0.1 * s),
                             "rollout/solve_rate": np.float32(0.05 * s),
                             "rollout/solve_stderr": np.float32(0.01)})
             for s in range(1, 4)]
  fig = curves_figure(history)
  np.testing.assert_allclose(fig.axes[0].lines[0].get_ydata(), [0.1, 0.2, 0.3], rtol=1e-6)
  write_curves(history, str(tmp_path / "c.png"))
  assert (tmp_path / "c.png").stat().st_size > 0
