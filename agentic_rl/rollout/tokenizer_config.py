"""The `config.tokenizer` section: which tokenizer a run uses, its special-token strings and
its chat layout (the built-in one, or the model's jinja chat template).

`TokenizerSpec` holds the defaults and checks (agentic_rl/config_schema.py);
`default_tokenizer_config` generates the ConfigDict that config files edit, and
`validate_tokenizer_config` builds the spec back by field name, so a bad value is a
`ValueError` naming `config.tokenizer.<field>`. `tokenizer.make_tokenizer` builds the
tokenizer from it. This module imports no tokenizer, so tokenizer.py can take its special
tokens from here.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from agentic_rl.config_schema import check, from_config_dict, one_of, to_config_dict

TOKENIZER_KINDS = ("byte", "hf")


@dataclasses.dataclass(frozen=True)
class SpecialTokensSpec:
  """`config.tokenizer.special_tokens`: our special-token name -> its string. The defaults
  are the byte tokenizer's fixed strings (tokenizer.SPECIAL_TOKENS, in this order); with
  kind='hf' each must be an added token of the file."""

  pad: str = "<|pad|>"
  bos: str = "<|bos|>"
  eos: str = "<|eos|>"
  system: str = "<|system|>"
  user: str = "<|user|>"
  assistant: str = "<|assistant|>"
  tool: str = "<|tool|>"
  end_turn: str = "<|end_turn|>"
  tool_call_start: str = "<tool_call>"
  tool_call_end: str = "</tool_call>"

  def __post_init__(self):
    for name, content in self.as_dict().items():
      check(isinstance(content, str) and bool(content), name, content,
            "a non-empty token string")

  def as_dict(self) -> dict[str, str]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
  """`config.tokenizer` as checked. `kind` has no default: a section that leaves it out is
  an error rather than a silent byte tokenizer."""

  kind: str  # 'byte' | 'hf'
  path: str = ""  # hf: a tokenizer.json, or a directory holding one.
  # hf, built-in layout: our special-token name -> the file's added-token string.
  special_tokens: SpecialTokensSpec = SpecialTokensSpec()
  # '' = the built-in layout (tokenizer.py); 'file' = the chat template of the tokenizer's
  # directory (chat_template.jinja, else tokenizer_config.json's chat_template); else the
  # path of a .jinja file. The template's layout replaces special_tokens (chat_template.py).
  chat_template: str = ""
  # chat_template: added tokens that also end a model turn, beyond the template's end of
  # turn and eos (e.g. Llama 3.1's '<|eom_id|>').
  stop_tokens: tuple[str, ...] = ()

  def __post_init__(self):
    one_of(self.kind, "kind", TOKENIZER_KINDS)
    if self.kind == "byte":
      check(self.path == "", "path", self.path,
            "'' (a path is only used with kind='hf'; the byte tokenizer has no file)")
      fixed = SpecialTokensSpec().as_dict()
      for name, content in self.special_tokens.as_dict().items():
        check(content == fixed[name], f"special_tokens.{name}", content,
              f"{fixed[name]!r}: the byte tokenizer's special tokens are fixed (they are only "
              "configurable with kind='hf')")
      check(self.chat_template == "", "chat_template", self.chat_template,
            "'' (the byte tokenizer has the built-in layout; a chat template needs kind='hf')")
    else:
      check(bool(self.path), "path", self.path,
            "the path of a tokenizer.json (or of a directory holding one) when kind='hf'")
    if self.chat_template:
      check(self.special_tokens == SpecialTokensSpec(), "special_tokens",
            self.special_tokens.as_dict(), "the defaults: with a chat_template the template "
            "writes the turns, so these built-in layout names are unused")
    else:
      check(self.stop_tokens == (), "stop_tokens", self.stop_tokens,
            "() (extra stop tokens go with a chat_template; the built-in layout stops on "
            "special_tokens.end_turn and eos)")
    for i, token in enumerate(self.stop_tokens):
      check(bool(token), f"stop_tokens[{i}]", token, "a non-empty added-token string")


def default_tokenizer_config() -> ml_collections.ConfigDict:
  """config.tokenizer: the byte tokenizer; kind='hf' with path loads a tokenizer.json."""
  return to_config_dict(TokenizerSpec(kind="byte"))


def validate_tokenizer_config(tokenizer_config) -> TokenizerSpec:
  return from_config_dict(TokenizerSpec, tokenizer_config, "config.tokenizer")
