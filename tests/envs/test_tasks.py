"""Generated tasks: determinism, splits, and bugs checked by Python's own unittest runner."""

import concurrent.futures
import os
import pickle
import re
import subprocess
import sys

import pytest

from agentic_rl.envs import mutations
from agentic_rl.envs.config import BUG_FAMILIES, default_env_config
from agentic_rl.envs.datasets import SweTaskSource, swe_task_dataset
from agentic_rl.envs.swe_tasks import generate_task

TIERS = ("easy", "medium", "hard")


def test_deterministic_and_picklable():
  for tier in TIERS:
    a, b = generate_task(17, tier), generate_task(17, tier)
    assert a == b
    assert pickle.loads(pickle.dumps(a)) == a
  assert generate_task(17, "easy") != generate_task(18, "easy")


def test_tier_sizes_follow_the_config():
  c = default_env_config()
  for tier in TIERS:
    t = c.tiers[tier]
    for seed in range(5):
      task = generate_task(seed, tier)
      assert len(task.functions) == t.num_functions
      assert len(task.distractors) == t.num_distractors
      assert len(task.bugs) == t.num_bugs
      assert len({b.function for b in task.bugs}) == t.num_bugs
      assert task.num_tests == t.num_functions * t.cases_per_function
      assert task.allowlist == tuple(t.allowlist)
      for name in task.distractors:
        assert name not in task.test_text


def test_every_family_is_generated_and_each_bug_is_one_line():
  seen = set()
  for seed in range(40):
    for tier in TIERS:
      task = generate_task(seed, tier)
      lines = task.files[task.module_path].split("\n")
      for bug in task.bugs:
        seen.add(bug.family)
        assert lines[bug.line - 1] == bug.buggy_line != bug.correct_line
  assert seen == set(BUG_FAMILIES)


def test_first_observation_material_does_not_reveal_code():
  from agentic_rl.envs.swe_env import SweEnv
  task = generate_task(3, "easy")
  with SweEnv() as env:
    obs = env.reset(task)
  for name in task.functions + task.distractors:
    assert name not in obs
  assert task.module_path not in obs


def _unittest_counts(files: dict, test_module: str, tmpdir: str) -> tuple[int, int, str]:
  """(failures + errors, tests run) from `python -m unittest` on the files (the reference)."""
  os.makedirs(tmpdir, exist_ok=True)
  for rel, text in files.items():
    with open(os.path.join(tmpdir, rel), "w") as f:
      f.write(text)
  p = subprocess.run([sys.executable, "-B", "-m", "unittest", test_module], cwd=tmpdir,
                     capture_output=True, text=True, timeout=60)
  out = p.stderr
  ran = int(re.search(r"Ran (\d+) test", out).group(1))
  m = re.search(r"FAILED \((.*)\)", out)
  bad = 0
  if m:
    for part in m.group(1).split(", "):
      k, v = part.split("=")
      if k in ("failures", "errors"):
        bad += int(v)
  return bad, ran, out


def test_bugs_fail_tests_and_fixes_pass_them_under_plain_unittest(tmp_path):
  tasks = [generate_task(seed, tier) for tier in TIERS for seed in range(5)]

  def check(i_task):
    i, task = i_task
    test_module = task.test_path[:-3]
    bad, _, out = _unittest_counts(task.files, test_module, str(tmp_path / f"b{i}"))
    assert bad == task.num_tests - task.initial_passed, out
    assert bad >= len(task.bugs)  # Every bug is caught by at least one case.
    lines = task.files[task.module_path].split("\n")
    for bug in task.bugs:
      lines[bug.line - 1] = bug.correct_line
    fixed = dict(task.files, **{task.module_path: "\n".join(lines)})
    bad_fixed, _, out = _unittest_counts(fixed, test_module, str(tmp_path / f"f{i}"))
    assert bad_fixed == 0, out
    # Undoing any single bug removes failures: each bug is detected on its own.
    for bug in task.bugs:
      one = task.files[task.module_path].split("\n")
      one[bug.line - 1] = bug.correct_line
      assert _count_failing_in_process(task, "\n".join(one)) < bad

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    list(pool.map(check, enumerate(tasks)))


def _count_failing_in_process(task, module_text: str) -> int:
  """Failing cases with the functions evaluated here (cases read back from the test file)."""
  from agentic_rl.envs.expert import _cases_from_tests
  ns = {}
  exec(compile(module_text, task.module_path, "exec"), ns)
  bad = 0
  for name, cases in _cases_from_tests(task.test_text).items():
    for args, want in cases:
      try:
        ok = ns[name](*args) == want
      except Exception:
        ok = False
      bad += not ok
  return bad


def test_mutations_change_exactly_one_line():
  src = mutations.canonical("def f(xs, t):\n    c = 0\n    for x in xs:\n        if x > t:\n"
                            "            c += 1\n    return c")
  fams = set()
  for m, line, old, new in mutations.mutated_sources(src, expert=True):
    fams.add(m.family)
    lines = src.split("\n")
    assert lines[line] == old != new
    assert mutations.one_line_change(src, "\n".join(new if i == line else s
                                                    for i, s in enumerate(lines)))
  assert fams == set(BUG_FAMILIES)


def _behaviour(code_or_source, name, inputs):
  ns = {"__builtins__": __builtins__}
  exec(code_or_source, ns)
  out = []
  for args in inputs:
    try:
      out.append(("ok", repr(ns[name](*[list(a) if isinstance(a, list) else a for a in args]))))
    except Exception as e:
      out.append(("raise", type(e).__name__))
  return tuple(out)


def test_mutated_code_compiles_what_mutated_sources_writes():
  # The generator's fast path: the same functions, compiled from the mutated tree rather
  # than from unparsed source (duplicates and the unchanged function aside).
  for tier, seed in (("tiny", 0), ("easy", 1), ("medium", 2), ("hard", 3)):
    task = generate_task(seed, tier)
    lines = task.files[task.module_path].split("\n")
    for bug in task.bugs:
      fn = next(n for n in mutations.parse(task.files[task.module_path]).body
                if n.name == bug.function)
      src = "\n".join(lines[fn.lineno - 1: fn.end_lineno])
      inputs = [c.args for c in task.cases + task.hidden_cases if c.function == bug.function]
      from_sources = {_behaviour("\n".join(new if i == idx else x
                                           for i, x in enumerate(src.split("\n"))),
                                 bug.function, inputs)
                      for _, idx, _, new in mutations.mutated_sources(src, expert=True)}
      from_code = {_behaviour(code, bug.function, inputs)
                   for code in mutations.mutated_code(src, expert=True)}
      itself = _behaviour(src, bug.function, inputs)
      assert from_sources <= from_code <= from_sources | {itself}
      assert len(from_sources) >= 2  # The bug and its repair behave differently, at least.


def test_splits_are_disjoint_grain_sources():
  c = default_env_config()
  train, held = SweTaskSource("train", TIERS), SweTaskSource("heldout", TIERS)
  assert len(train) == c.splits.train_size and len(held) == c.splits.heldout_size
  tr = range(train.seed_of(0), train.seed_of(len(train) - 1) + 1)
  he = range(held.seed_of(0), held.seed_of(len(held) - 1) + 1)
  assert not set([tr.start, tr.stop - 1]) & set(he) and max(tr) < min(he)
  ds = swe_task_dataset("train", TIERS)
  assert ds[4] == generate_task(4, TIERS[4 % 3], "train")
  assert held[-1] == generate_task(he.stop - 1, TIERS[(len(held) - 1) % 3], "heldout")
  assert [t.tier for t in (ds[0], ds[1], ds[2])] == list(TIERS)
  shuffled = [t.seed for t in ds.shuffle(seed=1)[:6]]
  assert len(set(shuffled)) == 6 and all(s in tr for s in shuffled)
  assert pickle.loads(pickle.dumps(train))[7] == train[7]
  with pytest.raises(IndexError):
    train[len(train)]
  with pytest.raises(ValueError, match="split must be one of"):
    SweTaskSource("test")
  with pytest.raises(ValueError, match="tiers must be"):
    SweTaskSource("train", ("impossible",))
