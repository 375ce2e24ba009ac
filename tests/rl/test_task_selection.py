"""Task selection: pass-rate tracker, priorities, held-out split and evaluation, dynamic
sampling."""

import numpy as np
import pytest

from agentic_rl.rl import dynamic_sampling as ds
from agentic_rl.rl import task_selection as tsel
from tests.rl import tiny_model


def test_tracker_hand_example():
  tracker = tsel.PassRateTracker(window=3, pass_threshold=1.0, prior_pass_rate=0.5,
                                 prior_weight=1.0)
  assert tracker.pass_rate("a") == 0.5  # unseen: the prior
  tracker.update(["a"] * 4, [1.0, 0.0, 1.0, 1.0])
  # Last three outcomes [fail, pass, pass]: (2 + 0.5 * 1) / (3 + 1).
  assert tracker.pass_rate("a") == pytest.approx(0.625)
  assert tracker.attempts("a") == 3
  tracker.update(["b", "b"], [0.99, 0.2])  # below the threshold: both fail
  assert tracker.pass_rate("b") == pytest.approx(0.5 / 3)
  restored = tsel.PassRateTracker(window=3, prior_weight=1.0)
  restored.load_state_dict(tracker.state_dict())
  assert restored.pass_rate("a") == tracker.pass_rate("a")
  with pytest.raises(ValueError, match="not finite"):
    tracker.update(["a"], [float("nan")])
  with pytest.raises(ValueError, match="2 task ids and 1 rewards"):
    tracker.update(["a", "b"], [1.0])


def test_task_weights_hand_example():
  p = np.array([0.0, 0.5, 1.0, 0.25])
  np.testing.assert_allclose(tsel.task_weights(p, "middling", floor=0.02), [0.02, 1, 0.02, 0.75])
  np.testing.assert_allclose(tsel.task_weights(p, "band", band_low=0.2, band_high=0.8,
                                               floor=0.02), [0.02, 1, 0.02, 1])
  np.testing.assert_allclose(tsel.task_weights(p, "uniform"), [1, 1, 1, 1])
  with pytest.raises(ValueError, match="priority mode"):
    tsel.task_weights(p, "hardest")


def test_split_is_deterministic_sized_and_stable():
  tasks = [f"task-{i}" for i in range(2000)]
  train, held = tsel.split_heldout(tasks, 0.2, seed=3)
  assert set(train) | set(held) == set(tasks) and not set(train) & set(held)
  assert 0.17 < len(held) / len(tasks) < 0.23
  assert tsel.split_heldout(tasks, 0.2, seed=3) == (train, held)
  # Adding tasks never moves an existing one across the split.
  _, held_more = tsel.split_heldout(tasks + [f"new-{i}" for i in range(100)], 0.2, seed=3)
  assert set(held) <= set(held_more)
  assert tsel.split_heldout(tasks, 0.2, seed=4)[1] != held
  with pytest.raises(ValueError, match="unique"):
    tsel.split_heldout(["a", "a"], 0.1)


def _selector(task_ids, **changes):
  spec = tiny_model.rl_spec(**{"task_selection.heldout_fraction": 0.0,
                               "task_selection.pass_threshold": 1.0, **changes})
  return tsel.TaskSelector(task_ids, spec, seed=0)


def test_selector_prefers_middling_pass_rates():
  selector = _selector(["always", "never", "half"])
  selector.record(["always"] * 20 + ["never"] * 20 + ["half"] * 20,
                  [1.0] * 20 + [0.0] * 20 + [1.0, 0.0] * 10)
  counts = {"always": 0, "never": 0, "half": 0}
  for _ in range(2000):
    counts[selector.sample(1)[0]] += 1
  # Weights: half ~1, always/never 4p(1-p) ~0.09 (prior-shrunk), so 'half' dominates.
  assert counts["half"] > 0.75 * 2000, counts
  picks = selector.sample(7)
  assert len(picks) == 7 and set(picks) == {"always", "never", "half"}


def test_heldout_tasks_are_never_trained_and_evaluated_apart():
  spec = tiny_model.rl_spec(**{"task_selection.heldout_fraction": 0.3})
  tasks = [f"t{i}" for i in range(50)]
  selector = tsel.TaskSelector(tasks, spec)
  assert selector.heldout_tasks and not set(selector.sample(200)) & set(selector.heldout_tasks)
  with pytest.raises(ValueError, match="held-out"):
    selector.record([selector.heldout_tasks[0]], [1.0])

  def run_task(task, n):  # task t{i} passes its first i % 3 samples of n
    i = int(task[1:])
    return [1.0 if k < i % 3 else 0.25 for k in range(n)]

  result = tsel.evaluate_heldout(run_task, selector.heldout_tasks, samples_per_task=4,
                                 pass_threshold=1.0)
  passes = np.array([int(t[1:]) % 3 for t in selector.heldout_tasks])
  assert result["pass_rate"] == pytest.approx(passes.sum() / (4 * len(passes)))
  assert result["solved_frac"] == pytest.approx(np.mean(passes > 0))
  assert result["mean_reward"] == pytest.approx(np.mean(passes * 1.0 + (4 - passes) * 0.25) / 4)
  assert selector.tracker.attempts(selector.heldout_tasks[0]) == 0


def _generate(rewards_by_task):
  def generate(task_ids, group_size):
    return [ds.Group(t, np.array(rewards_by_task[t](group_size), np.float64), payload=t)
            for t in task_ids]
  return generate


def test_dynamic_sampling_keeps_informative_groups_and_refills():
  rewards = {"easy": lambda g: [1.0] * g, "hard": lambda g: [0.0] * g,
             "mid": lambda g: [1.0, 0.0] * (g // 2)}
  selector = _selector(list(rewards), **{"task_selection.group_size": 4,
                                         "task_selection.max_sampling_rounds": 50,
                                         "task_selection.priority": "uniform"})
  sampler = ds.DynamicSampler(selector, _generate(rewards))
  groups, stats = sampler.collect(5)
  assert [g.task_id for g in groups] == ["mid"] * 5
  assert stats.filled_with_informative and stats.groups_dropped > 0
  assert stats.groups_sampled >= stats.groups_dropped + 5 and stats.rounds >= 1
  # Dropped groups still taught the tracker that easy/hard are easy/hard.
  assert selector.tracker.pass_rate("easy") > 0.8 and selector.tracker.pass_rate("hard") < 0.2


def test_dynamic_sampling_tops_up_when_nothing_is_informative():
  rewards = {"easy": lambda g: [1.0] * g, "hard": lambda g: [0.0] * g}
  selector = _selector(list(rewards), **{"task_selection.group_size": 4,
                                         "task_selection.max_sampling_rounds": 2})
  groups, stats = ds.DynamicSampler(selector, _generate(rewards)).collect(3)
  assert len(groups) == 3 and stats.uninformative_filled == 3 and stats.rounds == 2


def test_dynamic_sampling_off_keeps_everything():
  rewards = {"easy": lambda g: [1.0] * g}
  selector = _selector(["easy"], **{"task_selection.group_size": 2,
                                    "task_selection.dynamic_sampling": False})
  groups, stats = ds.DynamicSampler(selector, _generate(rewards)).collect(3)
  assert len(groups) == 3 and stats.rounds == 1 and stats.groups_dropped == 0


def test_informative_mask_on_a_flat_batch():
  rewards = np.array([1, 1, 0, 1, 0.5, 0.5])
  groups = np.array([0, 0, 1, 1, 2, 2])
  assert ds.informative_mask(rewards, groups).tolist() == [False, False, True, True, False,
                                                           False]
