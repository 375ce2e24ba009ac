"""The tool-environment protocol the rollout engine drives.

One env object per trajectory, stepped from a host thread: `reset(task)`
returns the first observation, `step(action_text)` returns a `StepResult`
(a NamedTuple, so `obs, reward, done, info = env.step(a)` works too), and
`close()` (or leaving a `with` block) removes the episode's workspace.

`info` always holds: 'tool' (str | None), 'decision' ('allowed' | 'denied' |
'timeout' | 'error'), 'reason' (why, when not plainly allowed), 'process_signal'
(change in the fraction of graded tests passing this turn), 'tests_passed' and
'tests_total' (of the graded tests: the SWE env's hidden cases), 'turn', 'exit_code' (of sandboxed code, else None),
'duration_s', 'observation_truncated', 'trajectory_id', 'audit_seq',
'isolation', and, once done, 'end_reason' ('submit' | 'turn_budget' |
'time_budget').
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

END_REASONS = ("submit", "turn_budget", "time_budget")
# An episode solves its task when its reward reaches 1 (every graded test passes): what
# held-out pass@k counts and what the task pool's pass rates track.
SOLVED_REWARD = 1.0 - 1e-9


class StepResult(NamedTuple):
  observation: str
  reward: float
  done: bool
  info: dict


@runtime_checkable
class Env(Protocol):
  def reset(self, task: Any) -> str: ...

  def step(self, action_text: str) -> StepResult: ...

  def close(self) -> None: ...

  def __enter__(self) -> "Env": ...

  def __exit__(self, *exc) -> None: ...
