"""A small deterministic tool environment: count down by tool calls.

The second env behind agentic_rl/envs/registry.py, with its own tasks, tiers and expert: a
cheap end-to-end check of the trainer's env seam, and the rollout tests' env.

Task: {"start": n, "pad": p, "tier": name} (pad = extra log lines in each observation, to
make observations longer than a prefill chunk). The agent answers each turn with
`<tool_call>say N</tool_call>`, N being the next number of the countdown. Each step returns
an observation naming the expected number; the episode ends when the agent says 0
(end_reason 'submit'), and the reward is the fraction of turns answered right. The
process signal is 1 for a right answer, 0 otherwise. The turn budget ends it otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from agentic_rl.config_schema import check, derived, to_config_dict
from agentic_rl.envs.config import SplitsSpec
from agentic_rl.envs.env import StepResult

_CALL_RE = re.compile(r"<tool_call>\s*say\s+(-?\d+)\s*</tool_call>")


@dataclasses.dataclass(frozen=True)
class CountdownTier:
  min_start: int  # Tasks start from a number in [min_start, max_start].
  max_start: int
  pad: int = 0  # Log lines added to each observation.

  def __post_init__(self):
    check(self.min_start >= 0, "min_start", self.min_start, "an integer >= 0")
    check(self.max_start >= self.min_start, "max_start", self.max_start,
          f"an integer >= min_start={self.min_start}")
    check(self.pad >= 0, "pad", self.pad, "an integer >= 0")


def _default_tiers() -> dict[str, CountdownTier]:
  return {"short": CountdownTier(1, 3), "long": CountdownTier(4, 8, pad=2)}


@dataclasses.dataclass(frozen=True)
class CountdownSpec:
  name: str = "countdown"
  tiers: dict[str, CountdownTier] = dataclasses.field(default_factory=_default_tiers)
  default_tier: str = "short"
  max_turns: int = derived(64, "config.rollout.max_turns")
  splits: SplitsSpec = SplitsSpec()

  def __post_init__(self):
    check(bool(self.tiers), "tiers", self.tiers, "at least one tier")
    check(self.default_tier in self.tiers, "default_tier", self.default_tier,
          f"one of the tiers {sorted(self.tiers)}")
    check(self.max_turns > 0, "max_turns", self.max_turns, "a positive integer")


def default_config():
  """`config.env` for the countdown env."""
  return to_config_dict(CountdownSpec())


class CountdownTaskSource:
  """The tasks of one split and tier, by index: the same index gives the same task."""

  def __init__(self, spec: CountdownSpec, split: str, tier: str):
    if split not in ("train", "heldout"):
      raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if tier not in spec.tiers:
      raise ValueError(f"unknown tier {tier!r}; tiers: {sorted(spec.tiers)}")
    s = spec.splits
    self._start, self._size = ((s.train_seed_start, s.train_size) if split == "train"
                               else (s.heldout_seed_start, s.heldout_size))
    self._tier_name, self._tier = tier, spec.tiers[tier]

  def __len__(self) -> int:
    return self._size

  def __getitem__(self, index: int) -> dict:
    if not 0 <= index < self._size:
      raise IndexError(f"task {index} outside [0, {self._size})")
    rng = np.random.default_rng(self._start + index)
    start = int(rng.integers(self._tier.min_start, self._tier.max_start + 1))
    return {"start": start, "pad": self._tier.pad, "tier": self._tier_name}


def task_family(task: dict) -> str:
  return f"start_{task['start']}"


class CountdownEnv:
  system_prompt = "You count down. Answer with <tool_call>say N</tool_call>."

  def __init__(self, spec: CountdownSpec | None = None, audit_log=None, step_hook=None):
    self.config = spec if spec is not None else CountdownSpec()
    self.audit = audit_log  # Nothing runs on the host: there is nothing to audit.
    self.step_hook = step_hook  # Called as step_hook(env) at the start of each step.
    self.actions: list[str] = []
    self.observations: list[str] = []
    self.closed = False

  def reset(self, task: dict[str, Any]) -> str:
    self.task = task
    self.expected = task["start"]
    self.right = 0
    self.actions, self.observations = [], []
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
    info = {"tool": "say" if match else None, "decision": "allowed" if match else "error",
            "process_signal": float(right), "turn": turn}
    if right and self.expected == 0:
      result = StepResult("Done.", self.right / turn, True, {**info, "end_reason": "submit"})
    else:
      if right:
        self.expected -= 1
      what = "no tool call" if match is None else f"you said {said}"
      obs = f"{'Right' if right else 'Wrong'} ({what}). Say {self.expected}.{self._pad(turn)}"
      done = turn >= self.config.max_turns
      result = StepResult(obs, 0.0, done,
                          {**info, "end_reason": "turn_budget"} if done else info)
    self.observations.append(result.observation)
    return result

  def close(self) -> None:
    self.closed = True

  def __enter__(self) -> "CountdownEnv":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


@dataclasses.dataclass
class CountdownEpisode:
  first_observation: str
  turns: list  # [(action_text, observation)]
  reward: float


def expert_action(observation: str) -> str:
  """The right answer to an observation: say the number it asks for."""
  number = re.findall(r"Say (-?\d+)", observation)[-1]
  return f"ok <tool_call>say {number}</tool_call>"


def play_expert(env: CountdownEnv, task: dict) -> CountdownEpisode:
  """Counts down from the task's start, right every turn, within the turn budget."""
  observation = first = env.reset(task)
  turns, reward = [], 0.0
  for _ in range(env.config.max_turns):
    action = expert_action(observation)
    result = env.step(action)
    turns.append((action, result.observation))
    observation, reward = result.observation, result.reward
    if result.done:
      break
  return CountdownEpisode(first, turns, reward)


class CountdownTeacher:
  """Answers every turn right (optionally ending with eos): the rollout tests' teacher."""

  def __init__(self, task, *, eos_after: int | None = None, eos_text: str = "<|eos|>"):
    self.turn = 0
    self.eos_after = eos_after
    self.eos_text = eos_text

  def act(self, observation: str) -> str:
    self.turn += 1
    text = expert_action(observation)
    if self.eos_after is not None and self.turn >= self.eos_after:
      text += self.eos_text
    return text
