"""The RL phase's task stream: seeded order per tier, lookup, families and task numbers."""

import pytest

from agentic_rl.envs import countdown
from agentic_rl.envs import registry
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
