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
import re

# One wire format, one decoder: the server's, strict, used on both sides.
from agentic_rl.envs.sandbox_server import (MalformedReply, decode_plain, encode_plain,
                                            reply_limit, short_repr)

_PLAIN_SCALARS = (int, bool, float, str, bytes, type(None))
_MAX_TEXT = 4096  # Longest error, location or repr string kept from a reply.
_MAX_REPR, _MAX_OUTPUT = 80, 300  # What the sandbox keeps of a repr, an error, the prints.
# JSON nesting of an honest reply: reply, outcomes, outcome, then up to 3 levels (tagged
# value, its items, a dict pair) per plain level.
_MAX_JSON_DEPTH = 8 + 3 * 33


@dataclasses.dataclass(frozen=True)
class Case:
  """One test case: `function(*args)` must return a value plain_equal to `want`."""
  function: str
  args: tuple
  want: object


def typed_key(value):
  """A key equal for two plain values exactly when plain_equal holds between them, built
  of str only: str hashes are salted, so no reply can choose keys that collide, and
  1, 1.0 and True (or 0.0 and -0.0) stay three (two) keys. TypeError if not hashable."""
  t = type(value)
  if value is None:
    return ("N",)
  if t is bool:
    return ("B", "1" if value else "0")
  if t is int:
    return ("I", str(value))
  if t is float:
    return ("F", float.__repr__(value))
  if t is str:
    return ("S", value)
  if t is bytes:
    return ("Y", value.hex())
  if t is tuple:
    return ("T",) + tuple(typed_key(x) for x in value)
  raise TypeError(f"unhashable or not plain: {t.__name__}")


class PlainDict:
  """A dict decoded from a reply: its items in order, indexed by typed_key, never by the
  keys' own hashes (a reply of keys that all hash alike would cost the host quadratic
  time) nor their own equality (True would merge with 1)."""

  def __init__(self, items):
    self.items = tuple(items)
    self.index = {}
    for i, (k, _) in enumerate(self.items):
      self.index.setdefault(typed_key(k), i)

  def __len__(self):
    return len(self.items)

  def __repr__(self):
    parts, size = [], 2
    for k, v in self.items:  # Bounded: a report shows at most a short prefix.
      part = f"{short_repr(k, 40)}: {short_repr(v, 40)}"
      parts.append(part)
      size += len(part) + 2
      if size > 200:
        parts.append("...")
        break
    return "{" + ", ".join(parts) + "}"


def _dict_items(d) -> tuple[dict, int]:
  """({typed_key: value}, number of items) of a dict or a PlainDict."""
  if type(d) is PlainDict:
    return {key: d.items[i][1] for key, i in d.index.items()}, len(d.items)
  return {typed_key(k): v for k, v in dict.items(d)}, len(d)


def plain_equal(got, want) -> bool:
  """Equality of plain data, types included: an object whose __eq__ always says True, a
  str subclass, 1 for True or 1.0, or -0.0 for 0.0 does not pass, nor does a dict whose
  keys differ in type. Floats are equal when their reprs are (so NaN equals NaN).
  Expected values are literals, so this is what "equal" means for a test here. `got` may
  hold PlainDicts (as decoded from a reply) where `want` holds dicts."""
  if type(want) is dict:
    if type(got) not in (dict, PlainDict):
      return False
    try:
      got_items, n_got = _dict_items(got)
      want_items, n_want = _dict_items(want)
    except TypeError:
      return False
    return (n_got == n_want and len(got_items) == n_got and len(want_items) == n_want
            and all(k in want_items and plain_equal(v, want_items[k])
                    for k, v in got_items.items()))
  if type(got) is not type(want):
    return False
  if type(want) in (list, tuple):
    return len(got) == len(want) and all(plain_equal(a, b) for a, b in zip(got, want))
  if type(want) is float:
    return float.__repr__(got) == float.__repr__(want)
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


def build_request(task, cases, module_source: bytes | None, sandbox_cfg, stage_dir: str,
                  send_source: bool) -> dict:
  """The sandbox request of one graded run of `cases` (the task's visible or hidden ones):
  inputs only, never an expected value. The reply may take what an honest reply to these
  calls can (sandbox_server.reply_limit), at most sandbox.max_reply_bytes."""
  calls = []
  for i in run_order(cases):
    tagged = encode_plain(cases[i].args, 1 << 20)
    if tagged is None:  # Our own generator makes only plain arguments.
      raise ValueError(f"case {i} of task {task.seed} has arguments that are not plain data")
    calls.append([cases[i].function, tagged[1]])
  limit = reply_limit(len(calls), sandbox_cfg.max_value_chars, _MAX_REPR, _MAX_OUTPUT)
  return {"kind": "calls", "module": task.module_path[:-3], "module_file": task.module_path,
          "functions": tested_functions(task), "calls": calls, "stage_dir": stage_dir,
          "source_b64": (base64.b64encode(module_source).decode("ascii")
                         if send_source and module_source is not None else None),
          "max_repr": _MAX_REPR, "max_output": _MAX_OUTPUT,
          "max_value_chars": sandbox_cfg.max_value_chars,
          "max_reply_bytes": min(limit, sandbox_cfg.max_reply_bytes)}


def _text(x) -> str:
  if not isinstance(x, str):
    raise MalformedReply("expected a string")
  return x[:_MAX_TEXT]


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # A JSON string literal, escapes included.
_KEEP_BRACKETS = {c: None for c in range(128) if chr(c) not in "[]{}"}


def _nesting_within(text: str, max_depth: int) -> bool:
  """False if `text`'s brackets (strings aside) nest deeper than 2 * max_depth or do not
  balance; True for any depth up to max_depth. At C speed: each pass deletes the innermost
  pairs, one or two levels, so json.loads then recurses a bounded depth."""
  skeleton = _STRING.sub("", text).translate(_KEEP_BRACKETS)
  for _ in range(max_depth):
    if not skeleton:
      return True
    shorter = skeleton.replace("[]", "").replace("{}", "")
    if len(shorter) == len(skeleton):
      return False  # Unbalanced: json.loads says how.
    skeleton = shorter
  return not skeleton


def parse_reply(task, cases, reply: str, max_value_chars: int = 4096) -> GradeReport:
  """Decodes a graded run's reply to `cases` and compares it, case by case, with their
  expected values.

  Total: MalformedReply, saying why, on any reply that is unreadable as a whole (not
  JSON, larger than an honest reply, nested too deep, the wrong shape); an unreadable
  outcome fails only its case. The cost is linear in the reply's size, which is bounded:
  size and nesting are checked before parsing, and each value is decoded under
  sandbox_server's caps (depth, dict size, max_value_chars) into PlainDicts."""
  if not isinstance(reply, str):
    raise MalformedReply("not text")
  limit = reply_limit(len(cases), max_value_chars, _MAX_REPR, _MAX_OUTPUT)
  if len(reply) > limit:  # The sandbox caps it there too; this side trusts no one.
    raise MalformedReply(f"{len(reply)} chars, more than an honest reply's {limit}")
  if not _nesting_within(reply, _MAX_JSON_DEPTH):
    raise MalformedReply(f"nested deeper than {_MAX_JSON_DEPTH} levels, or unbalanced")
  try:
    data = json.loads(reply)
  except (ValueError, RecursionError) as e:
    raise MalformedReply(f"not JSON ({type(e).__name__})") from None
  if not isinstance(data, dict):
    raise MalformedReply("not an object")
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
    results.append(_judge(out, case, call, want, task, assert_lines, max_value_chars))
  return GradeReport(tuple(results), None, output)


def _judge(out, case, call, want, task, assert_lines, max_value_chars) -> CaseResult:
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
    # The value cap has slack over the sandbox's: an honest value always decodes.
    got = decode_plain(out["value"], max_value_chars, PlainDict)
  except MalformedReply as e:
    return CaseResult(call, "error",
                      error=f"the sandbox's answer for this case is unreadable: {e}")
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

