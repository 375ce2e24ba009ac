"""The RL phase's task stream (seeded order per tier, lookup, families, task numbers) and the
loop's train solve-rate stderr, against hand-made expectations."""

import numpy as np
import pytest

from agentic_rl.envs import countdown
from agentic_rl.envs import registry
from agentic_rl.train.reporting import solve_stderr_by_task
from agentic_rl.train.task_stream import TIER_STRIDE, TaskStream


def _stream(seed, tiers=("long", "short")):
  spec = registry.build_spec(countdown.default_config(), max_turns=12)
  return TaskStream(registry.get("countdown"), spec, tiers, seed)


def test_the_order_is_the_seeds_and_ids_round_trip_through_numbers():
  a, b, c = _stream(0), _stream(0), _stream(1)
  first = [a.next_task("long") for _ in range(20)]
  assert first == [b.next_task("long") for _ in range(20)]  # One seed repeats.
  assert first != [c.next_task("long") for _ in range(20)]  # Another seed reorders.
  assert len(set(first)) == 20 and all(t.startswith("long/") for t in first)
  assert a.position == {"long": 20, "short": 0}
  for task_id in first[:5] + [a.next_task("short")]:
    assert a.task_id(a.number(task_id)) == task_id
  # Numbers rank tiers as the env spec lists them, whatever order the stream was given.
  rank = list(registry.build_spec(countdown.default_config()).tiers)
  for tier in ("long", "short"):
    assert a.number(f"{tier}/7") == rank.index(tier) * TIER_STRIDE + 7


def test_tasks_and_families_come_from_the_env():
  s = _stream(0)
  task_id = s.next_task("long")
  task = s.task(task_id)
  assert s.task(task_id) is task  # Built once.
  assert task == registry.get("countdown").task_source(
      registry.build_spec(countdown.default_config()), "train", "long")[
          int(task_id.split("/")[1])]
  assert s.family(task_id) == ("long", f"start_{task['start']}")
  with pytest.raises(KeyError):
    s.next_task("huge")


def test_a_tier_is_a_seeded_permutation_read_by_position_and_resumable():
  spec = registry.build_spec(countdown.default_config().to_dict() | {
      "splits": {"train_seed_start": 0, "train_size": 10, "heldout_seed_start": 100,
                 "heldout_size": 10}})
  a = TaskStream(registry.get("countdown"), spec, ("short",), seed=3)
  first = [a.next_task("short") for _ in range(10)]
  assert sorted(int(t.split("/")[1]) for t in first) == list(range(10))  # a permutation
  assert a.next_task("short") == first[0]  # then it repeats
  resumed = TaskStream(registry.get("countdown"), spec, ("short",), seed=3)
  resumed.position.update({"short": 2})  # What a checkpoint holds.
  assert resumed.next_task("short") == first[2]


def test_solve_stderr_counts_tasks_not_episodes():
  # Tasks 1 and 2, two episodes each: per-task solve rates 1.0 and 0.0.
  tasks, rewards = np.asarray([1, 1, 2, 2]), np.asarray([1.0, 1.0, 0.5, 0.0])
  assert solve_stderr_by_task(tasks, rewards) == pytest.approx(
      np.std([1.0, 0.0], ddof=1) / 2 ** 0.5)
  assert solve_stderr_by_task(np.asarray([5, 5]), np.asarray([1.0, 0.0])) == 0.0
