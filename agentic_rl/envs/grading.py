"""The trusted grader: cases and expected values stay in this (the host's) process.

A graded run sends the sandbox only what each case calls: the function's name and
its arguments (sandbox_server's "calls" request). The agent's module is imported
and called in a sandboxed process of its own, which replies with each outcome as
plain tagged data over a pipe, bounded in size. This module decodes the reply
strictly and compares on plain data (`plain_equal`), here, where no code of the
agent's runs: no frame, import, file, environment variable or signal of that
process reaches an expected value or the comparison.

The test file the agent can `view` documents the cases; grading never reads it.
What the agent sees of a run is rendered as unittest's runner used to report it
(the same rows, order and error locations), so demonstrations do not change.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os

# One wire format, one decoder: the server's, strict, used on both sides.
from agentic_rl.envs.sandbox_server import (MalformedReply, decode_plain, encode_plain,
                                            short_repr)

_PLAIN_SCALARS = (int, bool, float, str, bytes, type(None))
_MAX_TEXT = 4096  # Longest error, location or repr string kept from a reply.


@dataclasses.dataclass(frozen=True)
class Case:
  """One test case: `function(*args)` must return a value plain_equal to `want`."""
  function: str
  args: tuple
  want: object


def plain_equal(got, want) -> bool:
  """Equality of plain data, types included: an object whose __eq__ always says True, a
  str subclass, or 1 for True does not pass. Expected values are literals, so this is
  what "equal" means for a test here."""
  if type(got) is not type(want):
    return False
  if type(want) in (list, tuple):
    return len(got) == len(want) and all(plain_equal(a, b) for a, b in zip(got, want))
  if type(want) is dict:
    return (len(got) == len(want) and all(type(k) in _PLAIN_SCALARS for k in got)
            and all(k in want and plain_equal(got[k], want[k]) for k in got))
  if type(want) in _PLAIN_SCALARS:
    return got == want
  return False


@dataclasses.dataclass(frozen=True)
class CaseResult:
  call: str  # "fn(arg, ...)", as the test runner names the subtest.
  status: str  # "pass", "fail" or "error"
  got: str = ""
  want: str = ""
  error: str = ""
  where: str = ""


@dataclasses.dataclass(frozen=True)
class GradeReport:
  results: tuple  # CaseResult per case, in the order the test runner ran them.
  import_error: str | None  # "Text (where)" when the module could not be imported.
  output: str  # What the code under test printed (bounded).

  @property
  def passed(self) -> int:
    return sum(r.status == "pass" for r in self.results)


def run_order(cases) -> list[int]:
  """Indices of `cases` in the order unittest runs them: test methods by name, then the
  cases of each method in file order."""
  return sorted(range(len(cases)), key=lambda i: ("test_" + cases[i].function, i))


def tested_functions(task) -> list[str]:
  """The functions the cases call, in test-file order (as the test file imports them)."""
  return list(dict.fromkeys(c.function for c in task.cases))


def _test_file_lines(task) -> tuple[int, dict]:
  """(line of the test file's import of the module, {function: line of its assertEqual})."""
  module = task.module_path[:-3]
  import_line, assert_lines = 1, {}
  for n, line in enumerate(task.test_text.split("\n"), 1):
    stripped = line.strip()
    if stripped.startswith(f"from {module} import"):
      import_line = n
    for fn in tested_functions(task):
      if stripped.startswith(f"self.assertEqual({fn}("):
        assert_lines.setdefault(fn, n)
  return import_line, assert_lines


def build_request(task, module_source: bytes | None, sandbox_cfg, stage_dir: str,
                  send_source: bool) -> dict:
  """The sandbox request of one graded run: inputs only, never an expected value."""
  cases = task.cases
  calls = []
  for i in run_order(cases):
    tagged = encode_plain(cases[i].args, 1 << 20)
    if tagged is None:  # Our own generator makes only plain arguments.
      raise ValueError(f"case {i} of task {task.seed} has arguments that are not plain data")
    calls.append([cases[i].function, tagged[1]])
  return {"kind": "calls", "module": task.module_path[:-3], "module_file": task.module_path,
          "functions": tested_functions(task), "calls": calls, "stage_dir": stage_dir,
          "source_b64": (base64.b64encode(module_source).decode("ascii")
                         if send_source and module_source is not None else None),
          "max_repr": 80, "max_output": 300,
          "max_value_chars": sandbox_cfg.max_value_chars,
          "max_reply_bytes": sandbox_cfg.max_reply_bytes}


def _text(x) -> str:
  if not isinstance(x, str):
    raise MalformedReply("expected a string")
  return x[:_MAX_TEXT]


def parse_reply(task, reply: str) -> GradeReport:
  """Decodes a graded run's reply and compares it, case by case, with the expected values.

  MalformedReply when the reply as a whole is unreadable; a single unreadable outcome
  fails only its case."""
  try:
    data = json.loads(reply)
  except ValueError:
    raise MalformedReply("not JSON") from None
  if not isinstance(data, dict):
    raise MalformedReply("not an object")
  cases = task.cases
  order = run_order(cases)
  import_line, assert_lines = _test_file_lines(task)
  output = _text(data.get("output", ""))
  if data.get("import_error") is not None:
    where = _text(data.get("import_where", "")) or f"{task.test_path}:{import_line}"
    return GradeReport((), f"{_text(data['import_error'])} ({where})", output)
  outcomes = data.get("outcomes")
  if not isinstance(outcomes, list) or len(outcomes) != len(order):
    raise MalformedReply("wrong number of outcomes")
  results = []
  for i, out in zip(order, outcomes):
    case = cases[i]
    call = f"{case.function}({', '.join(short_repr(a, 80) for a in case.args)})"
    want = short_repr(case.want, 80)
    results.append(_judge(out, case, call, want, task, assert_lines))
  return GradeReport(tuple(results), None, output)


def _judge(out, case, call, want, task, assert_lines) -> CaseResult:
  try:
    if not isinstance(out, dict):
      raise MalformedReply("outcome is not an object")
    if out.get("status") == "error":
      where = _text(out.get("where", "")) or (
          f"{task.test_path}:{assert_lines[case.function]}"
          if case.function in assert_lines else "")
      return CaseResult(call, "error", error=_text(out.get("error", "")), where=where)
    if out.get("status") != "value":
      raise MalformedReply("unknown outcome status")
    if "value" not in out:  # Not plain data: never equal to a literal.
      return CaseResult(call, "fail", got=_text(out.get("repr", ""))[:80], want=want)
    got = decode_plain(out["value"])
  except MalformedReply:
    return CaseResult(call, "error", error="the sandbox's answer for this case is unreadable")
  if plain_equal(got, case.want):
    return CaseResult(call, "pass")
  return CaseResult(call, "fail", got=short_repr(got, 80), want=want)


def stage_module(stage_dir: str, module_file: str, source: bytes | None) -> None:
  """Writes the host-side staging directory of a sandbox without per-call namespaces:
  the module under repair and nothing else. The directory is the host's (the sandbox
  uid may read, not write), so nothing the agent made can shadow an import there."""
  target = os.path.join(stage_dir, module_file)
  for name in os.listdir(stage_dir):
    os.unlink(os.path.join(stage_dir, name))
  if source is not None:
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
      view = memoryview(source)
      while view:
        view = view[os.write(fd, view):]
    finally:
      os.close(fd)

