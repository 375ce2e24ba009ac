"""The host-side grader's pieces against hand-computed values: the plain-data wire
format, plain equality, the run order and the rendering of a reply."""

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentic_rl.envs.grading import (Case, MalformedReply, decode_plain, parse_reply,
                                     plain_equal, run_order)
from agentic_rl.envs.sandbox_server import encode_plain
from agentic_rl.envs.swe_tasks import generate_task

scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
           | st.text(max_size=8) | st.binary(max_size=8))
plain = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                     | st.lists(kids, max_size=4).map(tuple)
                     | st.dictionaries(st.integers() | st.text(max_size=4), kids, max_size=3),
                     max_leaves=12)


def _same(a, b):
  if type(a) is not type(b):
    return False
  if isinstance(a, (list, tuple)):
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
  if isinstance(a, dict):
    return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
  return a == b or (a != a and b != b)


@settings(max_examples=200, deadline=None)
@given(plain)
def test_plain_data_round_trips_type_exactly(value):
  tagged = encode_plain(value, 1 << 16)
  assert tagged is not None
  assert _same(decode_plain(json.loads(json.dumps(tagged))), value)


class _Int(int):
  pass


class _Eq:
  def __eq__(self, other):
    return True


@pytest.mark.parametrize("value", [_Int(3), _Eq(), [1, _Eq()], {"k": object()}, {1, 2},
                                   range(3), "x" * 5000, [[[[[]]]]] * 2000])
def test_values_that_are_not_plain_or_too_big_do_not_encode(value):
  assert encode_plain(value, 4096) is None


def test_deep_nesting_does_not_encode():
  v = []
  for _ in range(100):
    v = [v]
  assert encode_plain(v, 1 << 20) is None


@pytest.mark.parametrize("tagged", [
    "x", [], ["Q"], ["I", "12a"], ["I", 5], ["B", 1], ["F", "1" * 100], ["Y", "zz"],
    ["L", "notalist"], ["D", [[["L", []], ["N"]]]], ["D", [["S", "k"]]], ["N", 1],
])
def test_decode_rejects_what_encode_never_writes(tagged):
  with pytest.raises(MalformedReply):
    decode_plain(tagged)


def test_plain_equal_by_hand():
  assert plain_equal([1, (2, "a")], [1, (2, "a")])
  assert not plain_equal(1, True) and not plain_equal(True, 1)
  assert not plain_equal(1.0, 1) and not plain_equal([1], (1,))
  assert not plain_equal(_Int(1), 1) and not plain_equal(_Eq(), 1)
  assert not plain_equal({"a": 1}, {"a": 1, "b": 2})


def test_run_order_is_unittests():
  cases = (Case("zeta", (1,), 1), Case("alpha", (2,), 2), Case("zeta", (3,), 3),
           Case("alpha", (4,), 4))
  assert run_order(cases) == [1, 3, 0, 2]


def _task_with(cases, functions):
  t = generate_task(0, "easy")
  return dataclasses.replace(t, cases=tuple(cases), functions=tuple(functions),
                             num_tests=len(cases))


def test_parse_reply_judges_each_outcome_by_hand():
  cases = [Case("f", (1, [2]), 3), Case("f", (2, []), [1]), Case("g", ("a",), True),
           Case("g", ("b",), False)]
  task = _task_with(cases, ["g", "f"])
  # Run order: f's cases, then g's.
  reply = {"import_error": None, "import_where": "", "output": "printed",
           "outcomes": [{"status": "value", "value": ["I", "3"]},
                        {"status": "value", "value": ["T", [["I", "1"]]]},
                        {"status": "value", "repr": "<object at 0x1>"},
                        {"status": "error", "error": "ValueError: no", "where": ""}]}
  report = parse_reply(task, task.cases, json.dumps(reply))
  got = [(r.call, r.status, r.got, r.want, r.error) for r in report.results]
  assert got == [("f(1, [2])", "pass", "", "", ""), ("f(2, [])", "fail", "(1,)", "[1]", ""),
                 ("g('a')", "fail", "<object at 0x1>", "True", ""),
                 ("g('b')", "error", "", "", "ValueError: no")]
  assert report.passed == 1 and report.output == "printed" and report.import_error is None
  # An error raised outside the module is placed where the test calls it, as unittest did.
  assert report.results[3].where == ""  # g has no assertEqual line in this task's test file.


def test_parse_reply_import_error_and_malformed_replies():
  task = generate_task(0, "easy")
  r = parse_reply(task, task.cases, json.dumps({"import_error": "SyntaxError: bad",
                                                "import_where": "", "outcomes": [],
                                                "output": ""}))
  assert r.passed == 0 and r.import_error == f"SyntaxError: bad ({task.test_path}:2)"
  for bad in ("nope", "[]", json.dumps({"import_error": None, "outcomes": [1]}),
              json.dumps({"import_error": None, "outcomes": "x"})):
    with pytest.raises(MalformedReply):
      parse_reply(task, task.cases, bad)
  # One unreadable outcome fails its own case only.
  n = len(task.cases)
  outs = [{"status": "value", "value": ["Q"]}] + [{"status": "error", "error": "E"}] * (n - 1)
  r = parse_reply(task, task.cases,
                  json.dumps({"import_error": None, "outcomes": outs, "output": ""}))
  assert r.results[0].status == "error" and "unreadable" in r.results[0].error
