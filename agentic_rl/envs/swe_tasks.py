"""Procedurally generated tiny Python repositories with injected bugs.

A task is a module of short functions (drawn from templates with random names,
constants and operators), a unittest file with data-driven subtests for the
tested functions, and one injected bug in each of `num_bugs` tested
functions. Everything is a pure function of (tier, seed): `generate_task` uses
only `random.Random(f"swe:{tier}:{seed}")`.

Every bug changes exactly one line and makes at least one test case fail (the
generator checks this by running both versions on the cases); expected values
come from the correct version. Nothing in the first observation reveals the
bug: it must be found with view and test.

Two case sets per tested function, from the same case pool: the visible cases, which
the test file documents and `test` runs, and the hidden cases, which `submit`, the
reward and the process signal grade on and the agent never sees. They share no
arguments, so a module that answers the visible cases from a table, bug left in,
scores on the hidden ones exactly as the unfixed module does; and every bug fails at
least one case of each set, and the hidden cases are ones the visible tests settle
(_settled_cases). The hidden cases come from their own random stream, so the visible
task is the same as before they existed, except where the first-tried bug showed on
no case a hidden set could hold (about 1 task in 7; WORKSPACE.md).
"""

from __future__ import annotations

import dataclasses
import random
import types
from collections.abc import Callable


from agentic_rl.envs import mutations
from agentic_rl.envs.grading import Case, plain_equal
from agentic_rl.envs.config import EnvSpec, validate_env_config

# None of these shadows a standard-library module.
_MODULE_NAMES = ("calc", "mathutil", "helpers", "metrics", "pricing", "scores", "tally", "ranges",
                 "grades", "inventory", "billing", "toolbox", "arith", "counters", "numtools")
_SAFE_BUILTINS = {"range": range, "len": len, "min": min, "max": max, "abs": abs, "sum": sum,
                  "list": list, "int": int, "str": str, "bool": bool, "sorted": sorted}


@dataclasses.dataclass(frozen=True)
class Bug:
  function: str
  family: str
  line: int  # 1-based line in the module file.
  correct_line: str
  buggy_line: str


@dataclasses.dataclass(frozen=True)
class SweTask:
  """A plain, picklable task record."""

  seed: int
  tier: str
  split: str
  module_path: str
  test_path: str
  files: dict  # path -> text, as the workspace starts (buggy module + tests).
  editable: tuple[str, ...]  # Files replace may change.
  allowlist: tuple[str, ...]  # Tools this task may call.
  num_tests: int  # Subtests in the test file.
  initial_passed: int  # Subtests the buggy module passes.
  functions: tuple[str, ...]  # Tested functions, in test-file order.
  distractors: tuple[str, ...]  # Untested functions.
  bugs: tuple[Bug, ...]
  # The visible cases and their expected values, in test-file order (what `test` runs).
  cases: tuple[Case, ...] = ()
  # The hidden cases, in test-file function order: what submit and the reward grade.
  # Held in the host only; no argument tuple of a function repeats one of its visible ones.
  hidden_cases: tuple[Case, ...] = ()
  hidden_initial_passed: int = 0  # Hidden cases the buggy module passes.

  @property
  def test_text(self) -> str:
    return self.files[self.test_path]

  @property
  def num_hidden(self) -> int:
    return len(self.hidden_cases)


@dataclasses.dataclass(frozen=True)
class _Function:
  name: str
  params: tuple[str, ...]
  source: str  # Canonical (ast.unparse) source.
  sample_args: Callable[[random.Random], tuple]
  boundary_args: tuple[tuple, ...] = ()


# ---- templates: each returns a _Function; `pick` draws distinct identifiers ----

class _Names:
  def __init__(self, rng: random.Random, taken: set[str]):
    self.rng, self.taken = rng, taken

  def pick(self, options: tuple[str, ...]) -> str:
    free = [o for o in options if o not in self.taken]
    if not free:
      base = self.rng.choice(options)
      k = 2
      while f"{base}{k}" in self.taken:
        k += 1
      free = [f"{base}{k}"]
    name = self.rng.choice(free)
    self.taken.add(name)
    return name


def _small_list(rng, lo=0, hi=9, max_len=6, min_len=0):
  return [rng.randint(lo, hi) for _ in range(rng.randint(min_len, max_len))]


def _t_affine(rng, nm):
  f = nm.pick(("scale", "adjust", "convert", "score", "weight", "boost"))
  x = nm.pick(("x", "n", "value", "amount"))
  a, b = rng.randint(2, 9), rng.randint(1, 12)
  body = rng.choice((f"{x} * {a} + {b}", f"{x} * {a} - {b}", f"({x} + {b}) * {a}"))
  return _Function(f, (x,), f"def {f}({x}):\n    return {body}",
                   lambda r: (r.randint(-10, 20),), ((0,), (1,)))


def _t_clamp(rng, nm):
  f = nm.pick(("clamp", "bound", "limit", "restrict"))
  x = nm.pick(("x", "v", "level"))
  lo = nm.pick(("lo", "low", "floor_"))
  hi = nm.pick(("hi", "high", "cap"))
  src = (f"def {f}({x}, {lo}, {hi}):\n    if {x} < {lo}:\n        return {lo}\n"
         f"    if {x} > {hi}:\n        return {hi}\n    return {x}")

  def sample(r):
    a = r.randint(-5, 5)
    b = a + r.randint(1, 10)
    return (r.choice((a, b, r.randint(a - 5, b + 5), r.randint(a, b))), a, b)
  return _Function(f, (x, lo, hi), src, sample, ((0, 0, 5), (5, 0, 5), (-1, 0, 5), (6, 0, 5)))


def _t_series(rng, nm):
  f = nm.pick(("series", "accumulate", "triangle", "ramp"))
  n = nm.pick(("n", "count", "steps"))
  acc = nm.pick(("total", "acc", "result"))
  i = nm.pick(("i", "k", "j"))
  c = rng.randint(2, 5)
  start = rng.choice((f"range(1, {n} + 1)", f"range({n})"))
  step = rng.choice((f"{i} * {c}", f"{i} + {c}"))
  src = (f"def {f}({n}):\n    {acc} = 0\n    for {i} in {start}:\n        {acc} += {step}\n"
         f"    return {acc}")
  return _Function(f, (n,), src, lambda r: (r.randint(0, 9),), ((0,), (1,), (2,)))


def _t_count_cmp(rng, nm):
  f = nm.pick(("count_above", "count_big", "count_over", "tally_high"))
  xs, t, c, x = nm.pick(("xs", "values", "items")), nm.pick(("t", "limit_", "threshold")), \
      nm.pick(("c", "hits", "count")), nm.pick(("x", "v", "item"))
  op = rng.choice((">", ">=", "<", "<="))
  src = (f"def {f}({xs}, {t}):\n    {c} = 0\n    for {x} in {xs}:\n        if {x} {op} {t}:\n"
         f"            {c} += 1\n    return {c}")

  def sample(r):
    v = _small_list(r)
    return (v, r.choice(v) if v and r.random() < 0.6 else r.randint(0, 9))
  return _Function(f, (xs, t), src, sample, (([1, 5, 5, 9], 5), ([], 3), ([2, 2], 2)))


def _t_extreme(rng, nm):
  big = rng.random() < 0.5
  f = nm.pick(("largest", "biggest", "peak") if big else ("smallest", "lowest", "minimum"))
  xs = nm.pick(("xs", "values", "nums"))
  best = nm.pick(("best", "top", "m"))
  x = nm.pick(("x", "v", "num"))
  op = ">" if big else "<"
  src = (f"def {f}({xs}):\n    {best} = {xs}[0]\n    for {x} in {xs}:\n"
         f"        if {x} {op} {best}:\n"
         f"            {best} = {x}\n    return {best}")
  return _Function(f, (xs,), src, lambda r: (_small_list(r, -9, 9, 6, 1),),
                   (([3, 1, 2],), ([1, 2, 3],), ([5],)))


def _t_piecewise(rng, nm):
  f = nm.pick(("fee", "charge", "rate", "surcharge"))
  x = nm.pick(("amount", "x", "price"))
  a, b, c = rng.randint(5, 15), rng.randint(1, 5), rng.randint(1, 9)
  op = rng.choice((">=", ">"))
  src = f"def {f}({x}):\n    if {x} {op} {a}:\n        return {x} - {b}\n    return {x} + {c}"
  return _Function(f, (x,), src, lambda r: (r.randint(0, 25),), ((a,), (a - 1,), (a + 1,)))


def _t_slice(rng, nm):
  f = nm.pick(("take", "head", "first", "prefix", "tail", "last"))
  xs, n = nm.pick(("xs", "items", "seq")), nm.pick(("n", "k", "size"))
  body = rng.choice((f"{xs}[:{n}]", f"{xs}[{n}:]", f"{xs}[:{n} + 1]"))
  return _Function(f, (xs, n), f"def {f}({xs}, {n}):\n    return {body}",
                   lambda r: (_small_list(r, 0, 9, 7), r.randint(0, 5)), (([1, 2, 3], 1),))


def _t_midpoint(rng, nm):
  f = nm.pick(("midpoint", "middle", "mean2", "center"))
  a, b = nm.pick(("a", "lo", "start")), nm.pick(("b", "hi", "end"))
  d = rng.choice((2, 3, 4))
  return _Function(f, (a, b), f"def {f}({a}, {b}):\n    return ({a} + {b}) // {d}",
                   lambda r: (r.randint(-10, 20), r.randint(-10, 20)), ((1, 2), (4, 4)))


def _t_distance(rng, nm):
  f = nm.pick(("distance", "gap", "spread", "delta"))
  a, b = nm.pick(("a", "p", "first")), nm.pick(("b", "q", "second"))
  src = f"def {f}({a}, {b}):\n    if {a} > {b}:\n        return {a} - {b}\n    return {b} - {a}"
  return _Function(f, (a, b), src, lambda r: (r.randint(-9, 9), r.randint(-9, 9)),
                   ((3, 3), (5, 2), (2, 5)))


def _t_in_range(rng, nm):
  f = nm.pick(("in_range", "within", "inside", "is_valid"))
  x = nm.pick(("x", "v", "n"))
  lo = nm.pick(("lo", "low", "start"))
  hi = nm.pick(("hi", "high", "stop"))
  src = f"def {f}({x}, {lo}, {hi}):\n    return {lo} <= {x} and {x} < {hi}"

  def sample(r):
    a = r.randint(-5, 5)
    b = a + r.randint(1, 8)
    return (r.choice((a, b, a - 1, b - 1, r.randint(a - 3, b + 3))), a, b)
  return _Function(f, (x, lo, hi), src, sample, ((0, 0, 3), (3, 0, 3), (2, 0, 3), (-1, 0, 3)))


def _t_product(rng, nm):
  f = nm.pick(("product", "multiply_all", "prod"))
  xs = nm.pick(("xs", "factors", "nums"))
  p = nm.pick(("p", "out", "acc"))
  v = nm.pick(("v", "x", "f"))
  src = f"def {f}({xs}):\n    {p} = 1\n    for {v} in {xs}:\n        {p} *= {v}\n    return {p}"
  return _Function(f, (xs,), src, lambda r: (_small_list(r, 0, 5, 4),), (([],), ([2, 3],)))


def _t_sum_multiples(rng, nm):
  f = nm.pick(("sum_multiples", "sum_even", "add_divisible"))
  xs, k, s, v = nm.pick(("xs", "values", "nums")), nm.pick(("k", "m", "d")), \
      nm.pick(("s", "total", "acc")), nm.pick(("v", "x", "num"))
  src = (f"def {f}({xs}, {k}):\n    {s} = 0\n    for {v} in {xs}:\n        if {v} % {k} == 0:\n"
         f"            {s} += {v}\n    return {s}")
  return _Function(f, (xs, k), src, lambda r: (_small_list(r, 0, 12, 6), r.randint(2, 4)),
                   (([2, 3, 4, 6], 2), ([5], 5)))


def _t_repeat(rng, nm):
  f = nm.pick(("repeat", "echo", "stamp"))
  s, n = nm.pick(("s", "text", "word")), nm.pick(("n", "times", "k"))
  suffix = rng.choice(("!", ".", "?", "-"))
  src = f"def {f}({s}, {n}):\n    return {s} * {n} + {suffix!r}"
  return _Function(f, (s, n), src, lambda r: (r.choice(("ab", "x", "hey", "no")), r.randint(0, 3)),
                   (("a", 0), ("ab", 2)))


def _t_count_char(rng, nm):
  f = nm.pick(("count_char", "occurrences", "letter_count"))
  s, ch, n, c = nm.pick(("s", "text", "word")), nm.pick(("ch", "letter", "target")), \
      nm.pick(("n", "found", "hits")), nm.pick(("c", "char", "x"))
  src = (f"def {f}({s}, {ch}):\n    {n} = 0\n    for {c} in {s}:\n        if {c} == {ch}:\n"
         f"            {n} += 1\n    return {n}")
  return _Function(f, (s, ch), src,
                   lambda r: (r.choice(("banana", "abc", "", "aaa", "hello")), r.choice("abnl")),
                   (("banana", "a"), ("", "a")))


def _t_discount(rng, nm):
  f = nm.pick(("discount", "sale_price", "reduce"))
  p, lim = nm.pick(("price", "cost", "p")), rng.randint(10, 30)
  d = rng.choice((2, 4, 5, 10))
  src = f"def {f}({p}):\n    if {p} > {lim}:\n        return {p} - {p} // {d}\n    return {p}"
  return _Function(f, (p,), src, lambda r: (r.randint(0, 60),), ((lim,), (lim + 1,), (lim - 1,)))


TEMPLATES = (_t_affine, _t_clamp, _t_series, _t_count_cmp, _t_extreme, _t_piecewise, _t_slice,
             _t_midpoint, _t_distance, _t_in_range, _t_product, _t_sum_multiples, _t_repeat,
             _t_count_char, _t_discount)


# ---- evaluation of generated code (trusted: it is ours) ----

def _compile(source, name: str) -> Callable:
  """The function `name` defined by `source` (text, or a compiled module's code)."""
  ns: dict = {"__builtins__": _SAFE_BUILTINS}
  exec(source if isinstance(source, types.CodeType) else compile(source, f"<{name}>", "exec"),
       ns)
  return ns[name]


def _outside(pool: list, cases: list) -> list:
  """The cases of `pool` whose arguments are none of `cases`' (by repr: 1 and True differ)."""
  seen = {repr(args) for args, _ in cases}
  return [c for c in pool if repr(c[0]) not in seen]


def _draw_with_catching(rng: random.Random, pool: list, catching: list, k: int) -> list:
  """k cases of `pool` (fewer if it is smaller), one of them from `catching`, shuffled."""
  first = rng.choice(catching)
  rest = [c for c in pool if c is not first]
  cs = [first] + rng.sample(rest, min(k - 1, len(rest)))
  rng.shuffle(cs)
  return cs


def _outcome(fn: Callable, args: tuple):
  try:
    return ("ok", fn(*_copy_args(args)))
  except Exception as e:  # A buggy version may raise; that is a failing test.
    return ("raise", type(e).__name__)


def _passes_case(fn: Callable, args: tuple, want) -> bool:
  """The grader's criterion: no exception and plain_equal to the expected value."""
  kind, value = _outcome(fn, args)
  return kind == "ok" and plain_equal(value, want)


def _copy_args(args: tuple) -> tuple:
  return tuple(list(a) if isinstance(a, list) else a for a in args)


def _literal_ok(v) -> bool:
  try:
    back = mutations.literal_eval(repr(v))
    return back == v and type(back) is type(v)
  except (ValueError, SyntaxError):
    return False


def _case_pool(fn: _Function, rng: random.Random, size: int = 40) -> list[tuple]:
  pool = []
  for args in list(fn.boundary_args) + [fn.sample_args(rng) for _ in range(size)]:
    if args not in pool:
      pool.append(args)
  return pool


def _render_test_method(fn: _Function, cases: list[tuple[tuple, object]]) -> str:
  ps = ", ".join(fn.params)
  rows = ", ".join(repr((*args, want)) for args, want in cases)
  kw = ", ".join(f"{p}={p}" for p in fn.params)
  return (f"    def test_{fn.name}(self):\n"
          f"        for {ps}, want in [{rows}]:\n"
          f"            with self.subTest({kw}):\n"
          f"                self.assertEqual({fn.name}({ps}), want)\n")


def generate_task(seed: int, tier: str | None = None, split: str = "train",
                  config: EnvSpec | None = None) -> SweTask:
  """The task of `seed` in `tier`; deterministic, and every bug is caught by a test."""
  with mutations.AST_LOCK:  # Thread-safe (see mutations.AST_LOCK); generation is CPU-bound.
    return _generate_task(seed, tier, split, config)


def _generate_task(seed, tier, split, config) -> SweTask:
  config = validate_env_config(config)
  tier = config.default_tier if tier is None else tier
  if tier not in config.tiers:
    raise ValueError(f"unknown tier {tier!r}; tiers: {sorted(config.tiers.keys())}")
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be an int >= 0, got {seed!r}")
  t = config.tiers[tier]
  n_total = t.num_functions + t.num_distractors
  if n_total > len(TEMPLATES):
    raise ValueError(f"tier {tier!r} needs {n_total} functions; only {len(TEMPLATES)} templates")
  # One rng drives every choice below, in this order: the task is a function of (tier, seed).
  rng = random.Random(f"swe:{tier}:{seed}")
  module = rng.choice(_MODULE_NAMES)
  names = _Names(rng, {module, f"test_{module}", "want", "self", "unittest"})
  templates = rng.sample(TEMPLATES, n_total)
  fns = [tmpl(rng, names) for tmpl in templates]
  fns = [dataclasses.replace(f, source=mutations.canonical(f.source)) for f in fns]
  tested, distractors = fns[: t.num_functions], fns[t.num_functions:]
  order = list(range(n_total))
  rng.shuffle(order)
  pools = {f.name: _correct_case_pool(f, rng) for f in tested}

  buggy_names = [f.name for f in rng.sample(tested, t.num_bugs)]
  bug_sources, bugs_by_fn, cases, hidden_pools = {}, {}, {}, {}
  for f in tested:
    pool = pools[f.name]
    if f.name not in buggy_names:
      cases[f.name] = rng.sample(pool, min(t.cases_per_function, len(pool)))
      hidden_pools[f.name] = _outside(pool, cases[f.name])
      continue
    chosen = _plant_bug(f, pool, rng, list(config.bug_families), t.cases_per_function)
    if chosen is None:
      raise RuntimeError(f"no detectable bug for {f.name} (seed {seed}, tier {tier})")
    fam, line, old, new, buggy_src, cases[f.name], hidden_pools[f.name] = chosen
    bug_sources[f.name] = buggy_src
    bugs_by_fn[f.name] = (fam, line, old, new)

  in_order = [fns[k] for k in order]
  module_text, bugs = _module_text(in_order, bug_sources, bugs_by_fn)
  tested_in_order = [f for f in in_order if f in tested]
  test_text = (f"import unittest\nfrom {module} import {', '.join(f.name for f in tested_in_order)}"
               f"\n\n\nclass Test{module.title().replace('_', '')}(unittest.TestCase):\n"
               + "\n".join(_render_test_method(f, cases[f.name]) for f in tested_in_order))

  hidden = _hidden_cases(tested, hidden_pools, bug_sources, t.hidden_cases_per_function,
                         random.Random(f"swe-hidden:{tier}:{seed}"), seed, tier)
  num_tests = sum(len(cases[f.name]) for f in tested)
  passed = hidden_passed = 0
  for f in tested:
    impl = _compile(bug_sources.get(f.name, f.source), f.name)
    passed += sum(_passes_case(impl, args, want) for args, want in cases[f.name])
    hidden_passed += sum(_passes_case(impl, args, want) for args, want in hidden[f.name])
  mod_path, test_path = f"{module}.py", f"test_{module}.py"
  return SweTask(
      seed=seed, tier=tier, split=split, module_path=mod_path, test_path=test_path,
      files={mod_path: module_text, test_path: test_text}, editable=(mod_path,),
      allowlist=tuple(t.allowlist), num_tests=num_tests, initial_passed=passed,
      functions=tuple(f.name for f in tested_in_order),
      distractors=tuple(f.name for f in in_order if f in distractors),
      bugs=tuple(sorted(bugs, key=lambda b: b.line)),
      cases=tuple(Case(f.name, tuple(args), want) for f in tested_in_order
                  for args, want in cases[f.name]),
      hidden_cases=tuple(Case(f.name, tuple(args), want) for f in tested_in_order
                         for args, want in hidden[f.name]),
      hidden_initial_passed=hidden_passed)


def _correct_case_pool(f: _Function, rng: random.Random) -> list:
  """Cases of `f` with expected values from its correct version (literal, no error)."""
  correct = _compile(f.source, f.name)
  pool = []
  for args in _case_pool(f, rng):
    kind, value = _outcome(correct, args)
    if kind == "ok" and _literal_ok(value) and all(_literal_ok(a) for a in args):
      pool.append((args, value))
  return pool


def _plant_bug(f: _Function, pool: list, rng: random.Random, families: list,
               cases_per_function: int):
  """(family, line, old, new, buggy source, visible cases, hidden pool) of a one-line bug
  in `f` that a visible case and some hidden case both catch, or None. Families are tried
  in a random order, each family's mutations in a random order."""
  rng.shuffle(families)
  for fam in families:
    options = list(mutations.mutated_sources(f.source, expert=False, family=fam))
    rng.shuffle(options)
    for _, line, old, new in options:
      buggy_src = "\n".join(new if i == line else s for i, s in enumerate(f.source.split("\n")))
      try:
        buggy = _compile(buggy_src, f.name)
      except SyntaxError:
        continue
      catching = [c for c in pool if not _passes_case(buggy, c[0], c[1])]
      if not catching:
        continue
      cs = _draw_with_catching(rng, pool, catching, cases_per_function)
      settled = _settled_cases(buggy_src, f.name, cs, pool)
      if not any(c in catching for c in settled):  # No hidden case could catch this bug.
        continue
      return fam, line, old, new, buggy_src, cs, settled
  return None


def _module_text(fns_in_order: list, bug_sources: dict, bugs_by_fn: dict
                 ) -> tuple[str, list]:
  """The module (functions one blank line apart, bugs planted) and its bugs' lines."""
  sources, bugs, lineno = [], [], 1
  for f in fns_in_order:
    src = bug_sources.get(f.name, f.source)
    if f.name in bugs_by_fn:
      fam, line, old, new = bugs_by_fn[f.name]
      bugs.append(Bug(f.name, fam, lineno + line, old, new))
    sources.append(src)
    lineno += src.count("\n") + 2
  return "\n\n".join(sources) + "\n", bugs


def _settled_cases(buggy_src: str, name: str, visible, pool) -> list:
  """The cases of `pool` outside `visible` on which every one-line repair (the expert's
  search space, mutations.mutated_sources) that passes the visible cases also passes:
  what the visible tests specify. A repair made from the visible tests alone passes these;
  the true repair is among the candidates, so each has its expected value."""
  settled = _outside(pool, visible)
  for code in mutations.mutated_code(mutations.canonical(buggy_src), expert=True):
    fn = _compile(code, name)
    if all(_passes_case(fn, args, want) for args, want in visible):
      settled = [c for c in settled if _passes_case(fn, c[0], c[1])]
  return settled


def _hidden_cases(tested, hidden_pools, bug_sources, per_function, rng, seed, tier):
  """{function: hidden (args, want) cases}, drawn from its hidden pool (outside its visible
  arguments; for a buggy function, the cases the visible tests settle); a buggy
  function's include at least one case its bug fails."""
  hidden = {}
  for f in tested:
    free = hidden_pools[f.name]
    if not free:
      raise RuntimeError(f"no hidden cases for {f.name} (seed {seed}, tier {tier})")
    if f.name in bug_sources:
      buggy = _compile(bug_sources[f.name], f.name)
      # Non-empty: the bug was chosen so.
      catching = [c for c in free if not _passes_case(buggy, c[0], c[1])]
      hidden[f.name] = _draw_with_catching(rng, free, catching, per_function)
    else:
      hidden[f.name] = rng.sample(free, min(per_function, len(free)))
  return hidden
