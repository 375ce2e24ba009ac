"""The committed SWE BPE tokenizer (configs/tokenizers/swe_bpe_1k.json) and its builder."""

import os

import pytest

from agentic_rl.envs import config as env_config_lib
from agentic_rl.envs import datasets
from agentic_rl.envs import expert
from agentic_rl.envs import swe_env
from agentic_rl.rollout import tokenizer as tokenizer_lib
from configs import quickstart
from launch import build_tokenizer

_PATH = os.path.join(os.path.dirname(quickstart.__file__), "tokenizers", "swe_bpe_1k.json")


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.HFTokenizer.from_file(_PATH)


def _episode_texts(split, tier, n):
  config = env_config_lib.default_env_config()
  source = datasets.SweTaskSource(split, tiers=(tier,), config=config)
  texts = []
  for i in range(n):
    with swe_env.SweEnv(config) as env:
      r = expert.play_expert(env, source[i])
    texts.append("\n".join([r.first_observation] + [p for turn in r.turns for p in turn]))
  return texts


def test_committed_file_loads_with_every_special_as_one_id(tok):
  assert tok.vocab_size == 1024
  for name, text in tokenizer_lib.SPECIAL_TOKENS.items():
    assert tok.encode(text) == [tok.special_ids[name]], name
  assert len(set(tok.special_ids.values())) == len(tokenizer_lib.SPECIAL_TOKENS)


def test_held_out_episodes_round_trip_and_compress(tok):
  texts = _episode_texts("heldout", "tiny", 3) + _episode_texts("heldout", "medium", 2)
  total_bytes = total_tokens = 0
  for text in texts:
    ids = tok.encode(text, parse_special=False)
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size
    total_bytes += len(text.encode())
    total_tokens += len(ids)
  # Trained on train-split episodes only; held-out ones still compress well over bytes.
  assert total_bytes / total_tokens > 2.0


def test_arbitrary_bytes_still_encode(tok):
  text = "émoji 🙂, tabs\t, nul-free binary-ish ÿþ and <tool_call> as text"
  assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_training_is_deterministic_and_keeps_the_specials():
  docs = _episode_texts("train", "tiny", 4)
  a = build_tokenizer.train_tokenizer(docs, vocab_size=400, min_frequency=2)
  b = build_tokenizer.train_tokenizer(docs, vocab_size=400, min_frequency=2)
  assert a.to_str() == b.to_str()
  wrapped = tokenizer_lib.HFTokenizer(a)
  for name, text in tokenizer_lib.SPECIAL_TOKENS.items():
    assert wrapped.encode(text) == [wrapped.special_ids[name]], name
  for d in docs:
    assert wrapped.decode(wrapped.encode(d, parse_special=False)) == d
