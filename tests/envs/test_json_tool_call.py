"""Native JSON tool calls: cases, round trips, totality under fuzzing, and the env with them."""

import json
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentic_rl.envs.datasets import SweTaskSource
from agentic_rl.envs.expert import play_expert
from agentic_rl.envs.json_tool_call import (EXAMPLE, format_json_tool_call, json_usage,
                                            parse_json_tool_call, tool_schemas)
from agentic_rl.envs.swe_env import SweEnv
from agentic_rl.envs.tool_call import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_SPECS, ToolCall,
                                       ToolCallError, format_tool_call, parse_tool_call)
from tests.envs.conftest import env_config
from tests.envs.test_tool_call import valid_calls


def call(obj, before="", after="") -> str:
  inner = obj if isinstance(obj, str) else json.dumps(obj)
  return before + TOOL_CALL_OPEN + "\n" + inner + "\n" + TOOL_CALL_CLOSE + after


@pytest.mark.parametrize("text,expected", [
    (call({"name": "ls", "arguments": {}}), ToolCall("ls", {})),
    (call({"name": "ls"}), ToolCall("ls", {})),
    (call({"name": "test", "arguments": {}}, "I will run the tests.\n", "\n"),
     ToolCall("test", {})),
    (call({"name": "view", "arguments": {"path": "calc.py", "start": 3}}),
     ToolCall("view", {"path": "calc.py", "start": 3})),
    (call('{"arguments": {"end": 9, "start": 3, "path": "calc.py"}, "name": "view"}'),
     ToolCall("view", {"path": "calc.py", "start": 3, "end": 9})),
    (call({"name": "view", "arguments": json.dumps({"path": "a.py"})}),
     ToolCall("view", {"path": "a.py"})),
    (call({"name": "replace", "arguments": {"path": "c.py", "start": 4, "end": 4}}),
     ToolCall("replace", {"path": "c.py", "start": 4, "end": 4, "text": ""})),
    (call({"name": "replace", "arguments": {"path": "c.py", "start": 4, "end": 5,
                                            "text": "a\n\n"}}),
     ToolCall("replace", {"path": "c.py", "start": 4, "end": 5, "text": "a\n\n"})),
    (call({"name": "python", "arguments": {"code": "print('<|im_end|>')"}}),
     ToolCall("python", {"code": "print('<|im_end|>')"})),
    # Qwen3's reasoning comes first and may mention tags.
    (call({"name": "submit", "arguments": {}}, "<think>\nnot <tool_call> yet\n</think>\n\n"),
     ToolCall("submit", {})),
    (call({"name": "submit", "arguments": {}}, "thinking without its opening tag</think>"),
     ToolCall("submit", {})),
])
def test_parses_valid_calls(text, expected):
  assert parse_json_tool_call(text) == expected


@pytest.mark.parametrize("text,fragment", [
    ("no call here", "no tool call found: write one call as " + EXAMPLE),
    (call({"name": "ls"}) + call({"name": "ls"}), "2 tool calls found"),
    (TOOL_CALL_OPEN + '{"name": "ls"}', "unterminated tool call"),
    (call("{'name': 'ls'}"), "not valid JSON (Expecting property name enclosed in double quotes "
                             "at line 2 column 2)"),
    (call('["ls"]'), "must be a JSON object, got list"),
    (call({"name": "ls", "args": {}}), "unknown key(s) 'args'; expected \"name\" and \"arguments\""),
    (call({"arguments": {}}), 'needs a "name" string'),
    (call({"name": "vew"}), "unknown tool 'vew'; tools: ls, view, replace, test, python, submit"),
    (call({"name": "view", "arguments": []}), '"arguments" must be a JSON object'),
    (call({"name": "view", "arguments": "{"}), "is a string that is not a JSON object"),
    (call({"name": "view", "arguments": {}}), "view: missing argument 'path'"),
    (call({"name": "view", "arguments": {"path": "a", "end": 3}}), "'end' given without 'start'"),
    (call({"name": "view", "arguments": {"path": "a", "start": "3"}}),
     "start must be a line number (an integer from 0 to 9999999), got '3'"),
    (call({"name": "view", "arguments": {"path": "a", "start": 2.0}}), "got 2.0"),
    (call({"name": "view", "arguments": {"path": "a", "start": True}}), "got True"),
    (call({"name": "view", "arguments": {"path": "a", "start": 10**7}}), "got 10000000"),
    (call({"name": "view", "arguments": {"path": "a b"}}), "printable ASCII without spaces"),
    (call({"name": "view", "arguments": {"path": "x" * 121}}), "121 characters, limit 120"),
    (call({"name": "ls", "arguments": {"path": "a"}}), "ls: unknown argument(s) 'path'; usage: ls()"),
    (call({"name": "python", "arguments": {"code": "  \n"}}), "python: code is empty"),
    (call({"name": "python", "arguments": {"code": 3}}), "code must be a string, got int"),
    (call({"name": "python", "arguments": {"code": "x" * 3001}}), "3001 characters, limit 3000"),
    (call('{"name": "python", "arguments": {"code": "a\\u003ctool_call>b"}}'),
     "may not contain <tool_call>"),
])
def test_rejects_malformed_calls_with_clear_messages(text, fragment):
  result = parse_json_tool_call(text)
  assert isinstance(result, ToolCallError), result
  assert fragment in result.message, result.message


def test_deep_nesting_is_an_error_not_a_crash():
  result = parse_json_tool_call(call("[" * 3900))
  assert isinstance(result, ToolCallError) and "not valid JSON" in result.message


def test_error_carries_the_tool_name_once_known():
  assert parse_json_tool_call(call({"name": "view"})).tool == "view"
  assert parse_json_tool_call(call({"name": "nope"})).tool is None


def test_format_is_qwen3s_tool_call_text():
  assert format_json_tool_call("view", path="calc.py", start=1, end=20) == (
      '<tool_call>\n{"name": "view", "arguments": {"path": "calc.py", "start": 1, "end": 20}}'
      "\n</tool_call>")
  assert format_json_tool_call("ls") == '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
  assert format_json_tool_call("python", code="print('é')") == (
      '<tool_call>\n{"name": "python", "arguments": {"code": "print(\'é\')"}}\n</tool_call>')


@pytest.mark.parametrize("name,args,fragment", [
    ("nope", {}, "unknown tool"),
    ("view", {}, "missing argument 'path'"),
    ("view", {"path": "a", "end": 2}, "'end' given without 'start'"),
    ("view", {"path": "a b"}, "printable ASCII"),
    ("view", {"path": "<tool_call>"}, "printable ASCII"),
    ("view", {"path": "a", "start": -1}, "line number"),
    ("ls", {"x": 1}, "unknown argument"),
    ("replace", {"path": "a", "start": 1, "end": 1, "text": "</tool_call>"}, "may not contain"),
    ("python", {"code": ""}, "code is empty"),
])
def test_format_rejects_what_the_parser_would(name, args, fragment):
  with pytest.raises(ValueError, match=fragment):
    format_json_tool_call(name, **args)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_calls(), st.text(max_size=40).filter(lambda t: "<tool_call>" not in t
                                                  and "</tool_call>" not in t
                                                  and "</think>" not in t))
def test_parse_inverts_format_and_agrees_with_the_grammar(name_args, thought):
  name, args = name_args
  text = format_json_tool_call(name, **args)
  assert parse_json_tool_call(thought + text + thought) == ToolCall(name, args)
  # The same call in the grammar parses to the same args, except the grammar's dropped
  # trailing newline of a body.
  spec = TOOL_SPECS[name]
  if spec.body is None or not args[spec.body].endswith("\n"):
    assert parse_tool_call(format_tool_call(name, **args)) == ToolCall(name, args)


_ALPHABET = st.sampled_from([
    "<tool_call>", "</tool_call>", "<think>", "</think>", "\n", " ", "{", "}", "[", "]", ":",
    ",", '"', '"name"', '"arguments"', '"view"', '"path"', '"start"', '"code"', '"python"',
    '"submit"', "1", "-1", "1.5", "true", "null", '"a.py"', "\\u003c", "\\", "\x00",
    "\u00e9"]) | st.characters()


@settings(max_examples=800, deadline=None)
@given(st.lists(_ALPHABET, max_size=40).map("".join))
def test_parser_is_total_on_arbitrary_text(text):
  result = parse_json_tool_call(text, max_call_chars=300, max_body_chars=100, max_path_chars=20)
  assert isinstance(result, (ToolCall, ToolCallError))
  if isinstance(result, ToolCallError):
    assert result.message and not result.message.startswith("internal")
  else:
    # What parses renders back to a call that parses to the same thing.
    assert parse_json_tool_call(format_json_tool_call(result.name, **result.args)) == result


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() |
                    st.text(string.printable, max_size=8),
                    lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(st.sampled_from(["name", "arguments", "path", "start", "end",
                                                     "text", "code", "x"]) | st.text(max_size=4),
                                    inner, max_size=4), max_leaves=12),
       st.sampled_from(sorted(TOOL_SPECS)))
def test_parser_is_total_on_arbitrary_json(value, name):
  for obj in (value, {"name": name, "arguments": value}):
    result = parse_json_tool_call(call(json.dumps(obj)))
    assert isinstance(result, (ToolCall, ToolCallError))
    assert not (isinstance(result, ToolCallError) and result.message.startswith("internal"))


def test_parser_is_total_on_non_text():
  for value in (None, 3, b"<tool_call>", ["x"]):
    result = parse_json_tool_call(value)
    assert isinstance(result, ToolCallError) and "must be text" in result.message


def test_schemas_come_from_the_tool_specs():
  schemas = {s["function"]["name"]: s["function"] for s in tool_schemas()}
  assert list(schemas) == list(TOOL_SPECS)
  view = schemas["view"]["parameters"]
  assert view["required"] == ["path"] and view["properties"]["start"]["type"] == "integer"
  replace = schemas["replace"]["parameters"]
  assert list(replace["properties"]) == ["path", "start", "end", "text"]
  assert replace["required"] == ["path", "start", "end"]
  assert schemas["python"]["parameters"]["required"] == ["code"]
  assert json_usage(TOOL_SPECS["view"]) == "view(path, start?, end?)"
  assert [s["function"]["name"] for s in tool_schemas(["ls", "submit"])] == ["ls", "submit"]


def test_the_env_and_the_expert_speak_json_when_configured():
  task = SweTaskSource("heldout", ("medium",))[1]
  with SweEnv(env_config(tool_format="json")) as env:
    result = play_expert(env, task)
    assert [s["function"]["name"] for s in env.tools] == [
        t for t in TOOL_SPECS if t in task.allowlist]
  assert EXAMPLE in result.first_observation and "view(path, start?, end?)" in (
      result.first_observation)
  assert result.solved and result.reward == 1.0
  for action, _ in result.turns:
    assert action.startswith('<tool_call>\n{"name": ')
    assert isinstance(parse_json_tool_call(action), ToolCall)
  with SweEnv(env_config()) as env:  # The grammar stays the default.
    env.reset(task)
    assert env.tools is None
    r = env.step(format_json_tool_call("ls"))
    assert r.info["decision"] == "error" and "empty tool call" in r.observation


def test_the_config_names_a_bad_tool_format():
  with pytest.raises(ValueError, match=r"config.env.tool_format='xml': expected one of "
                                       r"\('grammar', 'json'\)"):
    env_config(tool_format="xml")
