"""Tokenizers for rollouts: a byte-level default and a Hugging Face adapter.

Both implement `Tokenizer`: text <-> ids, named ids for the special tokens and
the chat rendering the rollout engine uses. `make_tokenizer(config.tokenizer)`
builds one from config.

Special tokens (name -> string; each is ONE id in every tokenizer):

  pad <|pad|>   bos <|bos|>   eos <|eos|>
  system <|system|>   user <|user|>   assistant <|assistant|>   tool <|tool|>
  end_turn <|end_turn|>
  tool_call_start <tool_call>   tool_call_end </tool_call>

Conversation layout (one trajectory, left to right):

  <|bos|>
  <|system|> system prompt <|end_turn|>
  <|user|> task <|end_turn|>
  <|assistant|> reasoning <tool_call>{"name": ..., "arguments": ...}</tool_call> <|end_turn|>
  <|tool|> observation <|end_turn|>
  <|assistant|> ... <|end_turn|>
  ...

(The spaces above are for reading; no separator tokens are inserted.)

- `render_turn(role, text)` = [role id] + encode(text) + [end_turn id];
  `observation_turn(text)` = render_turn("tool", text).
- `<|bos|>` appears once, at the start (`render_conversation` adds it).
- A model turn is prompted by `generation_prompt()` = [assistant id], which the
  engine writes (loss mask 0). The model's tokens are everything after it up
  to and including the first id in `stop_ids` (end_turn, or eos when the model
  ends the conversation itself); generating the stop id is part of the policy.
- Tool calls live inside the assistant's text, wrapped in exactly one
  <tool_call> ... </tool_call> pair per call.

Which text may contain special tokens: `render_turn` parses special-token
strings in 'system' and 'assistant' text (authored by us or by the model: a
written "<tool_call>" must become the tag id), but encodes 'user' and 'tool'
text verbatim (task text and environment output are untrusted: a file that
contains "<|end_turn|>" must not forge a turn boundary). `parse_special=`
overrides this per call.

With config.tokenizer.chat_template set, the layout is instead the model's own jinja chat
template over its tokenizer.json (agentic_rl/rollout/chat_template.py); the engine uses the
same methods (render_conversation, generation_prompt, observation_turn, stop_ids,
end_turn_id), so both layouts lay out trajectories alike.

Decoding never raises on ids a model can emit: ids outside [0, vocab_size)
decode to U+FFFD, and byte sequences that are not valid UTF-8 decode with
errors='replace' semantics (see `ByteTokenizer`).
"""

from __future__ import annotations

import abc
import codecs
import operator
import os
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from agentic_rl import resources
from agentic_rl.rollout import tokenizer_config

# The default special tokens, defined once as config.tokenizer.special_tokens' defaults; the
# byte tokenizer numbers them in this order.
SPECIAL_TOKENS: Mapping[str, str] = MappingProxyType(
    tokenizer_config.SpecialTokensSpec().as_dict())
ROLES = ("system", "user", "assistant", "tool")
# Roles whose text is parsed for special tokens by default (see module docstring).
_ROLES_PARSING_SPECIALS = frozenset({"system", "assistant"})
REPLACEMENT_CHAR = "\ufffd"


@runtime_checkable
class Tokenizer(Protocol):
  """What the rollout engine, envs and learner need from a tokenizer."""

  @property
  def vocab_size(self) -> int:
    """Ids in use are [0, vocab_size); the model's vocab must be at least this."""

  @property
  def special_ids(self) -> Mapping[str, int]:
    """Special-token name (keys of SPECIAL_TOKENS) -> its single id."""

  @property
  def bos_id(self) -> int: ...

  @property
  def eos_id(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def end_turn_id(self) -> int: ...

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end a model turn: end_turn, then eos."""

  def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
    """Text -> ids. With parse_special, special-token strings become their single ids."""

  def decode(self, ids: Iterable[int]) -> str:
    """Ids -> text; never raises on integer ids (unknown ids become U+FFFD)."""

  def encode_special(self, name: str) -> int: ...

  def render_turn(self, role: str, text: str, *, parse_special: bool | None = None) -> list[int]: ...

  def render_conversation(self, turns, *, add_generation_prompt: bool = False,
                          tools=None) -> list[int]: ...

  def generation_prompt(self) -> list[int]: ...

  def observation_turn(self, text: str) -> list[int]:
    """The ids between a model turn's stop id and the next generation prompt."""


def _as_id_list(ids) -> list[int]:
  """Accepts lists, tuples, numpy/jax 1-D integer arrays."""
  if hasattr(ids, "tolist"):
    ids = ids.tolist()
  try:
    return [operator.index(i) for i in ids]
  except TypeError as e:
    raise TypeError(f"decode expects a 1-D sequence of integer ids; got {type(ids).__name__} "
                    f"with an element that is not an integer ({e}).") from None


class ChatTokenizer(abc.ABC):
  """Named special ids and chat rendering on top of `encode` and `special_ids`."""

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int: ...

  @property
  @abc.abstractmethod
  def special_ids(self) -> Mapping[str, int]: ...

  @abc.abstractmethod
  def encode(self, text: str, *, parse_special: bool = True) -> list[int]: ...

  @abc.abstractmethod
  def decode(self, ids: Iterable[int]) -> str: ...

  def encode_special(self, name: str) -> int:
    try:
      return self.special_ids[name]
    except KeyError:
      raise KeyError(f"unknown special token name {name!r}; expected one of "
                     f"{tuple(SPECIAL_TOKENS)}.") from None

  @property
  def bos_id(self) -> int:
    return self.special_ids["bos"]

  @property
  def eos_id(self) -> int:
    return self.special_ids["eos"]

  @property
  def pad_id(self) -> int:
    return self.special_ids["pad"]

  @property
  def end_turn_id(self) -> int:
    return self.special_ids["end_turn"]

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.end_turn_id, self.eos_id)

  def render_turn(self, role: str, text: str, *, parse_special: bool | None = None) -> list[int]:
    """[role id] + encode(text) + [end_turn id]; see the module docstring for parse_special."""
    if role not in ROLES:
      raise ValueError(f"role={role!r}: expected one of {ROLES}.")
    if not isinstance(text, str):
      raise TypeError(f"render_turn({role!r}, ...) expects text as str, got {type(text).__name__}.")
    if parse_special is None:
      parse_special = role in _ROLES_PARSING_SPECIALS
    return [self.special_ids[role], *self.encode(text, parse_special=parse_special),
            self.end_turn_id]

  def generation_prompt(self) -> list[int]:
    """The ids that open a model turn."""
    return [self.special_ids["assistant"]]

  def observation_turn(self, text: str) -> list[int]:
    """The ids that follow a model turn's stop id up to the next generation prompt, for an
    environment observation: here the tool turn."""
    return self.render_turn("tool", text)

  def render_conversation(self, turns: Iterable[tuple[str, str] | Mapping[str, str]], *,
                          add_generation_prompt: bool = False,
                          tools: Iterable[Mapping] | None = None) -> list[int]:
    """[bos] + render_turn of each (role, text) pair or {'role', 'content'} dict.

    `tools` (JSON schemas) are for chat templates that render them; the built-in layout
    has no place for them and leaves them out: the environment's observation describes
    its tools."""
    ids = [self.bos_id]
    for i, turn in enumerate(turns):
      if isinstance(turn, Mapping):
        if "role" not in turn or "content" not in turn:
          raise ValueError(f"turn {i} is a mapping without 'role' and 'content' keys: "
                           f"keys are {sorted(turn)}.")
        role, text = turn["role"], turn["content"]
      else:
        role, text = turn
      ids.extend(self.render_turn(role, text))
    if add_generation_prompt:
      ids.extend(self.generation_prompt())
    return ids


def require_vocab_fits(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Raises unless every id the tokenizer uses is an id of the model."""
  if tokenizer.vocab_size > model_vocab_size:
    raise ValueError(
        f"the tokenizer uses {tokenizer.vocab_size} ids but config.model.vocab_size="
        f"{model_vocab_size}; set config.model.vocab_size >= {tokenizer.vocab_size}.")


# ---------------------------------------------------------------------------
# Byte tokenizer.

_DECODE_ERRORS = "agentic_rl.replace_keep_surrogates"


def _replace_keep_surrogates(err: UnicodeError):
  """errors='replace', except that surrogatepass-encoded surrogates decode back.

  `ByteTokenizer.encode` writes lone surrogates (legal in a Python str, e.g.
  from os.fsdecode) as their 3-byte surrogatepass form, so they must decode
  back for the round trip; every other invalid sequence gets U+FFFD exactly
  as errors='replace' would.
  """
  if not isinstance(err, UnicodeDecodeError):
    raise err
  chunk = err.object[err.start:err.start + 3]
  try:
    char = bytes(chunk).decode("utf-8", "surrogatepass")
  except UnicodeDecodeError:
    char = ""
  if len(char) == 1 and "\ud800" <= char <= "\udfff":
    return char, err.start + 3
  return REPLACEMENT_CHAR, err.end


codecs.register_error(_DECODE_ERRORS, _replace_keep_surrogates)


class ByteTokenizer(ChatTokenizer):
  """UTF-8 bytes as ids 0..255, then one id per special token (256..265).

  Round trip: decode(encode(s)) == s for every Python str s, including lone
  surrogates (encoded with surrogatepass) and text holding special-token
  strings or pieces of them. Hence encode(decode(x)) == x for every x that
  encode produced (with parse_special=True).

  Decoding ids a model emitted: byte runs that are not valid UTF-8 decode with
  errors='replace' semantics (one U+FFFD per maximal invalid subpart), except
  that the 3-byte surrogatepass form of a surrogate decodes to the surrogate;
  ids outside [0, vocab_size) (e.g. the model's unused ids 266..319) decode to
  U+FFFD. Such lossy decodes do not re-encode to the same ids.
  """

  NUM_BYTES = 256

  def __init__(self):
    self._special_ids = MappingProxyType(
        {name: self.NUM_BYTES + i for i, name in enumerate(SPECIAL_TOKENS)})
    self._id_to_special = {i: SPECIAL_TOKENS[name] for name, i in self._special_ids.items()}
    self._string_to_id = {SPECIAL_TOKENS[name]: i for name, i in self._special_ids.items()}
    # Longest first, so no special is shadowed by a special that is its prefix.
    alternatives = sorted(SPECIAL_TOKENS.values(), key=len, reverse=True)
    self._special_pattern = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")

  @property
  def vocab_size(self) -> int:
    return self.NUM_BYTES + len(SPECIAL_TOKENS)

  @property
  def special_ids(self) -> Mapping[str, int]:
    return self._special_ids

  def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}.")
    if not parse_special:
      return list(text.encode("utf-8", "surrogatepass"))
    ids: list[int] = []
    # re.split with a capture group alternates plain text and special strings.
    for k, piece in enumerate(self._special_pattern.split(text)):
      if k % 2:
        ids.append(self._string_to_id[piece])
      else:
        ids.extend(piece.encode("utf-8", "surrogatepass"))
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    parts: list[str] = []
    run = bytearray()

    def flush():
      if run:
        parts.append(run.decode("utf-8", _DECODE_ERRORS))
        run.clear()

    for i in _as_id_list(ids):
      if 0 <= i < self.NUM_BYTES:
        run.append(i)
        continue
      flush()
      parts.append(self._id_to_special.get(i, REPLACEMENT_CHAR))
    flush()
    return "".join(parts)

  def __repr__(self) -> str:
    return f"ByteTokenizer(vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------
# Hugging Face `tokenizers` adapter.


_SURROGATE = re.compile("[\ud800-\udfff]")


class HFTokenizer(ChatTokenizer):
  """A `tokenizers.Tokenizer` (tokenizer.json) behind the `Tokenizer` protocol.

  `special_tokens` maps our names (SPECIAL_TOKENS keys) to the file's added
  tokens; names left out keep the default strings. Every name must map to an
  added token of the file, so that it is one id and encode maps its string to
  that id. Only 'pad' may share its id with another name (pad == eos is
  common).

  encode never runs the file's post-processor (no automatic BOS/EOS: the chat
  rendering places them). With parse_special=False every added token of the
  file, ours included, is encoded as plain text.

  Round trip: decode(encode(s)) == s holds when the file's pipeline is
  lossless (e.g. ByteLevel pre-tokenizer and decoder, add_prefix_space=False,
  no normalizer); a lossy file (lowercasing, prefix spaces) stays lossy.
  `tokenizers` only accepts valid Unicode, so text with lone surrogates is
  rejected with a ValueError. Out-of-range ids decode to U+FFFD; invalid
  UTF-8 follows the file's decoder (ByteLevel: U+FFFD).
  """

  def __init__(self, hf_tokenizer, special_tokens: Mapping[str, str] | None = None, *,
               source: str = "the tokenizer"):
    import tokenizers  # Deferred: only this adapter needs the package.

    if not isinstance(hf_tokenizer, tokenizers.Tokenizer):
      raise TypeError(f"HFTokenizer wraps a tokenizers.Tokenizer, got {type(hf_tokenizer).__name__}.")
    self._source = source
    self._tokenizer = hf_tokenizer
    self._special_tokens = _merge_special_tokens(special_tokens)
    added = hf_tokenizer.get_added_tokens_decoder()  # id -> AddedToken
    added_ids = {t.content: i for i, t in added.items()}
    self._special_ids = {}
    for name, content in self._special_tokens.items():
      if content not in added_ids:
        raise ValueError(self._missing_special_message(name, content, added))
      self._special_ids[name] = added_ids[content]
    self._check_distinct_ids()
    self._special_ids = MappingProxyType(self._special_ids)
    self._vocab_size = max(hf_tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    # A clone that encodes every added token as text, for parse_special=False.
    # encode_special_tokens only covers tokens flagged special, so ours are
    # re-added as special there (same content, same id).
    self._verbatim = tokenizers.Tokenizer.from_str(hf_tokenizer.to_str())
    self._verbatim.add_special_tokens([
        tokenizers.AddedToken(c, special=True, normalized=False)
        for c in self._special_tokens.values() if not added[added_ids[c]].special])
    for name, content in self._special_tokens.items():
      if self._verbatim.token_to_id(content) != self._special_ids[name]:
        raise RuntimeError(f"{source}: re-flagging {content!r} as special changed its id.")
    self._verbatim.encode_special_tokens = True

  @classmethod
  def from_file(cls, path: str | os.PathLike, special_tokens: Mapping[str, str] | None = None
                ) -> "HFTokenizer":
    """Loads a tokenizer.json, or the tokenizer.json inside a model directory."""
    import tokenizers

    path = resources.resolve(path)
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no tokenizer file at {path}; expected a tokenizer.json written "
                              "by the Hugging Face `tokenizers` library.")
    try:
      hf_tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # The Rust side raises its own exception type.
      raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e
    return cls(hf_tokenizer, special_tokens, source=path)

  def _missing_special_message(self, name, content, added) -> str:
    contents = [t.content for _, t in sorted(added.items())]
    shown = ", ".join(map(repr, contents[:24])) + (", ..." if len(contents) > 24 else "")
    vocab_id = self._tokenizer.token_to_id(content)
    why = (f"it is an ordinary vocabulary entry (id {vocab_id}), not an added token, so encode "
           "would not map its string to one id" if vocab_id is not None
           else "the file has no such token")
    return (f"{self._source}: required special token {name!r} maps to {content!r}, but {why}. "
            f"Set config.tokenizer.special_tokens.{name} to one of the file's "
            f"{len(contents)} added tokens: [{shown}].")

  def _check_distinct_ids(self):
    owners: dict[int, str] = {}
    for name, i in self._special_ids.items():
      if name == "pad":
        continue
      if i in owners:
        raise ValueError(
            f"{self._source}: special tokens {owners[i]!r} and {name!r} both map to "
            f"{self._special_tokens[name]!r} (id {i}); only 'pad' may share an id.")
      owners[i] = name

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def special_ids(self) -> Mapping[str, int]:
    return self._special_ids

  @property
  def special_tokens(self) -> Mapping[str, str]:
    return dict(self._special_tokens)

  @property
  def hf_tokenizer(self):
    return self._tokenizer

  def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
    if not isinstance(text, str):
      raise TypeError(f"encode expects str, got {type(text).__name__}.")
    surrogate_error(text)
    tok = self._tokenizer if parse_special else self._verbatim
    return tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[int]) -> str:
    return decode_hf(self._tokenizer, self._vocab_size, ids)

  def __repr__(self) -> str:
    return f"HFTokenizer({self._source!r}, vocab_size={self.vocab_size})"


def surrogate_error(text: str) -> None:
  """Raises on a lone surrogate, which Hugging Face tokenizers cannot encode."""
  surrogate = _SURROGATE.search(text)
  if surrogate:
    raise ValueError(f"text has a lone surrogate {surrogate.group()!r} at index "
                     f"{surrogate.start()}; Hugging Face tokenizers only encode valid Unicode "
                     "(use ByteTokenizer for such text).")


def decode_hf(hf_tokenizer, vocab_size: int, ids: Iterable[int]) -> str:
  """A tokenizers.Tokenizer's decode that never raises: out-of-range ids become U+FFFD."""
  parts: list[str] = []
  run: list[int] = []
  for i in _as_id_list(ids):
    if 0 <= i < vocab_size:
      run.append(i)
      continue
    if run:
      parts.append(hf_tokenizer.decode(run, skip_special_tokens=False))
      run = []
    parts.append(REPLACEMENT_CHAR)
  if run:
    parts.append(hf_tokenizer.decode(run, skip_special_tokens=False))
  return "".join(parts)


def _merge_special_tokens(overrides: Mapping[str, str] | None,
                          field: str = "special_tokens") -> dict[str, str]:
  merged = dict(SPECIAL_TOKENS)
  if overrides is None:
    return merged
  unknown = sorted(set(overrides) - set(SPECIAL_TOKENS))
  if unknown:
    raise ValueError(f"{field} has unknown names {unknown}; expected names from "
                     f"{tuple(SPECIAL_TOKENS)}.")
  for name, content in overrides.items():
    if not isinstance(content, str) or not content:
      raise ValueError(f"{field}.{name}={content!r}: expected a non-empty token string.")
    merged[name] = content
  return merged


# ---------------------------------------------------------------------------
# Config (the section itself is tokenizer_config.py).


def make_tokenizer(config) -> ChatTokenizer:
  """Builds the tokenizer `config.tokenizer` describes (a ConfigDict or a TokenizerSpec);
  errors name the field."""
  spec = tokenizer_config.validate_tokenizer_config(config)
  if spec.kind == "byte":
    return ByteTokenizer()
  resolved = resources.resolve(spec.path)
  if not (os.path.isfile(resolved) or os.path.isfile(os.path.join(resolved, "tokenizer.json"))):
    raise ValueError(f"config.tokenizer.path={spec.path!r}: no tokenizer.json at {resolved}.")
  if spec.chat_template:
    from agentic_rl.rollout import chat_template  # It builds on this module.
    return chat_template.TemplateTokenizer.from_dir(resolved, spec.chat_template,
                                                    stop_tokens=spec.stop_tokens)
  return HFTokenizer.from_file(resolved, spec.special_tokens.as_dict())
