"""The tool-call grammar: hand-written cases, round trips and totality under fuzzing."""

import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentic_rl.envs.tool_call import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_SPECS, ToolCall,
                                       ToolCallError, format_tool_call, parse_tool_call)


def call(inner: str, before: str = "", after: str = "") -> str:
  return before + TOOL_CALL_OPEN + inner + TOOL_CALL_CLOSE + after


@pytest.mark.parametrize("text,expected", [
    (call("ls"), ToolCall("ls", {})),
    (call("test", "I will run the tests.\n", "\n"), ToolCall("test", {})),
    (call("view calc.py"), ToolCall("view", {"path": "calc.py"})),
    (call("view calc.py 3"), ToolCall("view", {"path": "calc.py", "start": 3})),
    (call("  view   calc.py 3 9 "), ToolCall("view", {"path": "calc.py", "start": 3, "end": 9})),
    (call("replace calc.py 4 4\n    return x"),
     ToolCall("replace", {"path": "calc.py", "start": 4, "end": 4, "text": "    return x"})),
    (call("replace calc.py 4 4\n    return x\n"),
     ToolCall("replace", {"path": "calc.py", "start": 4, "end": 4, "text": "    return x"})),
    (call("replace calc.py 4 5\na\n\n"),
     ToolCall("replace", {"path": "calc.py", "start": 4, "end": 5, "text": "a\n"})),
    (call("replace calc.py 4 5"), ToolCall("replace", {"path": "calc.py", "start": 4, "end": 5,
                                                       "text": ""})),
    (call("python\nprint(1)\n"), ToolCall("python", {"code": "print(1)"})),
    (call("submit\n"), ToolCall("submit", {})),
    (call("view ../../etc/passwd"), ToolCall("view", {"path": "../../etc/passwd"})),
])
def test_parses_valid_calls(text, expected):
  assert parse_tool_call(text) == expected


@pytest.mark.parametrize("text,fragment", [
    ("just thinking, no call", "no tool call found"),
    (TOOL_CALL_OPEN + "ls", "unterminated"),
    (call("ls") + call("test"), "2 tool calls"),
    (TOOL_CALL_CLOSE + call("ls"), "2 </tool_call> tags"),
    (call(""), "empty tool call"),
    (call("   \nbody"), "empty tool call"),
    (call("rm -rf /"), "unknown tool 'rm'"),
    (call("view"), "missing PATH"),
    (call("view a.py 1 2 3"), "1 unexpected argument"),
    (call("view a.py one"), "START must be a line number"),
    (call("view a.py -1"), "START must be a line number"),
    (call("view a.py 12345678"), "START must be a line number"),
    (call("replace a.py 1"), "missing END"),
    (call("ls\nextra text"), "takes no body"),
    (call("python"), "the body is empty"),
    (call("python\n   \n"), "the body is empty"),
    (call("view caf\u00e9.py"), "printable ASCII"),
    (call("view a.py\t1"), "printable ASCII"),
    (call("view " + "a" * 500), "limit 120"),
    (call("python\n" + "x" * 3001), "limit 3000"),
    (call("python\n" + "x" * 5000), "tool call too long"),
])
def test_rejects_malformed_calls_with_clear_messages(text, fragment):
  result = parse_tool_call(text)
  assert isinstance(result, ToolCallError)
  assert fragment in result.message, result.message


def test_error_carries_the_tool_name_once_known():
  assert parse_tool_call(call("view")).tool == "view"
  assert parse_tool_call(call("nope")).tool is None


def test_non_text_action_is_an_error_not_an_exception():
  assert isinstance(parse_tool_call(None), ToolCallError)
  assert isinstance(parse_tool_call(b"<tool_call>ls</tool_call>"), ToolCallError)


def test_format_examples_are_exact():
  assert format_tool_call("ls") == "<tool_call>ls</tool_call>"
  assert format_tool_call("view", path="a.py", start=2) == "<tool_call>view a.py 2</tool_call>"
  assert (format_tool_call("replace", path="a.py", start=1, end=1, text="x = 1")
          == "<tool_call>replace a.py 1 1\nx = 1\n</tool_call>")


@pytest.mark.parametrize("name,args,fragment", [
    ("rm", {}, "unknown tool"),
    ("view", {}, "missing argument 'path'"),
    ("view", {"path": "a.py", "end": 3}, "'end' given without 'start'"),
    ("view", {"path": "a b"}, "printable ASCII without spaces"),
    ("view", {"path": "a.py", "start": -1}, r"int in \[0, 9999999\]"),
    ("view", {"path": "a.py", "start": True}, r"int in \[0, 9999999\]"),
    ("ls", {"path": "a.py"}, "unknown argument"),
    ("python", {"code": " "}, "non-empty"),
    ("replace", {"path": "a", "start": 1, "end": 1, "text": "a</tool_call>"}, "may not contain"),
])
def test_format_rejects_what_it_cannot_render(name, args, fragment):
  with pytest.raises(ValueError, match=fragment):
    format_tool_call(name, **args)


_PATHS = st.text(alphabet=string.ascii_letters + string.digits + "_./-~:@", min_size=1,
                 max_size=120)
_INTS = st.integers(min_value=0, max_value=9_999_999)
_BODIES = st.text(max_size=400).filter(
    lambda b: TOOL_CALL_OPEN not in b and TOOL_CALL_CLOSE not in b)


@st.composite
def valid_calls(draw):
  name = draw(st.sampled_from(sorted(TOOL_SPECS)))
  spec = TOOL_SPECS[name]
  args = {}
  for p in spec.params:
    if p.optional and not draw(st.booleans()):
      break
    args[p.name] = draw(_INTS if p.kind == "int" else _PATHS)
  if spec.body is not None:
    body = draw(_BODIES)
    if spec.body_required and not body.strip():
      body = "x" + body
    args[spec.body] = body
  return name, args


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_calls(), st.text(max_size=40).filter(lambda t: "<tool_call>" not in t
                                                  and "</tool_call>" not in t))
def test_parse_inverts_format(name_args, thought):
  name, args = name_args
  text = format_tool_call(name, **args)
  assert parse_tool_call(thought + text + thought) == ToolCall(name, args)


_ALPHABET = st.sampled_from(["<tool_call>", "</tool_call>", "\n", " ", "view", "replace",
                             "python", "ls", "test", "submit", "1", "a.py", "\r", "\t", "\x00",
                             "\u00e9", "-", ".."]) | st.characters()


@settings(max_examples=600, deadline=None)
@given(st.lists(_ALPHABET, max_size=30).map("".join))
def test_parser_is_total_on_arbitrary_text(text):
  result = parse_tool_call(text, max_call_chars=200, max_body_chars=100, max_path_chars=20)
  assert isinstance(result, (ToolCall, ToolCallError))
  if isinstance(result, ToolCallError):
    assert result.message and not result.message.startswith("internal")
  else:
    spec = TOOL_SPECS[result.name]
    assert set(result.args) <= {p.name for p in spec.params} | {spec.body}
    # What parses must render back to a call that parses to the same thing.
    assert parse_tool_call(format_tool_call(result.name, **result.args)) == result


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_parser_is_total_on_decoded_bytes(raw):
  text = raw.decode("utf-8", errors="replace")
  result = parse_tool_call(TOOL_CALL_OPEN + text + TOOL_CALL_CLOSE)
  assert isinstance(result, (ToolCall, ToolCallError))
  if isinstance(result, ToolCallError):
    assert not result.message.startswith("internal")
