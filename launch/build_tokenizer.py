"""Trains the SWE environment's byte-level BPE tokenizer and writes its tokenizer.json.

    python -m launch.build_tokenizer --output configs/tokenizers/swe_bpe_1k.json

The corpus is what a policy reads and writes on the train split: the scripted
expert plays `--tasks_per_tier` train tasks of every tier, and each episode's
text (task prompt, tool calls, observations) is one training document, plus
the env's error messages for a set of malformed calls. Held-out tasks are
never read. The model is a lossless ByteLevel BPE (any byte sequence still
encodes), with the chat special tokens of agentic_rl/rollout/tokenizer.py as
added tokens; it shortens SWE trajectories about 3x against bytes and makes a
file or function name one or two ids, so copying it is one lookup.

Training is deterministic for a fixed corpus; the committed file is the one
`configs/sft_base.py` (and the quickstart) use, so runs do not depend on this step.
"""

from __future__ import annotations

import json
import os

from absl import app
from absl import flags

from agentic_rl import resources
from agentic_rl.envs import config as env_config_lib
from agentic_rl.envs import datasets
from agentic_rl.envs import expert
from agentic_rl.envs import swe_env
from agentic_rl.rollout import teacher as teacher_lib
from agentic_rl.rollout import tokenizer as tokenizer_lib

_OUTPUT = flags.DEFINE_string("output", "configs/tokenizers/swe_bpe_1k.json", "tokenizer.json path.")
_VOCAB = flags.DEFINE_integer("vocab_size", 1024, "BPE vocabulary size, special tokens included.")
_TASKS = flags.DEFINE_integer("tasks_per_tier", 150, "Train-split expert episodes per tier.")
_MIN_FREQ = flags.DEFINE_integer("min_frequency", 4, "Minimum pair count for a merge.")

# Calls that draw each kind of error message, so those phrases get merges too.
_MALFORMED_CALLS = ("<tool_call>lss</tool_call>", "<tool_call>view</tool_call>",
                    "<tool_call>view nofile.py</tool_call>", "<tool_call>view a.py x</tool_call>",
                    "<tool_call>replace a.py 1</tool_call>", "no call at all",
                    "<tool_call>test extra</tool_call>", "<tool_call>python</tool_call>")


def episode_texts(tasks_per_tier: int, env_config=None) -> list[str]:
  """One document per expert episode (and per malformed-call probe), train split only."""
  env_config = env_config_lib.validate_env_config(
      env_config if env_config is not None else env_config_lib.default_env_config())
  factory = lambda: swe_env.SweEnv(env_config)
  docs = []
  for tier in env_config.tiers.keys():
    source = datasets.SweTaskSource("train", tiers=(tier,), config=env_config)
    tasks = [source[i] for i in range(tasks_per_tier)]
    episodes = _play_all(tasks, factory)
    for first, turns in episodes:
      docs.append("\n".join([first] + [part for turn in turns for part in turn]))
  with factory() as env:
    env.reset(datasets.SweTaskSource("train", config=env_config)[0])
    for call in _MALFORMED_CALLS:
      obs, _, done, _ = env.step(call)
      docs.append(call + "\n" + obs)
      if done:
        break
  return docs


def _play_all(tasks, factory):
  def play(env, task):
    r = expert.play_expert(env, task)
    return task.seed, r.first_observation, r.turns

  results = sorted(teacher_lib.play_on_fresh_envs(tasks, factory, play), key=lambda x: x[0])
  return [(first, turns) for _, first, turns in results]


def train_tokenizer(docs: list[str], vocab_size: int, min_frequency: int = 4):
  """A ByteLevel BPE `tokenizers.Tokenizer` with our special tokens as added tokens."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = list(tokenizer_lib.SPECIAL_TOKENS.values())
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(docs, trainer=trainer)
  return tok


def main(argv):
  del argv
  docs = episode_texts(_TASKS.value)
  tok = train_tokenizer(docs, _VOCAB.value, _MIN_FREQ.value)
  out = resources.resolve(_OUTPUT.value)  # The default names the shipped file.
  os.makedirs(os.path.dirname(out), exist_ok=True)
  tok.save(out)
  wrapped = tokenizer_lib.HFTokenizer.from_file(out)
  byte_len = sum(len(d.encode()) for d in docs)
  bpe_len = sum(len(wrapped.encode(d, parse_special=False)) for d in docs)
  print(json.dumps({"output": out, "vocab_size": wrapped.vocab_size, "documents": len(docs),
                    "corpus_bytes": byte_len, "corpus_tokens": bpe_len,
                    "bytes_per_token": byte_len / max(bpe_len, 1)}))


if __name__ == "__main__":
  app.run(main)
