"""google-tunix's Sampler on launch.bench_sampler's workload, in its own venv (it imports
nothing of this project).

    VENV/bin/python launch/peers/tunix_sampler.py --batch 32 [--num_experts 8 ...]

The same tiny Qwen3 shape (tunix.models.qwen3, random weights), B prompts of --prompt random
ids, --gen tokens each, temperature 1 with top_p 1 (the full vocabulary), no early stop (the
end id is outside the vocabulary). Prints one JSON line: tokens_per_s over the median of
--repeats timed calls, after one untimed call that compiles.
"""

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate import sampler as sampler_lib
from tunix.models import dummy_model_creator
from tunix.models.qwen3 import model as qwen3

import workload  # launch/peers/workload.py, beside this script.


class IdTokenizer:
  """A prompt 'text' is its seed: encode draws the prompt's ids from it."""

  def __init__(self, vocab_size, prompt):
    self.vocab_size, self.prompt = vocab_size, prompt

  def encode(self, text, **kwargs):
    return np.random.default_rng(int(text)).integers(1, self.vocab_size, self.prompt).tolist()

  def decode(self, ids, **kwargs):
    return ""

  def bos_id(self):
    return 0  # Falsy: no BOS is prepended.

  def eos_id(self):
    return self.vocab_size + 7  # Never drawn: no early stop.

  def pad_id(self):
    return 0


def main():
  a = workload.parse_args()
  moe = dict(num_experts=a.num_experts, num_experts_per_tok=a.experts_per_tok) \
      if a.num_experts else {}
  config = qwen3.ModelConfig(
      num_layers=a.num_layers, vocab_size=a.vocab_size, embed_dim=a.d_model,
      hidden_dim=a.d_ff_expert if a.num_experts else a.d_ff, num_heads=a.num_heads,
      head_dim=a.head_dim, num_kv_heads=a.num_kv_heads, rope_theta=1_000_000, norm_eps=1e-6,
      use_tied_embedding=False, dtype=jnp.float32, param_dtype=jnp.float32, **moe)
  model = dummy_model_creator.create_dummy_model(qwen3.Qwen3, config)
  cache = sampler_lib.CacheConfig(cache_size=a.prompt + a.gen, num_layers=a.num_layers,
                                  num_kv_heads=a.num_kv_heads, head_dim=a.head_dim)
  sampler = sampler_lib.Sampler(model, IdTokenizer(a.vocab_size, a.prompt), cache)
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
      __import__("flax").nnx.state(model)))

  def call(first):
    t0 = time.perf_counter()
    out = sampler([str(first + i) for i in range(a.batch)], max_generation_steps=a.gen,
                  max_prompt_length=a.prompt, temperature=1.0, top_p=1.0, seed=first)
    jax.block_until_ready(out.tokens)
    seconds = time.perf_counter() - t0
    lengths = [len(t) for t in out.tokens]
    if min(lengths) != a.gen:
      raise RuntimeError(f"generated {lengths[:4]}... tokens, expected {a.gen} each")
    return seconds

  compile_seconds = call(0)
  seconds = [call((r + 1) * a.batch) for r in range(a.repeats)]
  median = statistics.median(seconds)
  print(json.dumps({"impl": "tunix", "tokens_per_s": a.batch * a.gen / median,
                    "batch": a.batch, "prompt": a.prompt, "gen": a.gen, "seconds": median,
                    "seconds_all": seconds, "compile_seconds": compile_seconds,
                    "params": params, "moe": bool(a.num_experts), "jax": jax.__version__}))


if __name__ == "__main__":
  main()
