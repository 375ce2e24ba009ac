"""launch/compare_runs.py: two runs' final scores paired per held-out task, by hand."""

import numpy as np
import pytest

from launch import compare_runs


def _summary(solves, samples=2):
  return {"heldout_solves_per_task_final": solves, "heldout_samples_per_task": samples}


def test_paired_difference_by_hand():
  ref = _summary([0, 1, 2, 2])  # means 0, .5, 1, 1: pass@1 .625
  run = _summary([1, 2, 2, 2])  # means .5, 1, 1, 1: pass@1 .875
  (row,) = compare_runs.compare(ref, {"lever": run})
  d = np.asarray([0.5, 0.5, 0.0, 0.0])
  se = d.std(ddof=1) / np.sqrt(4)
  assert row["pass@1"] == pytest.approx(0.875) and row["reference"] == pytest.approx(0.625)
  assert row["difference_pp"] == pytest.approx(25.0)
  np.testing.assert_allclose(row["ci95_pp"], [100 * (0.25 - 1.959964 * se),
                                              100 * (0.25 + 1.959964 * se)], rtol=1e-6)


def test_runs_on_other_tasks_or_without_solves_are_refused():
  with pytest.raises(ValueError, match="3 held-out tasks against the reference's 4"):
    compare_runs.compare(_summary([0, 1, 2, 2]), {"x": _summary([0, 1, 2])})
  with pytest.raises(ValueError, match="x: summary.json has no per-task"):
    compare_runs.compare(_summary([0, 1]), {"x": {}})
