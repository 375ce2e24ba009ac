"""An exception in one trajectory's env or text ends that trajectory only, with a reason.

env_factory / env.reset / env.step raising ends it with END_ENV_ERROR, the tokenizer
raising on its prompt, observation or teacher action with END_RENDER_ERROR; the
exception text is kept in Trajectory.error, the other slots finish, the batch still
forms and the train loop's rollout/end_<reason> metrics count it. An interrupt is not
an error of the trajectory: it stops the run.
"""

import threading

import numpy as np
import pytest

from agentic_rl.records import batch as batch_lib
from agentic_rl.rollout import config as config_lib
from agentic_rl.rollout import sampling
from agentic_rl.records import trajectory as trajectory_lib
from agentic_rl.rollout.device_steps import DeviceSteps
from agentic_rl.rollout.tokenizer import ByteTokenizer
from agentic_rl.train import sft as sft_lib
from agentic_rl.train.reporting import END_REASONS, end_reason_metrics
from tests.rollout.conftest import CHUNKS, MAX_LEN, make_engine
from agentic_rl.envs.countdown import CountdownEnv, CountdownTeacher
from tests.rollout.test_engine import learner_logprobs

REFUSED = "REFUSED"  # Text the picky tokenizer will not encode.
FULL = dict(temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def full_steps(tiny_model):
  """Untruncated sampling: a teacher's forced tokens have finite log-probs."""
  return DeviceSteps(tiny_model[0], sampling.SamplingParams(**FULL), CHUNKS)


class PickyTokenizer(ByteTokenizer):
  """The byte tokenizer, except that it raises on text holding REFUSED."""

  def encode(self, text, *, parse_special=True):
    if REFUSED in text:
      raise ValueError(f"cannot encode {REFUSED}")
    return super().encode(text, parse_special=parse_special)


class FaultyEnv(CountdownEnv):
  """Countdown, with faults named by the task: 'reset' raises in reset; 'system' puts
  REFUSED in the system prompt; 'step': n raises in the n-th step; 'refuse': n puts
  REFUSED in the n-th observation; 'interrupt': (n, exception type) raises it in the n-th
  step."""

  def reset(self, task):
    if task.get("reset"):
      raise RuntimeError("the sandbox did not start")
    if task.get("system"):
      self.system_prompt = f"{CountdownEnv.system_prompt} {REFUSED}"
    return super().reset(task)

  def step(self, action_text):
    turn = len(self.actions) + 1
    if self.task.get("step") == turn:
      raise RuntimeError(f"step {turn} broke")
    at, interrupt = self.task.get("interrupt", (0, None))
    if at == turn:
      raise interrupt()
    result = super().step(action_text)
    if self.task.get("refuse") == turn:
      result = result._replace(observation=f"{result.observation}\n{REFUSED}")
    return result


class Factory:
  """Keeps every env it made."""

  def __init__(self):
    self.envs, self._lock = [], threading.Lock()

  def __call__(self):
    env = FaultyEnv()
    with self._lock:
      self.envs.append(env)
    return env


class RefusingTeacher(CountdownTeacher):
  """Answers right, but its action at turn `task['teacher']` holds REFUSED."""

  def __init__(self, task):
    super().__init__(task)
    self.refuse_at = task.get("teacher")

  def act(self, observation):
    text = super().act(observation)
    return text + REFUSED if self.turn == self.refuse_at else text


def _run(tiny_model, steps, tasks, **overrides):
  factory = Factory()
  engine = make_engine(tiny_model, PickyTokenizer(), steps, factory,
                       teacher_factory=RefusingTeacher, max_turns=8, **FULL, **overrides)
  try:
    trajectories = engine.run(tasks)
  finally:
    engine.close()  # Waits for the pool, where the closes run.
  assert factory.envs and all(env.closed for env in factory.envs)
  return trajectories


def _check_batch(tiny_model, trajectories):
  model, params = tiny_model
  longest = max(1, max(t.length for t in trajectories))  # As the train loop pads.
  batch = trajectory_lib.to_batch(trajectories, length=sft_lib.padded_length(
      longest, MAX_LEN, multiple=128))
  batch_lib.check_batch(batch, model.spec)
  logp, _ = learner_logprobs(model, params, batch)
  mask = np.asarray(batch.loss_mask_bt) > 0
  assert np.isfinite(logp[mask]).all()
  np.testing.assert_allclose(logp[mask], np.asarray(batch.sampler_logp_bt)[mask], atol=1e-4)


def test_a_failing_step_or_observation_ends_only_its_trajectory(tiny_model, full_steps):
  tasks = [{"start": 3}, {"start": 3, "step": 2}, {"start": 3, "refuse": 1},
           {"start": 3, "teacher": 2}, {"start": 2, "pad": 3}]
  t = _run(tiny_model, full_steps, tasks)
  assert [x.end_reason for x in t] == [
      config_lib.END_SUBMIT, config_lib.END_ENV_ERROR, config_lib.END_RENDER_ERROR,
      config_lib.END_RENDER_ERROR, config_lib.END_SUBMIT]
  assert [x.reward for x in t] == [1.0, 0.0, 0.0, 0.0, 1.0]
  assert [x.error for x in t] == ["", "RuntimeError: step 2 broke",
                                  f"ValueError: cannot encode {REFUSED}",
                                  f"ValueError: cannot encode {REFUSED}", ""]
  # The action whose step raised was drawn, its answer never came.
  assert t[1].num_turns == 2 and t[1].process_signals == [1.0, 0.0]
  assert t[1].tool_infos[1] is None
  # The observation that did not render ends the trajectory after its turn.
  assert t[2].num_turns == 1 and t[2].tool_infos[0]["process_signal"] == 1.0
  # The teacher's second action did not tokenize: the trajectory ends after turn 1.
  assert t[3].num_turns == 1
  assert t[0].num_turns == 4 and t[4].num_turns == 3
  _check_batch(tiny_model, t)
  metrics = end_reason_metrics([x.end_reason for x in t])
  assert metrics["rollout/end_submit"] == 2 and metrics["rollout/end_env_error"] == 1
  assert metrics["rollout/end_render_error"] == 2 and metrics["rollout/end_other"] == 0
  assert set(metrics) == {f"rollout/end_{r}" for r in END_REASONS + ("other",)}


def test_a_group_that_cannot_start_ends_with_no_tokens(tiny_model, full_steps):
  tasks = [{"start": 2}, {"start": 2, "reset": True}, {"start": 2, "system": True},
           {"start": 1, "teacher": 1}, {"start": 1}]
  t = _run(tiny_model, full_steps, tasks, group_size=2)
  reasons = [x.end_reason for x in t]
  assert reasons == ([config_lib.END_SUBMIT] * 2 + [config_lib.END_ENV_ERROR] * 2
                     + [config_lib.END_RENDER_ERROR] * 4 + [config_lib.END_SUBMIT] * 2)
  assert [x.trajectory_id for x in t] == list(range(10))
  for x in t[2:6]:  # No prompt: nothing to train on, nothing that crashes batching.
    assert x.length == 0 and x.num_turns == 0 and x.reward == 0.0
  assert t[2].error == "RuntimeError: the sandbox did not start"
  # The teacher's first action did not tokenize: each member keeps its prompt alone.
  for x in t[6:8]:
    assert x.length == x.prompt_length > 0 and x.num_turns == 0 and x.loss_mask.sum() == 0
  assert all(x.reward == 1.0 for x in t[:2] + t[8:])
  _check_batch(tiny_model, t)
  _check_batch(tiny_model, t[2:4])  # Rows of no tokens alone still form a batch.
  metrics = end_reason_metrics(reasons, gather=lambda x: np.concatenate([x, x]))  # 2 hosts.
  assert metrics["rollout/end_env_error"] == 4 and metrics["rollout/end_render_error"] == 8


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_is_not_swallowed(tiny_model, full_steps, interrupt):
  factory = Factory()
  engine = make_engine(tiny_model, PickyTokenizer(), full_steps, factory,
                       teacher_factory=RefusingTeacher, max_turns=8, **FULL)
  with pytest.raises(interrupt):
    engine.run([{"start": 3}, {"start": 3, "interrupt": (2, interrupt)}, {"start": 3}])
  engine.close()
  assert factory.envs and all(env.closed for env in factory.envs)
