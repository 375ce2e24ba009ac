"""Tiny Qwen3- and Llama-3-style tokenizers built offline, with the real chat templates.

`write_tiny_qwen3_tokenizer(dir)` trains a small byte-level BPE with the `tokenizers`
library, adds Qwen3's added tokens (the same strings and special flags: <|endoftext|>,
<|im_start|>, <|im_end|> special; <tool_call>, </tool_call>, <tool_response>,
</tool_response>, <think>, </think> not), and writes tokenizer.json and a
tokenizer_config.json holding Qwen3's chat template (assets/qwen3_chat_template.jinja, the
`chat_template` of Qwen/Qwen3-8B's tokenizer_config.json). The pre-tokenizer is Qwen2/3's
(NFC, its split regex, ByteLevel), so boundaries between template text and contents
tokenize as a real Qwen3 tokenizer's do. `write_tiny_llama3_tokenizer(dir)` is the same
for a Llama 3 layout (assets/llama3_layout_chat_template.jinja: written for these tests in
Llama 3.1's turn layout, so no licensed template text is copied).

Both files load in transformers (AutoTokenizer.from_pretrained(dir)), the independent
reference the chat tests compare against, and in the project through
config.tokenizer = {kind: 'hf', path: dir, chat_template: 'file'}.
"""

from __future__ import annotations

import json
import os

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
QWEN3_TEMPLATE = os.path.join(ASSETS, "qwen3_chat_template.jinja")
LLAMA3_TEMPLATE = os.path.join(ASSETS, "llama3_layout_chat_template.jinja")

# (content, special) in Qwen3's order; the ids follow the BPE vocabulary, as in Qwen3.
QWEN3_ADDED = (("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
               ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
               ("</tool_response>", False), ("<think>", False), ("</think>", False))
LLAMA3_ADDED = (("<|begin_of_text|>", True), ("<|end_of_text|>", True),
                ("<|start_header_id|>", True), ("<|end_header_id|>", True),
                ("<|eom_id|>", True), ("<|eot_id|>", True), ("<|python_tag|>", True))
QWEN3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# What the tiny tokenizer learns its merges from: the SWE env's kind of text.
_CORPUS = [
    "Repository with failing tests. Fix the code so that all tests pass, then submit.",
    "Tools: ls | view PATH [START [END]] | replace PATH START END | test | submit",
    '{"name": "view", "arguments": {"path": "calc.py", "start": 1, "end": 20}}',
    '{"name": "replace", "arguments": {"path": "calc.py", "start": 4, "end": 4, '
    '"text": "    return x * 3"}}',
    '{"name": "test", "arguments": {}}', '{"name": "submit", "arguments": {}}',
    '{"name": "ls", "arguments": {}}',
    "calc.py (12 lines)\ntest_calc.py (30 lines)",
    "calc.py lines 1-12 of 12:\n1|def add(x, y):\n2|    return x + y\n3|\n4|def triple(x):\n"
    "5|    return x * 2\n",
    "FAIL triple(3): expected 9, got 6\nERROR scale(2): ZeroDivisionError\n3 of 5 tests passed",
    "all 5 tests passed",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n",
    "import unittest\n\nclass TestCalc(unittest.TestCase):\n    def test_add(self):\n"
    "        for x, y, want in [(1, 2, 3), (0, 0, 0)]:\n"
    "            self.assertEqual(add(x, y), want)\n",
    "I should look at the failing function first, then fix the line that computes it.",
    "The test expects 9 but the function returns 6: the constant is wrong.",
    "You are a careful software engineer. Answer with one tool call per turn.",
    "# Tools\n\nYou may call one or more functions to assist with the user query.",
    "error: unknown tool 'vew'; tools: ls, view, replace, test, python, submit",
    "[output truncated: 1100 of 4000 chars shown]",
]


def _train(vocab_size: int, added, split_regex: str, nfc: bool):
  from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                          pre_tokenizers, trainers)

  tok = Tokenizer(models.BPE())
  if nfc:
    tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(added), min_frequency=1,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(_CORPUS * 4, trainer)
  if tok.get_vocab_size() != vocab_size - len(added):
    raise RuntimeError(f"the corpus yields {tok.get_vocab_size()} BPE tokens, fewer than "
                       f"{vocab_size - len(added)}: ask for a smaller vocab_size.")
  for content, special in added:
    token = AddedToken(content, special=special, normalized=False)
    (tok.add_special_tokens if special else tok.add_tokens)([token])
  return tok


def _write(directory: str, tok, added, template_path: str, config: dict) -> str:
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(template_path, encoding="utf-8") as f:
    template = f.read()
  decoder = {str(tok.token_to_id(c)): {"content": c, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": s}
             for c, s in added}
  config = {"added_tokens_decoder": decoder, "chat_template": template,
            "clean_up_tokenization_spaces": False, "model_max_length": 4096, **config}
  with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
  return directory


def write_tiny_qwen3_tokenizer(directory: str, vocab_size: int = 512) -> str:
  """A Qwen3-style tokenizer of `vocab_size` ids (the added tokens last) in `directory`;
  returns the directory. Deterministic: the same files every call."""
  tok = _train(vocab_size, QWEN3_ADDED, QWEN3_SPLIT, nfc=True)
  return _write(directory, tok, QWEN3_ADDED, QWEN3_TEMPLATE, {
      "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
      "add_prefix_space": False, "split_special_tokens": False,
      "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})


def write_tiny_llama3_tokenizer(directory: str, vocab_size: int = 512) -> str:
  """A Llama-3.1-style tokenizer (bos <|begin_of_text|>, eos <|eot_id|>) in `directory`."""
  tok = _train(vocab_size, LLAMA3_ADDED, LLAMA3_SPLIT, nfc=False)
  return _write(directory, tok, LLAMA3_ADDED, LLAMA3_TEMPLATE, {
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
      "eos_token": "<|eot_id|>"})
