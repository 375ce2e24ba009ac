"""A model's own chat layout: its jinja chat template over its tokenizer.json.

`TemplateTokenizer` renders conversations with the template the model was trained with
(the `chat_template` of tokenizer_config.json, or chat_template.jinja beside it), the way
transformers' `apply_chat_template` renders them: the same jinja environment
(`compile_template`: sandboxed, trim_blocks, lstrip_blocks, loopcontrols, its `tojson`,
`raise_exception`, `strftime_now`) and the same variables (the named special tokens of
tokenizer_config.json: bos_token, eos_token, ...), then encodes the text with special
tokens parsed.

The engine's pieces come from renders of the template, not from hand-written strings:

  prompt       render_conversation([system?, user], add_generation_prompt=True)
  model turn   the model's tokens, up to and including a stop id (mask 1)
  observation  observation_turn(text): the ids after an assistant turn's end-of-turn token
               up to the next generation prompt, for a tool message holding `text`
  next prompt  generation_prompt()

`generation_prompt` is the difference of a probe conversation rendered with and without
add_generation_prompt; the end-of-turn token (`end_turn_id`) is the added token the template
writes right after an assistant message's content; `observation_turn` cuts the text
between that token and the next generation prompt out of a render of
[user, assistant, tool(text)]. Construction checks on that probe that the pieces, encoded
one by one, are the encoding of their text as a whole (the template's boundaries fall on
added tokens), and refuses a template for which they are not. For Qwen3 the observation of
"out" is "\\n<|im_start|>user\\n<tool_response>\\nout\\n</tool_response><|im_end|>\\n".

What holds (tests/hf/test_chat_template.py checks it against transformers): the ids the
engine lays out up to each generation prompt equal apply_chat_template(history,
add_generation_prompt=True) when every assistant content is what the template writes back
unchanged (its canonical form) and its tokens are the encoding of its text. Templates that
rewrite past assistant turns break the first condition: Qwen3's re-renders a content with
"</think>" as "<think>\\n" + reasoning.strip("\\n") + "\\n</think>\\n\\n" + answer, and adds
an empty think block to a final assistant message without one; Llama 3's trims contents.
So do templates whose generation prompt is not how they write a past assistant turn:
Qwen3 with enable_thinking=False prompts with an empty think block that its history
leaves out. The engine keeps what the model saw and its own tokens regardless (training
stays on-policy); only a re-render of such a history by transformers differs.

Untrusted text cannot forge control tokens: user and tool contents are marked as
transformers' `apply_chat_template(..., sanitize_control_tokens=True)` marks them (every
added token of the file in that text, whitespace tokens aside, is wrapped in private-use
markers before rendering; the markers themselves are removed from the text first), and the
marked tokens are encoded as plain text. With no added-token string in those contents the
ids are exactly transformers' default render. System text, assistant text and tool schemas
are ours or the model's, so their special-token strings become tokens, as transformers does.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from agentic_rl import resources
from agentic_rl.rollout.tokenizer import ChatTokenizer, decode_hf, surrogate_error

# Roles whose content is untrusted (the task and the environment's output).
UNTRUSTED_ROLES = frozenset({"user", "tool"})
# transformers' markers (utils/chat_template_utils.py): plane-15 private-use characters.
MARK_START, MARK_END = "\U000f0000", "\U000f0001"
# The template variables transformers passes: its named special tokens that are set.
SPECIAL_TOKEN_VARIABLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                           "cls_token", "mask_token")
# transformers passes a message's reasoning under each of these names.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Probe texts: plain words, so no boundary of theirs merges with the template's text.
_PROBE_USER, _PROBE_ASSISTANT, _PROBE_TOOL = "task", "action", "line one\n  line two"


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
  """The template compiled in transformers' jinja environment (ImmutableSandboxedEnvironment,
  trim_blocks, lstrip_blocks, loopcontrols, the same globals and `tojson`)."""
  import jinja2
  import jinja2.ext
  import jinja2.sandbox

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks the
    span for assistant masks; the engine knows its own masks)."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  class Namespace(jinja2.utils.Namespace):
    """Rejects underscore attributes, as transformers' TemplateNamespace does."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's own signature trick.
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        Namespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore attributes on a namespace: {name!r}")

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Not jinja's tojson, which escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=dict,
                     namespace=Namespace)
  return env.from_string(source)


def _token_content(value) -> str | None:
  """A tokenizer_config.json special token: a string, or an AddedToken dict, or null."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def load_template_dir(path: str, chat_template: str = "file") -> tuple[str, dict, str]:
  """(template text, tokenizer_config.json as a dict, where the template came from) for the
  tokenizer directory `path` (or its tokenizer.json). `chat_template` is 'file' (the
  directory's chat_template.jinja, else tokenizer_config.json's chat_template) or the path
  of a .jinja file; errors name config.tokenizer.chat_template and the file."""
  field = "config.tokenizer.chat_template"
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  config_path = os.path.join(directory, "tokenizer_config.json")
  config: dict = {}
  if os.path.isfile(config_path):
    try:
      with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    except (OSError, ValueError) as e:
      raise ValueError(f"{config_path} is not a readable JSON file: {e}") from e
    if not isinstance(config, dict):
      raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}.")
  if chat_template != "file":
    template_path = resources.resolve(chat_template)
    if not os.path.isfile(template_path):
      raise ValueError(f"{field}={chat_template!r}: no template file at {template_path}; "
                       "expected 'file' or the path of a .jinja file.")
    with open(template_path, encoding="utf-8") as f:
      return f.read(), config, template_path
  jinja_path = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      return f.read(), config, jinja_path
  template = config.get("chat_template")
  if isinstance(template, list):  # Named templates: transformers' default is 'default'.
    named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
    template = named.get("default")
  if not isinstance(template, str) or not template:
    raise ValueError(f"{field}='file': {directory} has no chat template (neither "
                     "chat_template.jinja nor a 'chat_template' string in "
                     "tokenizer_config.json); set it to the path of a .jinja file.")
  return template, config, f"{config_path} (chat_template)"


class TemplateTokenizer(ChatTokenizer):
  """A tokenizers.Tokenizer and its chat template; see the module docstring.

  `special_ids` holds 'end_turn', 'eos' and 'pad', and 'bos', 'tool_call_start' and
  'tool_call_end' where the file has them ('<tool_call>' / '</tool_call>' as added
  tokens): the template writes the role headers, so there are no role ids.
  `template_kwargs` are extra template variables (e.g. Qwen3's enable_thinking=False).
  """

  def __init__(self, hf_tokenizer, template: str, tokenizer_config: Mapping | None = None, *,
               stop_tokens: Sequence[str] = (), template_kwargs: Mapping | None = None,
               source: str = "the chat template"):
    import jinja2
    import tokenizers

    if not isinstance(hf_tokenizer, tokenizers.Tokenizer):
      raise TypeError(f"TemplateTokenizer wraps a tokenizers.Tokenizer, got "
                      f"{type(hf_tokenizer).__name__}.")
    self._tokenizer = hf_tokenizer
    self._source = source
    try:
      self._template = compile_template(template)
    except jinja2.TemplateError as e:
      raise ValueError(f"{source}: the chat template does not compile: {e}") from e
    config = dict(tokenizer_config or {})
    self._vocab_size = max(hf_tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    self._added_ids = {t.content: i for i, t in hf_tokenizer.get_added_tokens_decoder().items()}
    self._variables = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_VARIABLES}
    self._variables = {k: v for k, v in self._variables.items() if v is not None}
    self._variables.update(template_kwargs or {})
    # Marked in untrusted text: every added token but whitespace ones (a "\n" token would
    # mark every line break), longest first so no token is shadowed by a prefix of it.
    control = sorted((c for c in self._added_ids if not c.isspace()), key=len, reverse=True)
    pattern = "|".join(map(re.escape, control)) or "(?!)"
    self._control_re = re.compile(pattern)
    self._markers_re = re.compile(f"{MARK_START}({pattern}){MARK_END}|[{MARK_START}{MARK_END}]")
    self._added_re = re.compile(pattern)
    self._newline_ids = self._encode_normal("\n")

    self._generation_prompt_text, end_turn, self._observation_cut = self._derive_pieces()
    self._generation_prompt_ids = self.encode_rendered(self._generation_prompt_text)
    ids = {"end_turn": self._added_ids[end_turn]}
    eos = self._variables.get("eos_token")
    ids["eos"] = self._added_id(eos, "eos_token") if eos else ids["end_turn"]
    pad = self._variables.get("pad_token")
    ids["pad"] = self._added_id(pad, "pad_token") if pad else ids["eos"]
    bos = self._variables.get("bos_token")
    if bos:
      ids["bos"] = self._added_id(bos, "bos_token")
    for name, content in (("tool_call_start", "<tool_call>"), ("tool_call_end", "</tool_call>")):
      if content in self._added_ids:
        ids[name] = self._added_ids[content]
    self._special_ids = MappingProxyType(ids)
    stops = [ids["end_turn"]]
    for i, content in enumerate(stop_tokens):
      if content not in self._added_ids:
        raise ValueError(f"config.tokenizer.stop_tokens[{i}]={content!r}: not an added token "
                         f"of the tokenizer ({self._source}).")
      stops.append(self._added_ids[content])
    stops.append(ids["eos"])
    self._stop_ids = tuple(dict.fromkeys(stops))
    self._check_piecewise()

  @classmethod
  def from_dir(cls, path: str | os.PathLike, chat_template: str = "file", *,
               stop_tokens: Sequence[str] = (), template_kwargs: Mapping | None = None
               ) -> "TemplateTokenizer":
    """The tokenizer.json of `path` (a directory or the file) with its chat template."""
    import tokenizers

    path = resources.resolve(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise FileNotFoundError(f"no tokenizer file at {file}; expected a tokenizer.json.")
    try:
      hf_tokenizer = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # The Rust side raises its own exception type.
      raise ValueError(f"{file} is not a valid tokenizer.json: {e}") from e
    template, config, source = load_template_dir(path, chat_template)
    return cls(hf_tokenizer, template, config, stop_tokens=stop_tokens,
               template_kwargs=template_kwargs, source=source)

  # ---- text <-> ids ----

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def special_ids(self) -> Mapping[str, int]:
    return self._special_ids

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The template's end of turn, config.tokenizer.stop_tokens, then eos (tokenizer_config's
    eos_token; the end of turn when it has none). Where eos is the end of turn (Qwen3's
    <|im_end|>), a model turn that stops on it does not end the conversation."""
    return self._stop_ids

  @property
  def hf_tokenizer(self):
    return self._tokenizer

  def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
    """Added-token strings become their ids with parse_special; else all text is plain."""
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}.")
    surrogate_error(text)
    return self._encode_normal(text) if parse_special else self._encode_plain(text)

  def decode(self, ids: Iterable[int]) -> str:
    return decode_hf(self._tokenizer, self._vocab_size, ids)

  def _encode_normal(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def _encode_plain(self, text: str) -> list[int]:
    """The file's pipeline without its added tokens (transformers' _encode_without_added_tokens)."""
    t = self._tokenizer
    if t.normalizer is not None:
      text = t.normalizer.normalize_str(text)
    splits = [s for s, _ in t.pre_tokenizer.pre_tokenize_str(text)] if t.pre_tokenizer else [text]
    return [tok.id for s in splits for tok in t.model.tokenize(s)]

  def _encode_piece(self, piece: str, as_text: bool) -> list[int]:
    """A piece after a marker, encoded after a newline that is then dropped (transformers'
    _encode_chat_piece: a SentencePiece file would otherwise add a prefix space)."""
    encode = self._encode_plain if as_text else self._encode_normal
    ids = encode("\n" + piece)
    n = len(self._newline_ids)
    return ids[n:] if ids[:n] == self._newline_ids else encode(piece)

  def encode_rendered(self, text: str) -> list[int]:
    """Rendered template text -> ids: marked tokens as plain text, the rest with added
    tokens parsed (transformers' encode_marked_chat)."""
    surrogate_error(text)
    pieces = self._markers_re.split(text)
    ids = self._encode_normal(pieces[0])
    for i, piece in enumerate(pieces[1:], start=1):
      if not piece:
        continue
      as_text = i % 2 == 1  # Odd pieces are marked tokens.
      piece_ids = self._encode_piece(piece, as_text)
      if as_text and self._added_ids[piece] in piece_ids:
        raise ValueError(f"{piece!r} cannot be encoded as text: the tokenizer produces its "
                         "id from plain text.")
      ids += piece_ids
    return ids

  def _mark(self, text: str) -> str:
    text = text.replace(MARK_START, "").replace(MARK_END, "")
    return self._control_re.sub(lambda m: MARK_START + m.group() + MARK_END, text)

  # ---- rendering ----

  def _messages(self, turns) -> list[dict]:
    messages = []
    for i, turn in enumerate(turns):
      if isinstance(turn, Mapping):
        if "role" not in turn:
          raise ValueError(f"turn {i} is a mapping without a 'role' key: keys are {sorted(turn)}.")
        message = dict(turn)
      else:
        role, content = turn
        message = {"role": role, "content": content}
      if message["role"] in UNTRUSTED_ROLES and isinstance(message.get("content"), str):
        message["content"] = self._mark(message["content"])
      reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None),
                       None)
      if reasoning is not None:  # As transformers passes it: under every name.
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
      messages.append(message)
    return messages

  def render_text(self, turns, *, add_generation_prompt: bool = False,
                  tools: Sequence[Mapping] | None = None) -> str:
    """The template's text for (role, content) pairs or message dicts (which may carry
    tool_calls or reasoning_content); untrusted contents come back marked."""
    import jinja2

    messages = self._messages(turns)
    if not messages:
      raise ValueError("cannot render an empty conversation.")
    try:
      return self._template.render(messages=messages, tools=list(tools) if tools else None,
                                   documents=None, add_generation_prompt=add_generation_prompt,
                                   **self._variables)
    except jinja2.TemplateError as e:
      raise ValueError(f"{self._source}: the chat template raised: {e}") from e

  def render_conversation(self, turns, *, add_generation_prompt: bool = False,
                          tools: Sequence[Mapping] | None = None) -> list[int]:
    """The ids of the template's render: apply_chat_template(turns, tools=tools)."""
    return self.encode_rendered(self.render_text(
        turns, add_generation_prompt=add_generation_prompt, tools=tools))

  def render_turn(self, role: str, text: str, *, parse_special: bool | None = None) -> list[int]:
    raise NotImplementedError(
        f"{self._source}: a chat template renders a turn in its context; use "
        "render_conversation, generation_prompt and observation_turn.")

  def generation_prompt(self) -> list[int]:
    return list(self._generation_prompt_ids)

  def observation_turn(self, text: str) -> list[int]:
    """The ids after an assistant turn's end-of-turn token, up to the next generation
    prompt, for a tool message with content `text` (untrusted: marked)."""
    full = self.render_text(self._probe(text), add_generation_prompt=True)
    prefix, end_len = self._observation_cut
    if not full.startswith(prefix) or not full.endswith(self._generation_prompt_text):
      raise ValueError(f"{self._source}: the template renders the turns before or after a "
                       "tool message differently depending on its content; the engine cannot "
                       "lay out observations with it.")
    return self.encode_rendered(full[len(prefix):len(full) - end_len])

  # ---- the pieces, from probe renders ----

  @staticmethod
  def _probe(observation: str):
    return [("user", _PROBE_USER), ("assistant", _PROBE_ASSISTANT), ("tool", observation)]

  def _derive_pieces(self) -> tuple[str, str, tuple[str, int]]:
    """(generation prompt text, end-of-turn token, (the probe render's text before its
    observation, the length of the generation prompt after it))."""
    src = self._source
    head = self.render_text(self._probe("")[:1], add_generation_prompt=True)
    bare = self.render_text(self._probe("")[:1], add_generation_prompt=False)
    if not head.startswith(bare) or head == bare:
      raise ValueError(f"{src}: add_generation_prompt must append a generation prompt to the "
                       f"render; got {bare!r} and {head!r}.")
    prompt_text = head[len(bare):]
    full = self.render_text(self._probe(_PROBE_TOOL), add_generation_prompt=True)
    at = full.find(_PROBE_ASSISTANT, len(bare)) if full.startswith(bare) else -1
    if at < 0:
      raise ValueError(f"{src}: a render with an assistant and a tool message must extend the "
                       f"render without them and hold the assistant's content; got {bare!r} "
                       f"and {full!r}.")
    match = self._added_re.match(full, at + len(_PROBE_ASSISTANT))
    if match is None:
      rest = full[at + len(_PROBE_ASSISTANT):]
      raise ValueError(f"{src}: the template writes {rest[:40]!r} after an assistant "
                       "message's content; expected an end-of-turn token (an added token).")
    if not full.endswith(prompt_text):
      raise ValueError(f"{src}: a render with add_generation_prompt does not end with the "
                       f"generation prompt {prompt_text!r}.")
    self._probe_text = head + full[at:]  # The engine's layout of the probe, as text.
    return prompt_text, match.group(), (full[:match.end()], len(prompt_text))

  def _added_id(self, content: str, name: str) -> int:
    if content not in self._added_ids:
      raise ValueError(f"{self._source}: {name} {content!r} of tokenizer_config.json is not an "
                       "added token of tokenizer.json.")
    return self._added_ids[content]

  def _check_piecewise(self) -> None:
    """The engine's pieces, encoded one by one, must be the encoding of their text."""
    full = self.encode_rendered(self._probe_text)
    pieces = (self.render_conversation(self._probe("")[:1], add_generation_prompt=True)
              + self.encode(_PROBE_ASSISTANT) + [self.end_turn_id]
              + self.observation_turn(_PROBE_TOOL) + self.generation_prompt())
    if pieces != full:
      raise ValueError(f"{self._source}: the template's turns do not tokenize piece by piece "
                       f"(prompt, model turn, end of turn, observation, generation prompt): "
                       f"{pieces} != {full}; the engine cannot lay out its conversations.")

  def __repr__(self) -> str:
    return f"TemplateTokenizer({self._source!r}, vocab_size={self.vocab_size})"
