"""Task selection: pass-rate tracker, priorities, dynamic sampling, the revisited task pool
and its curriculum."""

import collections
import json

import numpy as np
import pytest

from agentic_rl.rl import dynamic_sampling as ds
from agentic_rl.rl import task_selection as tsel
from tests.rl import tiny_model


def test_tracker_hand_example():
  tracker = tsel.PassRateTracker(window=3, prior_pass_rate=0.5, prior_weight=1.0)
  assert tracker.pass_rate("a") == 0.5  # unseen: the prior
  tracker.update(["a"] * 4, [1.0, 0.0, 1.0, 1.0])
  # Last three outcomes [fail, pass, pass]: (2 + 0.5 * 1) / (3 + 1).
  assert tracker.pass_rate("a") == pytest.approx(0.625)
  assert tracker.attempts("a") == 3
  tracker.update(["b", "b"], [0.99, 0.2])  # below SOLVED_REWARD: both fail
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


class _Selector:
  """The selector interface DynamicSampler drives (TaskPool's), over a fixed task list:
  uniform picks, outcomes into a pass-rate tracker."""

  def __init__(self, task_ids, spec, seed=0):
    self.spec, self.tasks = spec, list(task_ids)
    self.tracker = tsel.PassRateTracker.from_spec(spec)
    self._rng = np.random.default_rng(seed)

  def sample(self, n):
    return [self.tasks[i] for i in self._rng.integers(0, len(self.tasks), n)]

  def record(self, task_ids, rewards):
    self.tracker.update(task_ids, rewards)


def _selector(task_ids, **changes):
  return _Selector(task_ids, tiny_model.rl_spec(**changes))


class _Source:
  """A GroupSource whose groups' rewards come from `rewards_fn(task, group_size)`."""

  def __init__(self, rewards_fn):
    self.rewards_fn = rewards_fn

  def generate(self, task_ids, group_size):
    return [ds.Group(t, np.array(self.rewards_fn(t, group_size), np.float64), payload=t)
            for t in task_ids]


def _generate(rewards_by_task):
  return _Source(lambda task, g: rewards_by_task[task](g))


def test_dynamic_sampling_keeps_informative_groups_and_refills():
  rewards = {"easy": lambda g: [1.0] * g, "hard": lambda g: [0.0] * g,
             "mid": lambda g: [1.0, 0.0] * (g // 2)}
  selector = _selector(list(rewards), **{"group_size": 4,
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
  selector = _selector(list(rewards), **{"group_size": 4,
                                         "task_selection.max_sampling_rounds": 2})
  groups, stats = ds.DynamicSampler(selector, _generate(rewards)).collect(3)
  assert len(groups) == 3 and stats.uninformative_filled == 3 and stats.rounds == 2


def test_dynamic_sampler_keeps_its_estimate_across_steps_and_a_resume():
  """One sampler per run: the informative-rate estimate (rate <- rate / 2 + useful share / 2
  per round) carries into the next step and over a resume, and sizes its refills. Here the
  first half of every request (rounded up) is informative, so by hand: a fresh sampler asks
  8, then ceil(4 / 0.75) = 6, then ceil(1 / 0.625) = 2, ending at 0.5625; the next step asks
  8, then ceil(4 / 0.53125) = 8."""
  selector = _selector(["t"], **{"group_size": 2, "task_selection.max_sampling_rounds": 50})
  asked = []

  class HalfInformative:
    def generate(self, task_ids, group_size):
      asked.append(len(task_ids))
      half = -(-len(task_ids) // 2)
      return [ds.Group(t, np.array([0.0, 1.0] if i < half else [1.0, 1.0])) for i, t in
              enumerate(task_ids)]

  sampler = ds.DynamicSampler(selector, HalfInformative())
  sampler.collect(8)
  assert asked == [8, 6, 2] and sampler.informative_rate == pytest.approx(0.5625)
  resumed = ds.DynamicSampler(selector, HalfInformative())
  resumed.load_state_dict(sampler.state_dict())
  asked.clear()
  resumed.collect(8)
  assert asked[:2] == [8, 8], asked


class _Scripted:
  """A GroupSource that answers request i with the informative flags script[i] (each
  group's payload is its (request, index) so a carried group can be recognised)."""

  def __init__(self, script):
    self.script, self.asked = list(script), []

  def generate(self, task_ids, group_size):
    flags = self.script[len(self.asked)]
    assert len(flags) == len(task_ids), (flags, task_ids)
    self.asked.append(len(task_ids))
    return [ds.Group(t, np.array([0.0, 1.0] if f else [1.0, 1.0]),
                     payload=(len(self.asked) - 1, i))
            for i, (t, f) in enumerate(zip(task_ids, flags))]


def test_informative_groups_beyond_the_batch_open_the_next_one():
  """By hand: step 1 asks 4 (2 informative; rate 1/2 + 2/4/2 = 0.75), then ceil(2 / 0.75)
  = 3, all informative: one beyond the batch, carried. Step 2 opens with it, asks 3 (all
  informative). After drop_carry, nothing carries and the drop is counted."""
  selector = _selector(["t"], **{"group_size": 2, "task_selection.max_sampling_rounds": 4,
                                 "task_selection.carry_informative": True})
  source = _Scripted([[1, 0, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1, 1], [1, 1, 1], [1, 1, 1]])
  sampler = ds.DynamicSampler(selector, source)
  groups, stats = sampler.collect(4)
  assert [g.payload for g in groups] == [(0, 0), (0, 2), (1, 0), (1, 1)]
  assert stats.carried_in == 0 and stats.informative_discarded == 0 and sampler.carried == 1
  groups, stats = sampler.collect(4)
  assert [g.payload for g in groups] == [(1, 2), (2, 0), (2, 1), (2, 2)]
  assert stats.carried_in == 1 and stats.groups_sampled == 3 and sampler.carried == 0
  # Four asked, four informative: nothing left over. Then a carry dropped at a checkpoint.
  groups, stats = sampler.collect(4)
  assert source.asked[-1] == 4 and sampler.carried == 0
  sampler._carry = [ds.Group("t", np.array([0.0, 1.0]), payload="old")]
  assert sampler.drop_carry() == 1 and sampler.carried == 0
  groups, stats = sampler.collect(3)
  assert stats.carried_in == 0 and stats.informative_discarded == 1
  assert "old" not in [g.payload for g in groups]


def test_the_carry_is_capped_below_a_batch_and_can_be_turned_off():
  """A second round of 7 informative groups for 2 places: 5 beyond the batch, 3 carried
  (num_groups - 1, so the next step samples), 2 discarded; off, all 5 are discarded."""
  for carry, kept_over, discarded in ((True, 3, 2), (False, 0, 5)):
    selector = _selector(["t"], **{"group_size": 2, "task_selection.max_sampling_rounds": 4,
                                   "task_selection.carry_informative": carry})
    sampler = ds.DynamicSampler(selector, _Scripted([[1, 1, 0, 0], [1] * 7,
                                                     [1] * (4 - kept_over)]))
    sampler._informative_rate = 0.1  # Then 0.05 + 0.25 = 0.3: the second round asks 7.
    groups, stats = sampler.collect(4)
    assert len(groups) == 4 and sampler.carried == kept_over
    assert stats.informative_discarded == discarded
    groups, stats = sampler.collect(4)
    assert stats.carried_in == kept_over and stats.groups_sampled == 4 - kept_over


def test_dynamic_sampling_off_keeps_everything():
  rewards = {"easy": lambda g: [1.0] * g}
  selector = _selector(["easy"], **{"group_size": 2,
                                    "task_selection.dynamic_sampling": False})
  groups, stats = ds.DynamicSampler(selector, _generate(rewards)).collect(3)
  assert len(groups) == 3 and stats.rounds == 1 and stats.groups_dropped == 0


def test_informative_mask_on_a_flat_batch():
  rewards = np.array([1, 1, 0, 1, 0.5, 0.5])
  groups = np.array([0, 0, 1, 1, 2, 2])
  assert ds.informative_mask(rewards, groups).tolist() == [False, False, True, True, False,
                                                           False]


# -- TaskPool -------------------------------------------------------------------------


def _tier(task):
  return task.split("/")[0]


class _Stream:
  """next_task(tier) -> '<tier>/0', '<tier>/1', ...: a counter per tier (`only`: always
  that tier); family(task) -> `family_of(task)`, the tier by default."""

  def __init__(self, next_index=None, *, family_of=_tier, only=None):
    self.next_index = dict(next_index or {})
    self.family = family_of
    self.only = only

  def next_task(self, tier):
    tier = self.only or tier
    k = self.next_index.get(tier, 0)
    self.next_index[tier] = k + 1
    return f"{tier}/{k}"


def _pool(stream=None, *, shard=(0, 1), seed=0, **changes):
  group = {"group_size": changes.pop("group_size")} if "group_size" in changes else {}
  spec = tiny_model.rl_spec(**group, **{f"task_selection.{k}": v for k, v in changes.items()})
  return tsel.TaskPool(spec, stream if stream is not None else _Stream(), shard=shard,
                       rng=np.random.default_rng(seed), default_tier="t")


def _pick_shares(pool, trials):
  """Picks of `trials` independent sample(1) calls from the pool's current state."""
  state = pool.state_dict()
  picks = []
  for _ in range(trials):
    pool.load_state_dict(state)  # forgets the previous trial's pick; the rng moves on
    picks.append(pool.sample(1)[0])
  return picks


@pytest.mark.parametrize("priority", ["middling", "uniform"])
def test_pool_picks_follow_priority(priority):
  # prior_weight=0: pass rates are the raw outcome means, 0 / 1 (even) and 0.5 (odd).
  pool = _pool(pool_size=8, group_size=4, prior_weight=0.0, priority_floor=0.02,
               priority=priority)
  assert pool.sample(0) == [] and pool.tasks == tuple(f"t/{i}" for i in range(8))
  ids, rewards = [], []
  for i, task in enumerate(pool.tasks):
    outcomes = [1.0, 0.0] * 8 if i % 2 else [float(i % 4 == 0)] * 16
    ids += [task] * 16
    rewards += outcomes
  pool.apply(ids, rewards)
  assert [pool.pass_rate(t) for t in pool.tasks] == [1, 0.5, 0, 0.5, 1, 0.5, 0, 0.5]
  picks = _pick_shares(pool, 3000)
  odd_share = np.mean([int(t.split("/")[1]) % 2 for t in picks])
  if priority == "middling":
    # Weights 4p(1-p) floored at 0.02: four odd tasks at 1, four even at 0.02.
    expected = 4 * 1.0 / (4 * 1.0 + 4 * 0.02)  # 0.980
    assert odd_share > 0.8 and abs(odd_share - expected) < 0.015, odd_share
    pool_priority = (4 * 1.0 + 4 * 0.02) / 8
  else:
    assert abs(odd_share - 0.5) < 0.05, odd_share
    pool_priority = 1.0
  stats = pool.selection_stats()  # of the last trial's single pick
  assert stats["selection/pool_priority_mean"] == pytest.approx(pool_priority)
  assert stats["selection/pool_pass_rate_mean"] == pytest.approx(0.5)
  picked = picks[-1]
  assert stats["selection/picked_pass_rate_mean"] == pool.pass_rate(picked)
  assert stats["selection/picked_priority_mean"] == pytest.approx(
      1.0 if priority == "uniform" or pool.pass_rate(picked) == 0.5 else 0.02)
  assert stats["selection/pool_size"] == 8 and stats["selection/picked_unseen_frac"] == 0


def test_pool_picks_are_distinct_and_stay_in_their_shard():
  pools = [_pool(_Stream(), shard=(i, 2), seed=i, pool_size=10, group_size=2)
           for i in range(2)]
  first = [set(p.sample(5)) for p in pools]
  assert all(len(f) == 5 for f in first)
  assert first[0] == {f"t/{i}" for i in (0, 2, 4, 6, 8)}  # the whole share: entries 0::2
  assert first[1] == {f"t/{i}" for i in (1, 3, 5, 7, 9)}
  # Shares spent: more picks this step top up whole blocks of 2, each shard taking its
  # own slot of every block; shard 0 asks for more than shard 1.
  more = [pools[0].sample(3), pools[1].sample(1)]
  assert set(more[0]) == {"t/10", "t/12", "t/14"} and more[1] == ["t/11"]
  assert not set(more[0]) & set(more[1]) and len(set(more[0])) == 3
  assert pools[0].selection_stats()["selection/topped_up"] == 6
  # apply() with everyone's outcomes draws the blocks shard 1 did not: identical pools.
  ids = [t for picks in first + [set(m) for m in more] for t in sorted(picks) for _ in "ab"]
  for p in pools:
    p.apply(ids, [1.0, 0.0] * (len(ids) // 2))
  assert pools[0].tasks == pools[1].tasks == tuple(f"t/{i}" for i in range(16))
  for p in pools:
    p.end_step()
  assert pools[0].tasks == pools[1].tasks and len(pools[0].tasks) == 10
  assert pools[0].state_dict() == pools[1].state_dict()
  with pytest.raises(ValueError, match="neither pooled nor next"):
    pools[0].apply(["t/999"], [1.0])


def _run_rounds(pool, rounds, n, reward_fn):
  """sample / record / apply / end_step `rounds` times; returns the picks per round."""
  history = []
  for step in range(rounds):
    picks = pool.sample(n)
    for task in picks:
      pool.record([task] * pool.spec.group_size, reward_fn(task, step, pool.spec.group_size))
    pool.apply(*zip(*pool.outcomes))
    pool.end_step()
    history.append(picks)
  return history


def test_pool_revisits_tasks_and_retires_them_after_max_visits():
  pool = _pool(pool_size=8, group_size=4, max_visits=4)
  mixed = lambda task, step, g: [1.0, 0.0] * (g // 2)  # never settles
  history = _run_rounds(pool, 50, 2, mixed)
  groups = collections.Counter(t for picks in history for t in picks)
  assert all(len(set(picks)) == 2 for picks in history)
  assert max(groups.values()) == 4  # revisited, up to max_visits groups
  spent = {t for t, c in groups.items() if c == 4}
  assert spent and not spent & set(pool.tasks)  # every task with 4 groups left...
  assert {t for t, c in groups.items() if c < 4} <= set(pool.tasks)  # ...and only those
  assert pool.selection_stats()["selection/retired"] == len(spent)
  assert len(pool.tasks) == 8 and len(groups) > 8  # replacements came from the stream


def test_pool_retires_settled_tasks_after_two_groups():
  pool = _pool(pool_size=1, group_size=4, max_visits=10)
  all_pass = lambda task, step, g: [1.0] * g
  _run_rounds(pool, 1, 1, all_pass)
  assert pool.tasks == ("t/0",) and pool.visits("t/0") == 1  # one group settles nothing
  _run_rounds(pool, 1, 1, all_pass)
  assert pool.tasks == ("t/1",) and pool.selection_stats()["selection/retired"] == 1
  assert pool.tracker.attempts("t/0") == 0  # a retired task's statistics are dropped
  mixed = lambda task, step, g: [1.0] + [0.0] * (g - 1)
  _run_rounds(pool, 3, 1, mixed)
  assert pool.tasks == ("t/1",) and pool.visits("t/1") == 3


def test_never_seen_task_starts_from_its_family_pass_rate():
  pool = _pool(pool_size=4, group_size=4, prior_pass_rate=0.5, prior_weight=1.0,
               family_prior_weight=4.0, window=64, stream=_Stream(only="a"))
  picks = pool.sample(4)
  pool.apply([t for t in picks for _ in range(4)], [0.0] * 16)
  family = (0 + 0.5 * 4.0) / (16 + 4.0)  # 16 fails, shrunk toward 0.5 by 4 outcomes: 0.1
  assert pool.families.pass_rate("a") == pytest.approx(family)
  assert pool.pass_rate("a/99") == pytest.approx(family)  # no outcome: the family's rate
  assert pool.pass_rate("a/0") == pytest.approx((0 + family * 1.0) / (4 + 1.0))
  assert pool.pass_rate("a/99") < pool.spec.task_selection.prior_pass_rate == pool.pass_rate("b/0")


def test_curriculum_promotes_once_the_window_passes_and_not_before():
  pool = _pool(pool_size=1, group_size=4, max_visits=2, curriculum=("easy", "hard"),
               curriculum_window=8, promote_pass_rate=0.75)
  assert pool.current_tier == "easy"
  steps = [[1.0] * 4, [1.0, 0.0, 0.0, 0.0], [1.0] * 4, [1.0, 1.0, 1.0, 0.0]]
  tiers = []
  for rewards in steps:
    (task,) = pool.sample(1)
    pool.apply([task] * 4, rewards)
    tiers.append(pool.current_tier)
    pool.end_step()
  # Window after each step: 4/4 (not full), 5/8, 5/8, 7/8 >= 0.75.
  assert tiers == ["easy", "easy", "easy", "hard"]
  assert pool.tasks == ("hard/0",)  # the easy task retired (2 visits); new ones are hard
  assert pool.selection_stats()["selection/tier_index"] == 1
  for _ in range(2):  # the last tier stays
    (task,) = pool.sample(1)
    pool.apply([task] * 4, [1.0] * 4)
    pool.end_step()
  assert pool.current_tier == "hard"


def test_pool_state_dict_round_trip_continues_identically():
  reward = lambda task, step, g: [float((int(task.split("/")[1]) + j + step) % 3 == 0)
                                  for j in range(g)]
  parity = lambda t: (_tier(t), int(t.split("/")[1]) % 2)
  stream = _Stream(family_of=parity)
  original = _pool(stream, pool_size=6, group_size=4, max_visits=3, curriculum=("a", "b"),
                   curriculum_window=8, promote_pass_rate=0.3)
  _run_rounds(original, 5, 3, reward)
  state = original.state_dict()
  assert json.loads(json.dumps(state)) == state  # plain JSON, string keys
  restored = _pool(_Stream(stream.next_index, family_of=parity), pool_size=6, group_size=4,
                   max_visits=3, curriculum=("a", "b"), curriculum_window=8,
                   promote_pass_rate=0.3)
  restored.load_state_dict(json.loads(json.dumps(state)))
  original.rng, restored.rng = np.random.default_rng(7), np.random.default_rng(7)
  assert restored.tasks == original.tasks and restored.current_tier == original.current_tier
  assert _run_rounds(restored, 5, 3, reward) == _run_rounds(original, 5, 3, reward)
  assert restored.state_dict() == original.state_dict()
  with pytest.raises(RuntimeError, match="mid-step"):
    original.sample(1)
    original.state_dict()


def test_pool_size_zero_draws_a_fresh_task_every_pick():
  pool = _pool(pool_size=0, group_size=2)
  assert set(pool.sample(3)) == {"t/0", "t/1", "t/2"}
  assert set(pool.sample(2)) == {"t/3", "t/4"}  # same step: still fresh
  pool.apply(["t/0", "t/0"], [1.0, 0.0])
  pool.end_step()
  assert pool.tasks == () and set(pool.sample(2)) == {"t/5", "t/6"}
  # Two processes: each takes its slot of every block of 2, as the old candidate pool did.
  shards = [_pool(_Stream(), shard=(i, 2), pool_size=0) for i in range(2)]
  assert [set(p.sample(2)) for p in shards] == [{"t/0", "t/2"}, {"t/1", "t/3"}]


def test_dynamic_sampling_draws_from_a_task_pool():
  # Even tasks always pass (uninformative), odd ones are mixed.
  pool = _pool(pool_size=4, group_size=4, max_sampling_rounds=10, priority="uniform")
  rewards = lambda task, g: ([1.0] * g if int(task.split("/")[1]) % 2 == 0
                             else [1.0, 0.0] * (g // 2))
  groups, stats = ds.DynamicSampler(pool, _Source(rewards)).collect(3)
  kept = [g.task_id for g in groups]
  assert len(set(kept)) == 3 and all(int(t.split("/")[1]) % 2 for t in kept)
  assert stats.filled_with_informative
  assert len(pool.outcomes) == 4 * stats.groups_sampled  # recorded, not yet applied
  assert pool.tracker.attempts(kept[0]) == 0
  with pytest.raises(RuntimeError, match="never applied"):
    pool.end_step()
  pool.apply(*zip(*pool.outcomes))
  assert pool.outcomes == [] and all(pool.visits(t) == 1 for t in kept)


def test_task_pool_config_defaults_and_validation():
  spec = tiny_model.rl_spec()
  assert (spec.task_selection.pool_size, spec.task_selection.max_visits, spec.task_selection.curriculum, spec.task_selection.curriculum_window,
          spec.task_selection.promote_pass_rate, spec.task_selection.family_prior_weight) == (64, 4, (), 64, 0.7, 4.0)
  spec = tiny_model.rl_spec(**{"task_selection.curriculum": ["tiny", "small"]})
  assert spec.task_selection.curriculum == ("tiny", "small") and hash(spec)
  for field, value in [("pool_size", -1), ("max_visits", 0),
                       ("curriculum", ("tiny", "")), ("curriculum", ("tiny", "tiny")),
                       ("curriculum", (1,)), ("curriculum_window", 0),
                       ("promote_pass_rate", 1.5), ("family_prior_weight", -1.0)]:
    with pytest.raises(ValueError, match=rf"config.rl.task_selection.{field}[=\[]"):
      tiny_model.rl_spec(**{f"task_selection.{field}": value})
