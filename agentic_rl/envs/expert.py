"""A scripted expert that solves SWE tasks through the tool protocol alone.

It sees only what a policy sees: the observations returned by `env.step`
(`task` is used for nothing but `env.reset(task)`). The play:

  ls -> test -> view the test file -> view the module (in chunks when long)
  -> for each failing function, search single-line repairs (every operator,
     comparison, name, constant in a range, +-1 added or removed:
     agentic_rl/envs/mutations.py) for the smallest edit that passes all of
     that function's cases read from the test file -> replace that line -> ...
     -> test -> submit.

The module is viewed last so the line to edit sits just before the edit: a
policy can copy it through its sliding-window layers. Of the passing repairs
the one with the fewest changed characters goes first (`(x + 1) * 7`, not
`(x + 0 + 1) * 7`), so demonstrations show the fix a programmer would make.

The repair search runs the candidate function in this process on the cases
it read; the code it runs is what `view` showed, i.e. generated code and the
expert's own edits. Returned turns are (action_text, observation) pairs, ready
to become SFT demonstrations.

`play_recovery` plays a recovery demonstration: the same play, except that the first
repair is preceded by a wrong one on the same line (the closest single-line change that
fails the function's cases), then a test that shows it failing, a view of the module
that brings the line back next to the edit (the sliding-window layers copy from there;
without it the base learned garbage corrections and looped to its turn budget), then
the right repair over it. The wrong edit's turn is listed in `no_loss_turns`: a
demonstration teaches reading the failure and correcting it, never making the mistake.
"""

from __future__ import annotations

import ast
import dataclasses
import re

from agentic_rl.envs import mutations
from agentic_rl.envs.grading import plain_equal
from agentic_rl.envs.json_tool_call import format_json_tool_call
from agentic_rl.envs.tool_call import format_tool_call

_LS_RE = re.compile(r"^(\S+) \((\d+) lines\)$")
_VIEW_HEADER_RE = re.compile(r"^(\S+) lines (\d+)-(\d+) of (\d+):$")
_VIEW_ROW_RE = re.compile(r"^(\d+)\|(.*)$")
_FAIL_RE = re.compile(r"^(?:FAIL|ERROR) ([A-Za-z_][A-Za-z0-9_]*)\(")
_SAFE_BUILTINS = {"range": range, "len": len, "min": min, "max": max, "abs": abs, "sum": sum,
                  "list": list, "int": int, "str": str, "bool": bool, "sorted": sorted}


@dataclasses.dataclass
class ExpertResult:
  first_observation: str
  turns: list  # [(action_text, observation)]
  reward: float
  solved: bool  # Submitted with every test passing.
  end_reason: str
  infos: list  # The info dict of each step.
  # Indices into `turns` whose actions a demonstration must not teach (a deliberate
  # mistake of play_recovery); () for the expert's own play.
  no_loss_turns: tuple[int, ...] = ()


class _OutOfTurns(Exception):
  pass


class _Player:
  def __init__(self, env, max_turns: int):
    self.env = env
    self.max_turns = max_turns
    json_calls = getattr(env.config, "tool_format", "grammar") == "json"
    self.format = format_json_tool_call if json_calls else format_tool_call
    self.turns, self.infos = [], []
    self.reward, self.done, self.end_reason = 0.0, False, ""

  def act(self, name: str, **args) -> str:
    if self.done:
      raise _OutOfTurns()
    if name != "submit" and len(self.turns) >= self.max_turns - 1:
      self.act("submit")  # Keep the last turn for submitting.
      raise _OutOfTurns()
    text = self.format(name, **args)
    obs, reward, done, info = self.env.step(text)
    self.turns.append((text, obs))
    self.infos.append(info)
    self.reward, self.done = reward, done
    if done:
      self.end_reason = info.get("end_reason", "")
    return obs

  def view_around(self, path: str, line: int) -> str:
    """One view whose chunk holds `line` (from the top when the first chunk does)."""
    rows = getattr(self.env.config, "view_max_lines", 80)
    if line <= rows:
      return self.act("view", path=path)
    return self.act("view", path=path, start=max(1, line - rows // 2))

  def read_file(self, path: str) -> list[str]:
    """The file's lines, viewed in as many chunks as the observation bound needs."""
    lines: dict[int, str] = {}
    start, total = 1, None
    while total is None or start <= total:
      obs = self.act("view", path=path) if start == 1 else self.act("view", path=path, start=start)
      rows = obs.split("\n")
      m = _VIEW_HEADER_RE.match(rows[0])
      if not m:
        if obs.endswith(" is empty"):
          return []
        raise ValueError(f"unexpected view output: {obs[:120]!r}")
      last, total = int(m.group(3)), int(m.group(4))
      for row in rows[1:]:
        r = _VIEW_ROW_RE.match(row)
        if r:
          lines[int(r.group(1))] = r.group(2)
      start = last + 1
    return [lines[i] for i in range(1, total + 1)]


def _failing_functions(test_obs: str) -> list[str]:
  names = []
  for row in test_obs.split("\n"):
    m = _FAIL_RE.match(row)
    if m and m.group(1) not in names:
      names.append(m.group(1))
  return names


def _all_pass(test_obs: str) -> bool:
  return bool(re.search(r"^all \d+ tests passed$", test_obs, re.M))


def _cases_from_tests(test_source: str) -> dict[str, list[tuple[tuple, object]]]:
  """{function: [(args, want)]} from the data-driven subtests of a test file."""
  cases: dict[str, list] = {}
  for node in ast.walk(mutations.parse(test_source)):
    if not isinstance(node, ast.For) or not isinstance(node.target, ast.Tuple):
      continue
    targets = [t.id for t in node.target.elts if isinstance(t, ast.Name)]
    call = next((n for n in ast.walk(node) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr == "assertEqual"), None)
    if call is None or not isinstance(call.args[0], ast.Call):
      continue
    fn_call = call.args[0]
    fname = fn_call.func.id
    arg_names = [a.id for a in fn_call.args]
    want_name = call.args[1].id
    rows = mutations.literal_eval(node.iter)
    for row in rows:
      values = dict(zip(targets, row))
      cases.setdefault(fname, []).append(
          (tuple(values[a] for a in arg_names), values[want_name]))
  return cases


def _passes(fn_source: str, name: str, cases) -> bool:
  ns = {"__builtins__": _SAFE_BUILTINS}
  try:
    exec(compile(fn_source, f"<{name}>", "exec"), ns)
    fn = ns[name]
    for args, want in cases:
      args = tuple(list(a) if isinstance(a, list) else a for a in args)
      if not plain_equal(fn(*args), want):  # What the grader checks.
        return False
  except Exception:
    return False
  return True


def _repairs(module_lines: list[str], name: str, cases):
  """(module line number, new line) for each single-line repair that passes `cases`."""
  fn = next((n for n in mutations.parse("\n".join(module_lines)).body
             if isinstance(n, ast.FunctionDef) and n.name == name), None)
  if fn is None:
    return
  src_lines = module_lines[fn.lineno - 1: fn.end_lineno]
  fn_source = "\n".join(src_lines)
  passing = []
  for _, idx, old, new in mutations.mutated_sources(mutations.canonical(fn_source), expert=True):
    candidate = "\n".join(new if i == idx else s for i, s in enumerate(src_lines))
    if _passes(candidate, name, cases):
      passing.append((_edit_distance(old, new), fn.lineno + idx, new))
  passing.sort(key=lambda c: c[0])  # Stable: ties keep the search order.
  for _, line, new in passing:
    yield line, new


def _wrong_repair(module_lines: list[str], name: str, cases, line: int) -> str | None:
  """The closest single-line change of module line `line` (inside function `name`) that
  fails `cases`: a plausible wrong repair of the line the right one edits; None if none."""
  fn = next((n for n in mutations.parse("\n".join(module_lines)).body
             if isinstance(n, ast.FunctionDef) and n.name == name), None)
  if fn is None:
    return None
  src_lines = module_lines[fn.lineno - 1: fn.end_lineno]
  fn_source = "\n".join(src_lines)
  wrong = []
  for _, idx, old, new in mutations.mutated_sources(mutations.canonical(fn_source), expert=True):
    if fn.lineno + idx != line or new.strip() == module_lines[line - 1].strip():
      continue
    candidate = "\n".join(new if i == idx else s for i, s in enumerate(src_lines))
    if not _passes(candidate, name, cases):
      wrong.append((_edit_distance(old, new), new))
  wrong.sort(key=lambda c: c[0])  # Stable: ties keep the search order.
  return wrong[0][1] if wrong else None


def _edit_distance(a: str, b: str) -> int:
  """Levenshtein distance over characters (lines are short)."""
  row = list(range(len(b) + 1))
  for i, ca in enumerate(a, 1):
    prev, row[0] = row[0], i
    for j, cb in enumerate(b, 1):
      prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
  return row[-1]


def play_recovery(env, task, max_turns: int | None = None) -> ExpertResult:
  """A recovery demonstration of `task` on `env` (module docstring): a wrong first repair,
  the failing test, the right repair. Where no wrong repair of that line exists, the
  expert's own play (no_loss_turns is then empty)."""
  return play_expert(env, task, max_turns, recover=True)


def play_expert(env, task, max_turns: int | None = None, *, recover: bool = False
                ) -> ExpertResult:
  """Plays one episode of `task` on `env`; see the module docstring."""
  first = env.reset(task)
  budget = max_turns if max_turns is not None else env.config.max_turns
  p = _Player(env, budget)
  no_loss = []
  try:
    files = [m.group(1) for m in map(_LS_RE.match, p.act("ls").split("\n")) if m]
    tests = [f for f in files if f.rsplit("/", 1)[-1].startswith("test_") and f.endswith(".py")]
    modules = [f for f in files if f.endswith(".py") and f not in tests]
    obs = p.act("test")
    if not _all_pass(obs):
      failing = _failing_functions(obs)
      cases: dict = {}
      for t in tests:
        cases.update(_cases_from_tests("\n".join(p.read_file(t))))
      sources = {m: p.read_file(m) for m in modules}
      original = {m: list(lines) for m, lines in sources.items()}
      pending = {}  # function -> iterator of repairs not tried yet
      applied = {}  # function -> line of its current repair
      while failing:
        progressed = False
        for name in failing:
          module = next((m for m, lines in sources.items()
                         if any(l.startswith(f"def {name}(") for l in lines)), None)
          if module is None or name not in cases:
            continue
          if name not in pending:
            pending[name] = _repairs(original[module], name, cases[name])
          fix = next(pending[name], None)
          if fix is None:
            continue
          line, new = fix
          old_line = applied.get(name)
          if old_line is not None and old_line != line:  # Undo the repair that did not hold.
            p.act("replace", path=module, start=old_line, end=old_line,
                  text=original[module][old_line - 1])
            sources[module][old_line - 1] = original[module][old_line - 1]
          if recover and not applied and not no_loss:
            wrong = _wrong_repair(original[module], name, cases[name], line)
            if wrong is not None:  # The mistake, untaught; then the failure it causes.
              no_loss.append(len(p.turns))
              p.act("replace", path=module, start=line, end=line, text=wrong)
              p.act("test")
              p.view_around(module, line)  # The line to fix back in view, as at first.
          p.act("replace", path=module, start=line, end=line, text=new)
          sources[module][line - 1] = new
          applied[name] = line
          progressed = True
        if not progressed:
          break
        obs = p.act("test")
        if _all_pass(obs):
          break
        failing = _failing_functions(obs)
    if not p.done:
      p.act("submit")
  except _OutOfTurns:
    pass
  solved = p.done and p.end_reason == "submit" and p.reward == 1.0
  return ExpertResult(first, p.turns, p.reward, solved, p.end_reason, p.infos,
                      no_loss_turns=tuple(no_loss))
