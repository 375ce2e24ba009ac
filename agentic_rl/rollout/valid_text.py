"""Text that always tokenizes: the one place lone surrogates are replaced.

A Python str may hold code points U+D800..U+DFFF (from surrogateescape decoding,
an exception message, a model's byte-level decode), but UTF-8 cannot encode them,
so Hugging Face tokenizers and file writes reject them. The rollout engine and the
SFT renderer pass every observation and every action through `valid_text` before
any tokenizer or environment sees it.
"""

from __future__ import annotations

import re

REPLACEMENT_CHAR = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(text: str) -> str:
  """`text` with every surrogate code point (U+D800..U+DFFF) replaced by U+FFFD.

  Every other character is kept, so valid text comes back unchanged (the same
  object). A pair of surrogates is replaced too: in a str they are two code points,
  not the character UTF-16 would make of them.
  """
  if not isinstance(text, str):
    raise TypeError(f"valid_text expects str, got {type(text).__name__}.")
  if text.isascii():  # O(1) in CPython: the common case costs nothing.
    return text
  return _SURROGATE.sub(REPLACEMENT_CHAR, text)  # Returns `text` itself when none match.
