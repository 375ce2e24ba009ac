"""The tool-call text format, its strict-but-total parser and its inverse.

Grammar (one call per turn; every byte is a token for a byte-level model, so
the format is small):

    action  := free-text OPEN call CLOSE free-text
    OPEN    := "<tool_call>"            (one special token in the tokenizer)
    CLOSE   := "</tool_call>"           (one special token in the tokenizer)
    call    := header | header "\\n" raw_body
    header  := NAME (" " ARG)*          (one line, printable ASCII; runs of spaces
                                         separate; leading/trailing spaces ignored)
    ARG     := INT | PATH
    INT     := [0-9]{1,7}
    PATH    := printable ASCII without spaces, at most `max_path_chars` characters
    raw_body:= any text without OPEN or CLOSE; one trailing "\\n" is dropped,
               so the body "x" may be written "…\\nx</tool_call>" or "…\\nx\\n</tool_call>"

Text outside the tags is the agent's thought and is ignored. The action must
hold exactly one OPEN and, after it, exactly one CLOSE.

Tools (positional arguments in this order; [..] optional):

    ls                              list the files of the workspace
    view PATH [START [END]]         show a file with line numbers (START..END inclusive)
    replace PATH START END          replace lines START..END with the body's lines;
      <body>                        END = START - 1 inserts before START; an empty
                                    (or absent) body deletes the lines
    test                            run the test suite
    python                          run the body as a Python script in the sandbox
      <body>
    submit                          end the episode; the reward is the test pass rate

Body text becomes lines by splitting on "\\n" ("" is zero lines; "a\\n" is the two
lines "a" and ""). For example:

    <tool_call>view calc.py 1 20</tool_call>
    <tool_call>replace calc.py 4 4
        return x * 3</tool_call>

`parse_tool_call(text)` never raises: it returns a `ToolCall` or a
`ToolCallError` whose message tells the agent what was wrong.
`format_tool_call(name, **args)` is its inverse (raises ValueError on bad input):
parse_tool_call(format_tool_call(n, **a)) == ToolCall(n, a).
"""

from __future__ import annotations

import dataclasses
import re

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_INT_RE = re.compile(r"[0-9]{1,7}")
_HEADER_CHARS_RE = re.compile(r"[\x20-\x7e]*")
_PATH_CHARS_RE = re.compile(r"[\x21-\x7e]+")


@dataclasses.dataclass(frozen=True)
class Param:
  name: str
  kind: str  # "path" or "int"
  optional: bool = False
  description: str = ""  # For the JSON schema (json_tool_call.tool_schemas).


@dataclasses.dataclass(frozen=True)
class ToolSpec:
  name: str
  params: tuple[Param, ...]
  body: str | None = None  # Name of the body argument, when the tool takes one.
  body_required: bool = False  # A non-empty body is required.
  usage: str = ""
  description: str = ""  # What the tool does, for the JSON schema.
  body_description: str = ""


_PATH = Param("path", "path", description="a file of the workspace, relative to its root")
TOOL_SPECS: dict[str, ToolSpec] = {
    s.name: s for s in (
        ToolSpec("ls", (), usage="ls", description="List the files of the workspace."),
        ToolSpec("view", (_PATH, Param("start", "int", True, "the first line shown (from 1)"),
                          Param("end", "int", True, "the last line shown (inclusive)")),
                 usage="view PATH [START [END]]",
                 description="Show a file with line numbers, lines start..end inclusive."),
        ToolSpec("replace", (_PATH, Param("start", "int", description="the first line replaced"),
                             Param("end", "int", description="the last line replaced; "
                                   "start - 1 inserts before start")),
                 body="text", usage="replace PATH START END, then the new lines",
                 description="Replace lines start..end of a file with the lines of text.",
                 body_description="the new lines, separated by newlines; empty deletes"),
        ToolSpec("test", (), usage="test", description="Run the test suite."),
        ToolSpec("python", (), body="code", body_required=True,
                 usage="python, then the script on the following lines",
                 description="Run a Python script in the sandbox.",
                 body_description="the script"),
        ToolSpec("submit", (), usage="submit",
                 description="End the episode; the reward is the test pass rate."),
    )
}


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  args: dict


@dataclasses.dataclass(frozen=True)
class ToolCallError:
  message: str
  tool: str | None = None  # The tool name, when the header got that far.


def _usage(spec: ToolSpec) -> str:
  return f"usage: {spec.usage}"


def extract_call(text, example: str, max_call_chars: int) -> str | ToolCallError:
  """The text between the one OPEN and the one CLOSE of an action (any format of call)."""
  if not isinstance(text, str):
    return ToolCallError(f"action must be text, got {type(text).__name__}")
  n_open = text.count(TOOL_CALL_OPEN)
  if n_open == 0:
    return ToolCallError(f"no tool call found: write one call as {example}")
  if n_open > 1:
    return ToolCallError(f"{n_open} tool calls found: emit exactly one {TOOL_CALL_OPEN} per turn")
  start = text.index(TOOL_CALL_OPEN) + len(TOOL_CALL_OPEN)
  n_close = text.count(TOOL_CALL_CLOSE)
  end = text.find(TOOL_CALL_CLOSE, start)
  if end < 0:
    return ToolCallError(f"unterminated tool call: {TOOL_CALL_OPEN} without a following "
                         f"{TOOL_CALL_CLOSE}")
  if n_close > 1:
    return ToolCallError(f"{n_close} {TOOL_CALL_CLOSE} tags found: emit exactly one call per turn")
  inner = text[start:end]
  if len(inner) > max_call_chars:
    return ToolCallError(f"tool call too long: {len(inner)} characters, limit {max_call_chars}")
  return inner


def _parse(text: str, max_call_chars: int, max_body_chars: int,
           max_path_chars: int) -> ToolCall | ToolCallError:
  inner = extract_call(text, f"{TOOL_CALL_OPEN}NAME ARGS{TOOL_CALL_CLOSE}", max_call_chars)
  if isinstance(inner, ToolCallError):
    return inner

  nl = inner.find("\n")
  header, raw_body = (inner, None) if nl < 0 else (inner[:nl], inner[nl + 1:])
  header = header.rstrip("\r")
  if not _HEADER_CHARS_RE.fullmatch(header):
    return ToolCallError("the first line of a tool call must be printable ASCII "
                         "(tool name and arguments separated by spaces)")
  words = header.split()
  if not words:
    return ToolCallError("empty tool call: the first line must start with a tool name "
                         f"({', '.join(TOOL_SPECS)})")
  name, arg_words = words[0], words[1:]
  spec = TOOL_SPECS.get(name)
  if spec is None:
    shown = name if len(name) <= 40 else name[:40] + "..."
    return ToolCallError(f"unknown tool {shown!r}; tools: {', '.join(TOOL_SPECS)}")

  n_required = sum(not p.optional for p in spec.params)
  if len(arg_words) < n_required:
    missing = spec.params[len(arg_words)].name.upper()
    return ToolCallError(f"{name}: missing {missing}; {_usage(spec)}", name)
  if len(arg_words) > len(spec.params):
    extra = len(arg_words) - len(spec.params)
    return ToolCallError(f"{name}: {extra} unexpected argument(s); {_usage(spec)}", name)
  args: dict = {}
  for p, word in zip(spec.params, arg_words):
    if p.kind == "int":
      if not _INT_RE.fullmatch(word):
        shown = word if len(word) <= 20 else word[:20] + "..."
        return ToolCallError(f"{name}: {p.name.upper()} must be a line number "
                             f"(1 to 7 digits), got {shown!r}; {_usage(spec)}", name)
      args[p.name] = int(word)
    else:
      if len(word) > max_path_chars:
        return ToolCallError(f"{name}: {p.name.upper()} is {len(word)} characters, "
                             f"limit {max_path_chars}", name)
      args[p.name] = word

  if spec.body is None:
    if raw_body is not None and raw_body.strip():
      return ToolCallError(f"{name} takes no body (nothing after the first line); "
                           f"{_usage(spec)}", name)
  else:
    body = "" if raw_body is None else raw_body
    if body.endswith("\n"):
      body = body[:-1]
    if len(body) > max_body_chars:
      return ToolCallError(f"{name}: body is {len(body)} characters, limit {max_body_chars}",
                           name)
    if spec.body_required and not body.strip():
      return ToolCallError(f"{name}: the body is empty; {_usage(spec)}", name)
    args[spec.body] = body
  return ToolCall(name, args)


def parse_tool_call(text: str, *, max_call_chars: int = 4000, max_body_chars: int = 3000,
                    max_path_chars: int = 120) -> ToolCall | ToolCallError:
  """Parses one action. Total: every input gives a ToolCall or a ToolCallError."""
  try:
    return _parse(text, max_call_chars, max_body_chars, max_path_chars)
  except Exception as e:  # Totality is the contract; a parser bug must not kill the env.
    return ToolCallError(f"internal parser error ({type(e).__name__}); please report")


def format_tool_call(name: str, **args) -> str:
  """Renders a call in the grammar above; raises ValueError on anything it cannot render."""
  spec = TOOL_SPECS.get(name)
  if spec is None:
    raise ValueError(f"unknown tool {name!r}; tools: {', '.join(TOOL_SPECS)}")
  known = {p.name for p in spec.params} | ({spec.body} if spec.body else set())
  unknown = sorted(set(args) - known)
  if unknown:
    raise ValueError(f"{name}: unknown argument(s) {unknown}; {_usage(spec)}")
  words = [name]
  seen_absent = None
  for p in spec.params:
    if p.name not in args:
      if not p.optional:
        raise ValueError(f"{name}: missing argument {p.name!r}; {_usage(spec)}")
      seen_absent = p.name
      continue
    if seen_absent is not None:
      raise ValueError(f"{name}: {p.name!r} given without {seen_absent!r}")
    v = args[p.name]
    if p.kind == "int":
      if isinstance(v, bool) or not isinstance(v, int) or not _INT_RE.fullmatch(str(v)):
        raise ValueError(f"{name}: {p.name} must be an int in [0, 9999999], got {v!r}")
      words.append(str(v))
    else:
      if not isinstance(v, str) or not _PATH_CHARS_RE.fullmatch(v):
        raise ValueError(f"{name}: {p.name} must be printable ASCII without spaces, got {v!r}")
      words.append(v)
  call = " ".join(words)
  if spec.body is not None:
    body = args.get(spec.body, "")
    if not isinstance(body, str):
      raise ValueError(f"{name}: {spec.body} must be str, got {type(body).__name__}")
    if TOOL_CALL_OPEN in body or TOOL_CALL_CLOSE in body:
      raise ValueError(f"{name}: {spec.body} may not contain {TOOL_CALL_OPEN} or {TOOL_CALL_CLOSE}")
    if spec.body_required and not body.strip():
      raise ValueError(f"{name}: {spec.body} must be non-empty")
    call += "\n" + body + "\n"
  return TOOL_CALL_OPEN + call + TOOL_CALL_CLOSE
