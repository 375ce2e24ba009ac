"""`config.tokenizer` defined once: TokenizerSpec <-> ConfigDict, with named errors."""

import pytest

from agentic_rl.config_schema import ConfigError
from agentic_rl.rollout.tokenizer import SPECIAL_TOKENS
from agentic_rl.rollout.tokenizer_config import (SpecialTokensSpec, TokenizerSpec,
                                                 default_tokenizer_config,
                                                 validate_tokenizer_config)
from tests.dict_sections import DictSections

# The layout config files and configs/assets/base_tiny_bpe/config.json use.
DEFAULTS = {
    "kind": "byte", "path": "",
    "special_tokens": {
        "pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|eos|>", "system": "<|system|>",
        "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|tool|>",
        "end_turn": "<|end_turn|>", "tool_call_start": "<tool_call>",
        "tool_call_end": "</tool_call>"},
    "chat_template": "", "stop_tokens": (),
}


def test_the_generated_config_dict_keeps_the_layout():
  assert default_tokenizer_config().to_dict() == DEFAULTS
  # The byte tokenizer numbers its specials in this order: it must not move.
  assert list(SPECIAL_TOKENS) == ["pad", "bos", "eos", "system", "user", "assistant", "tool",
                                  "end_turn", "tool_call_start", "tool_call_end"]
  assert dict(SPECIAL_TOKENS) == SpecialTokensSpec().as_dict()


def test_the_spec_is_hashable_and_validate_is_repeatable():
  a = validate_tokenizer_config(default_tokenizer_config())
  b = validate_tokenizer_config(default_tokenizer_config())
  assert a == b == TokenizerSpec(kind="byte") and hash(a) == hash(b)


def test_an_override_of_one_special_token_keeps_the_others():
  c = default_tokenizer_config()
  c.kind, c.path, c.special_tokens.bos = "hf", "tok.json", "<s>"
  spec = validate_tokenizer_config(c)
  assert spec.special_tokens.as_dict() == {**SPECIAL_TOKENS, "bos": "<s>"}


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update({"paht": "x"}),
     "config.tokenizer has unknown field paht; valid fields: chat_template, kind, path, "
     "special_tokens, stop_tokens."),
    (lambda c: c.special_tokens.update({"eot": "<|eot|>"}),
     "config.tokenizer.special_tokens has unknown field eot; valid fields: assistant, bos, "),
    (lambda c: c.update({"kind": "bpe"}),
     "config.tokenizer.kind='bpe': expected one of ('byte', 'hf')."),
    (lambda c: c.update({"kind": "hf"}), "config.tokenizer.path='': expected the path of a "),
    (lambda c: c.update({"path": 3}), "config.tokenizer.path=3: expected a string."),
    (lambda c: c.special_tokens.update({"eos": ""}),
     "config.tokenizer.special_tokens.eos='': expected a non-empty token string."),
    (lambda c: c.update({"chat_template": "file"}),
     "config.tokenizer.chat_template='file': expected '' (the byte tokenizer has the built-in "
     "layout; a chat template needs kind='hf')."),
    (lambda c: c.update({"kind": "hf", "path": "d", "stop_tokens": ["<|eom_id|>"]}),
     "config.tokenizer.stop_tokens=('<|eom_id|>',): expected () (extra stop tokens go with a "
     "chat_template"),
    (lambda c: c.update({"kind": "hf", "path": "d", "chat_template": "file",
                         "stop_tokens": [""]}),
     "config.tokenizer.stop_tokens[0]='': expected a non-empty added-token string."),
    (lambda c: (c.update({"kind": "hf", "path": "d", "chat_template": "file"}),
                c.special_tokens.update({"eos": "<|im_end|>"})),
     "config.tokenizer.special_tokens={'pad': '<|pad|>', 'bos': '<|bos|>', 'eos': "
     "'<|im_end|>'"),
])
def test_bad_values_name_their_full_path(edit, message):
  c = default_tokenizer_config().to_dict()  # A plain dict: ConfigDict refuses some bad types.
  edit(DictSections(c))
  with pytest.raises(ConfigError) as e:
    validate_tokenizer_config(c)
  assert message in str(e.value), str(e.value)


