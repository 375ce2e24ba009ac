"""Native tool calls: the JSON format of Qwen3 (Hermes), over the same tools as the grammar.

    <tool_call>
    {"name": "view", "arguments": {"path": "calc.py", "start": 1, "end": 20}}
    </tool_call>

Exactly what Qwen3's chat template writes for an assistant message's `tool_calls`, so a
model trained on that template calls our tools in its own format. The tools, their
parameters and their meaning are tool_call.TOOL_SPECS; a tool's body (replace's `text`,
python's `code`) is one more string argument. `tool_schemas` gives the JSON schemas the
template's `tools` variable renders into the system prompt.

Parsing is as strict as the grammar's and as total: `parse_json_tool_call(text)` returns
a `ToolCall` (the same args the grammar's parser gives for the same call: ints, paths of
printable ASCII without spaces, the body as a str, "" when absent) or a `ToolCallError`
telling the agent what was wrong, never an exception. Text before the call is the agent's
thought; everything up to the first "</think>" (Qwen3's reasoning, whether or not the
model wrote its "<think>") is skipped, so tags mentioned while thinking do not count. The action must then hold exactly one
<tool_call> ... </tool_call> with one JSON object {"name": str, "arguments": object}
inside ("arguments" may be left out for a tool without parameters, or be a string that
holds the object, as Qwen3's template accepts).

`format_json_tool_call(name, **args)` is its inverse (raises ValueError on bad input):
parse_json_tool_call(format_json_tool_call(n, **a)) == ToolCall(n, a), with a body tool's
body "" when not given.
"""

from __future__ import annotations

import json
import re

from agentic_rl.envs.tool_call import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_SPECS, ToolCall,
                                       ToolCallError, ToolSpec, extract_call)

THINK_CLOSE = "</think>"
EXAMPLE = f'{TOOL_CALL_OPEN}\n{{"name": NAME, "arguments": {{...}}}}\n{TOOL_CALL_CLOSE}'
MAX_INT = 9_999_999  # The grammar's INT: at most 7 digits.
_PATH_CHARS_RE = re.compile(r"[\x21-\x7e]+")
_TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)


def json_usage(spec: ToolSpec) -> str:
  """'view(path, start?, end?)': a tool's arguments, for the env's first observation."""
  names = [p.name + ("?" if p.optional else "") for p in spec.params]
  if spec.body:
    names.append(spec.body + ("" if spec.body_required else "?"))
  return f"{spec.name}({', '.join(names)})"


def tool_schemas(names=None) -> list[dict]:
  """The JSON schemas (OpenAI function format, as chat templates take them) of the tools
  `names` (default: all), from TOOL_SPECS."""
  schemas = []
  for name in (TOOL_SPECS if names is None else names):
    spec = TOOL_SPECS[name]
    properties, required = {}, []
    for p in spec.params:
      properties[p.name] = {"type": "integer" if p.kind == "int" else "string",
                            "description": p.description}
      if not p.optional:
        required.append(p.name)
    if spec.body:
      properties[spec.body] = {"type": "string", "description": spec.body_description}
      if spec.body_required:
        required.append(spec.body)
    schemas.append({"type": "function", "function": {
        "name": spec.name, "description": spec.description,
        "parameters": {"type": "object", "properties": properties, "required": required}}})
  return schemas


def _usage(spec: ToolSpec) -> str:
  return f"usage: {json_usage(spec)}"


def _shown(value) -> str:
  text = repr(value)
  return text if len(text) <= 40 else text[:40] + "..."


def _check_args(spec: ToolSpec, arguments: dict, max_body_chars: int,
                max_path_chars: int) -> dict | str:
  """The call's args in the grammar's form, or what is wrong with them."""
  name = spec.name
  known = [p.name for p in spec.params] + ([spec.body] if spec.body else [])
  unknown = sorted(set(arguments) - set(known), key=str)
  if unknown:
    return f"{name}: unknown argument(s) {', '.join(map(_shown, unknown))}; {_usage(spec)}"
  args: dict = {}
  absent = None
  for p in spec.params:
    if p.name not in arguments:
      if not p.optional:
        return f"{name}: missing argument {p.name!r}; {_usage(spec)}"
      absent = absent or p.name
      continue
    if absent is not None:
      return f"{name}: {p.name!r} given without {absent!r}; {_usage(spec)}"
    v = arguments[p.name]
    if p.kind == "int":
      if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_INT:
        return (f"{name}: {p.name} must be a line number (an integer from 0 to {MAX_INT}), "
                f"got {_shown(v)}")
    else:
      if not isinstance(v, str) or not _PATH_CHARS_RE.fullmatch(v) or any(t in v for t in _TAGS):
        return f"{name}: {p.name} must be a path of printable ASCII without spaces, got {_shown(v)}"
      if len(v) > max_path_chars:
        return f"{name}: {p.name} is {len(v)} characters, limit {max_path_chars}"
    args[p.name] = v
  if spec.body:
    body = arguments.get(spec.body, "")
    if not isinstance(body, str):
      return f"{name}: {spec.body} must be a string, got {type(body).__name__}"
    if any(t in body for t in _TAGS):
      return f"{name}: {spec.body} may not contain {TOOL_CALL_OPEN} or {TOOL_CALL_CLOSE}"
    if len(body) > max_body_chars:
      return f"{name}: {spec.body} is {len(body)} characters, limit {max_body_chars}"
    if spec.body_required and not body.strip():
      return f"{name}: {spec.body} is empty; {_usage(spec)}"
    args[spec.body] = body
  return args


def _parse(text, max_call_chars: int, max_body_chars: int, max_path_chars: int
           ) -> ToolCall | ToolCallError:
  if isinstance(text, str) and THINK_CLOSE in text:  # The reasoning ends at the first one.
    text = text[text.index(THINK_CLOSE) + len(THINK_CLOSE):]
  inner = extract_call(text, EXAMPLE, max_call_chars)
  if isinstance(inner, ToolCallError):
    return inner
  try:
    call = json.loads(inner)
  except json.JSONDecodeError as e:
    return ToolCallError(f"the tool call is not valid JSON ({e.msg} at line {e.lineno} column "
                         f"{e.colno}); write {EXAMPLE}")
  except (ValueError, RecursionError):
    return ToolCallError(f"the tool call is not valid JSON; write {EXAMPLE}")
  if not isinstance(call, dict):
    return ToolCallError(f"the tool call must be a JSON object, got {type(call).__name__}; "
                         f"write {EXAMPLE}")
  extra = sorted(set(call) - {"name", "arguments"})
  if extra:
    return ToolCallError(f"the tool call has unknown key(s) {', '.join(map(_shown, extra))}; "
                         'expected "name" and "arguments"')
  name = call.get("name")
  if not isinstance(name, str):
    return ToolCallError(f'the tool call needs a "name" string; tools: {", ".join(TOOL_SPECS)}')
  spec = TOOL_SPECS.get(name)
  if spec is None:
    return ToolCallError(f"unknown tool {_shown(name)}; tools: {', '.join(TOOL_SPECS)}")
  arguments = call.get("arguments", {})
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments)
    except (ValueError, RecursionError):
      return ToolCallError(f'{name}: "arguments" is a string that is not a JSON object', name)
  if not isinstance(arguments, dict):
    return ToolCallError(f'{name}: "arguments" must be a JSON object; {_usage(spec)}', name)
  args = _check_args(spec, arguments, max_body_chars, max_path_chars)
  if isinstance(args, str):
    return ToolCallError(args, name)
  return ToolCall(name, args)


def parse_json_tool_call(text: str, *, max_call_chars: int = 4000, max_body_chars: int = 3000,
                         max_path_chars: int = 120) -> ToolCall | ToolCallError:
  """Parses one action. Total: every input gives a ToolCall or a ToolCallError."""
  try:
    return _parse(text, max_call_chars, max_body_chars, max_path_chars)
  except Exception as e:  # Totality is the contract; a parser bug must not kill the env.
    return ToolCallError(f"internal parser error ({type(e).__name__}); please report")


def format_json_tool_call(name: str, **args) -> str:
  """The call as Qwen3's template writes a `tool_calls` entry; raises ValueError on anything
  the parser would refuse (no length limits: those are the env's)."""
  spec = TOOL_SPECS.get(name)
  if spec is None:
    raise ValueError(f"unknown tool {name!r}; tools: {', '.join(TOOL_SPECS)}")
  checked = _check_args(spec, args, max_body_chars=2**62, max_path_chars=2**62)
  if isinstance(checked, str):
    raise ValueError(checked)
  # json.dumps' default separators are transformers' tojson: the template's own text.
  return (f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": '
          f"{json.dumps(checked, ensure_ascii=False)}}}\n{TOOL_CALL_CLOSE}")
