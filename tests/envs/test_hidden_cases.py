"""Hidden graded cases: submit and the reward grade cases the agent never sees.

A module that answers the visible cases from a lookup table, bug left in, passes every
visible test and earns exactly what the unfixed module earns, on every tier. The
generator's side: hidden and visible arguments never meet, every bug fails a hidden
case, and any one-line repair the visible tests justify passes every hidden case.
"""

import pytest

from agentic_rl.envs import mutations
from agentic_rl.envs.config import default_env_config
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.swe_tasks import _compile, _passes_case, generate_task
from agentic_rl.envs.tool_call import format_tool_call as F
from tests.envs.conftest import env_config

TIERS = ("tiny", "easy", "medium", "hard")


def _by_function(cases):
  out = {}
  for c in cases:
    out.setdefault(c.function, []).append(c)
  return out


def _function_source(module_text: str, name: str) -> str:
  fn = next(n for n in mutations.parse(module_text).body if getattr(n, "name", None) == name)
  return "\n".join(module_text.split("\n")[fn.lineno - 1: fn.end_lineno])


@pytest.mark.parametrize("tier", TIERS)
def test_hidden_cases_are_disjoint_from_the_visible_ones_and_catch_every_bug(tier):
  per_function = default_env_config().tiers[tier].hidden_cases_per_function
  for seed in range(12):
    task = generate_task(seed, tier)
    visible, hidden = _by_function(task.cases), _by_function(task.hidden_cases)
    assert list(hidden) == list(task.functions)
    for name, cases in hidden.items():
      assert 1 <= len(cases) <= per_function
      assert not {repr(c.args) for c in cases} & {repr(c.args) for c in visible[name]}
    module = task.files[task.module_path]
    buggy = {b.function for b in task.bugs}
    for name in task.functions:
      impl = _compile(_function_source(module, name), name)
      fails = [not _passes_case(impl, c.args, c.want) for c in hidden[name]]
      assert any(fails) == (name in buggy), (seed, name)
    assert task.hidden_initial_passed == sum(
        _passes_case(_compile(_function_source(module, c.function), c.function), c.args, c.want)
        for c in task.hidden_cases) < task.num_hidden


@pytest.mark.parametrize("tier", TIERS)
def test_every_repair_the_visible_tests_justify_passes_the_hidden_cases(tier):
  # The hidden cases test what the visible ones specify: a one-line repair (the expert's
  # search space) made from the visible tests alone is never penalised.
  for seed in range(6):
    task = generate_task(seed, tier)
    module = task.files[task.module_path]
    visible, hidden = _by_function(task.cases), _by_function(task.hidden_cases)
    for bug in task.bugs:
      src = _function_source(module, bug.function)
      lines = src.split("\n")
      justified = 0
      for _, idx, _, new in mutations.mutated_sources(mutations.canonical(src), expert=True):
        try:
          fn = _compile("\n".join(new if i == idx else s for i, s in enumerate(lines)),
                        bug.function)
        except SyntaxError:
          continue
        if all(_passes_case(fn, c.args, c.want) for c in visible[bug.function]):
          justified += 1
          assert all(_passes_case(fn, c.args, c.want) for c in hidden[bug.function]), \
              (seed, bug.function, new)
      assert justified >= 1  # The true repair, at least.


def _lookup_table_lines(task) -> list[str]:
  """Lines that make each tested function answer its visible cases from a table and
  fall back to the (buggy) function for anything else."""
  table = {repr((c.function, c.args)): c.want for c in task.cases}
  return [
      f"_VISIBLE = {table!r}",
      "def _answer_visible(name, fn):",
      "    def lookup(*args):",
      "        key = repr((name, args))",
      "        return _VISIBLE[key] if key in _VISIBLE else fn(*args)",
      "    return lookup",
      *[f"{n} = _answer_visible({n!r}, {n})" for n in task.functions],
  ]


def _submit_reward(isolation, task, actions):
  with SweEnv(env_config(isolation, timeout_s=5.0, reward="tests_fraction")) as env:
    env.reset(task)
    results = [env.step(a) for a in actions]
  return results


@pytest.mark.parametrize("tier", TIERS)
def test_a_module_that_hard_codes_the_visible_cases_earns_what_the_unfixed_one_does(
    isolation, tier):
  task = generate_task(3, tier)
  n_lines = task.files[task.module_path].count("\n")
  body = "\n".join(_lookup_table_lines(task))
  hack = [F("replace", path=task.module_path, start=n_lines + 1, end=n_lines, text=body),
          F("test"), F("submit")]
  edited, tested, submitted = _submit_reward(isolation, task, hack)
  assert "inserted" in edited.observation, edited.observation
  # Every visible test passes ...
  assert f"all {task.num_tests} tests passed" in tested.observation, tested.observation
  # ... and the reward, on the hidden cases, is the unfixed module's.
  (unfixed,) = _submit_reward(isolation, task, [F("submit")])
  assert submitted.done and unfixed.done
  assert submitted.reward == unfixed.reward < 1.0, submitted.observation
  assert unfixed.reward == pytest.approx(task.hidden_initial_passed / task.num_hidden)
  assert submitted.info["tests_passed"] == task.hidden_initial_passed < task.num_hidden
  # Under the default reward that is exactly 0.
  with SweEnv(env_config(isolation, timeout_s=5.0)) as env:
    env.reset(task)
    for a in hack:
      r = env.step(a)
  assert r.done and r.reward == 0.0
