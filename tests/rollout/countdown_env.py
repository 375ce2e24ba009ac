"""A small deterministic tool environment for the rollout tests: count down by tool calls.

Task: {"start": n, "pad": p} (pad = extra log lines in each observation, to make
observations longer than a prefill chunk). The agent must answer each turn with
`<tool_call>say N</tool_call>`, N being the next number of the countdown. Each
step returns an observation naming the expected number; the episode ends when
the agent says 0 (end_reason 'submit') and the reward is the fraction of turns
answered right. process_signal is 1 for a right answer, 0 otherwise.
"""

from __future__ import annotations

import dataclasses
import re
import threading

_CALL_RE = re.compile(r"<tool_call>\s*say\s+(-?\d+)\s*</tool_call>")


@dataclasses.dataclass
class StepResult:
  observation: str
  reward: float
  done: bool
  info: dict


class CountdownEnv:
  system_prompt = "You count down. Answer with <tool_call>say N</tool_call>."

  def __init__(self, step_hook=None):
    self.step_hook = step_hook  # Called as step_hook(env) at the start of each step.
    self.actions: list[str] = []
    self.observations: list[str] = []
    self.closed = False
    self._lock = threading.Lock()

  def reset(self, task) -> str:
    self.task = task
    self.expected = task["start"]
    self.right = 0
    obs = f"Count down from {task['start']}. Say {self.expected} first."
    self.observations.append(obs)
    return obs

  def _pad(self, turn: int) -> str:
    return "".join(f"\nlog {turn}.{i}: ok" for i in range(self.task.get("pad", 0)))

  def step(self, action_text: str) -> StepResult:
    if self.step_hook is not None:
      self.step_hook(self)
    self.actions.append(action_text)
    turn = len(self.actions)
    match = _CALL_RE.search(action_text)
    said = int(match.group(1)) if match else None
    right = said == self.expected
    self.right += right
    if right and self.expected == 0:
      obs = "Done."
      result = StepResult(obs, self.right / turn, True,
                          {"tool": "say", "decision": "allowed", "process_signal": 1.0,
                           "end_reason": "submit"})
    else:
      if right:
        self.expected -= 1
      what = "no tool call" if match is None else f"you said {said}"
      obs = f"{'Right' if right else 'Wrong'} ({what}). Say {self.expected}.{self._pad(turn)}"
      result = StepResult(obs, 0.0, False,
                          {"tool": "say" if match else None,
                           "decision": "allowed" if match else "error",
                           "process_signal": float(right)})
    self.observations.append(result.observation)
    return result

  def close(self) -> None:
    self.closed = True


class CountdownTeacher:
  """Answers every turn right; `act(observation)` reads the number to say from it."""

  def __init__(self, task, *, eos_after: int | None = None, eos_text: str = "<|eos|>"):
    self.turn = 0
    self.eos_after = eos_after
    self.eos_text = eos_text

  def act(self, observation: str) -> str:
    self.turn += 1
    number = re.findall(r"Say (-?\d+)", observation)[-1]
    text = f"ok <tool_call>say {number}</tool_call>"
    if self.eos_after is not None and self.turn >= self.eos_after:
      text += self.eos_text
    return text
