"""Teachers for teacher-forced rollouts: the engine feeds their actions instead of drawing.

A teacher answers `act(observation) -> action_text` once per model turn.
`ReplayTeacher` replays recorded actions, e.g. the SWE scripted expert's, so
a rollout has the task's real trajectory lengths (turns, action and
observation sizes) while every token still runs through the engine's
prefill and decode; the record then also serves as an SFT demonstration
with routing and block replay.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Sequence


class ReplayTeacher:
  """Returns the recorded actions in order; `act` past the end is an error."""

  def __init__(self, actions: Sequence[str]):
    self.actions = list(actions)
    self.turn = 0

  def act(self, observation: str) -> str:
    del observation  # The actions were recorded on the same deterministic task.
    if self.turn >= len(self.actions):
      raise RuntimeError(f"ReplayTeacher has only {len(self.actions)} recorded actions; "
                         f"turn {self.turn + 1} was asked for (raise the env's budget or "
                         "lower config.rollout.max_turns).")
    self.turn += 1
    return self.actions[self.turn - 1]


def play_on_fresh_envs(tasks: Sequence[Any], env_factory: Callable[[], Any],
                       play: Callable[[Any, Any], Any], *, threads: int = 8) -> list[Any]:
  """`play(env, task)` per task, each on a fresh env closed after it; results in task order."""
  def one(task):
    env = env_factory()
    try:
      return play(env, task)
    finally:
      env.close()

  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    return list(pool.map(one, tasks))


def record_expert_actions(tasks: Sequence[Any], env_factory: Callable[[], Any],
                          play: Callable[[Any, Any], Any], *, threads: int = 8
                          ) -> list[list[str]]:
  """Runs `play(env, task)` (e.g. envs.expert.play_expert) per task on fresh envs.

  Returns each task's action texts, in task order.
  """
  results = play_on_fresh_envs(tasks, env_factory, play, threads=threads)
  return [[action for action, _ in r.turns] for r in results]
