"""What the engine runs on its environment threads, what it takes back, what it closes.

Every env call (`env_factory`, `env.reset`, `env.step`, `env.close`) runs on the engine's
thread pool, so a slow environment holds up only its own trajectory.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable, Iterable

from agentic_rl.rollout.engine_stats import RolloutStats
from agentic_rl.rollout.episodes import Active, Group
from agentic_rl.rollout.valid_text import valid_text


def timed(fn, *args):
  start = time.perf_counter()
  result = fn(*args)
  return result, time.perf_counter() - start


def create_and_reset(env_factory: Callable[[], Any], task):
  """(env, first observation); an env whose reset raised is closed before the raise."""
  env = env_factory()
  try:
    return env, env.reset(task)
  except BaseException:
    env.close()
    raise


def take_resets(group: Group, stats: RolloutStats) -> Exception | None:
  """Gives each member its env and (valid) first observation from its finished reset;
  returns the first member's exception, if any (that env is closed already)."""
  failure = None
  for member, future in zip(group.members, group.reset_futures):
    try:
      (member.env, observation), seconds = future.result()
      member.observation = valid_text(observation)
    except Exception as e:  # env_factory or env.reset raised (the env is closed).
      failure = failure or e
      continue
    stats.env_thread_s += seconds
    stats.env_resets += 1
  return failure


def close_unfinished(slots: Iterable[Active | None], groups: Iterable[Group],
                     pool: concurrent.futures.Executor) -> None:
  """Closes the environments of trajectories left unfinished (an error, or an early stop)."""
  envs = {}
  for a in slots:
    if a is not None and a.member.env is not None:
      envs[id(a.member.env)] = a.member.env
  for g in groups:
    if g.builder is None:  # Resets not harvested: close each env once its reset returns.
      for f in g.reset_futures:
        f.add_done_callback(_close_reset_env)
    else:
      for m in g.members[g.next_member:]:
        if m.env is not None:
          envs[id(m.env)] = m.env
  for env in envs.values():
    pool.submit(env.close)


def _close_reset_env(future: concurrent.futures.Future) -> None:
  if not future.cancelled() and future.exception() is None:
    (env, _), _ = future.result()
    env.close()
