"""transformers' `generate` on launch.bench_sampler's workload, in its own venv (torch, CPU;
it imports nothing of this project).

    VENV/bin/python launch/peers/hf_generate.py --batch 32 [--num_experts 8 ...]

The same tiny Qwen3 shape (Qwen3ForCausalLM, or Qwen3MoeForCausalLM with every layer
routed and no shared expert; random weights), B prompts of --prompt random ids, --gen new
tokens each, do_sample with temperature 1, top_k 0 and top_p 1 (the full vocabulary), no
early stop (no eos id). Prints one JSON line: tokens_per_s over the median of --repeats
timed calls, after one untimed call.
"""

import json
import statistics
import time

import numpy as np
import torch
import transformers

import workload  # launch/peers/workload.py, beside this script.


def main():
  a = workload.parse_args()
  common = dict(vocab_size=a.vocab_size, hidden_size=a.d_model, intermediate_size=a.d_ff,
                num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
                num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim,
                max_position_embeddings=a.prompt + a.gen + 8, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=0)
  torch.manual_seed(0)
  if a.num_experts:
    config = transformers.Qwen3MoeConfig(num_experts=a.num_experts,
                                         num_experts_per_tok=a.experts_per_tok,
                                         moe_intermediate_size=a.d_ff_expert,
                                         decoder_sparse_step=1, mlp_only_layers=[], **common)
    model = transformers.Qwen3MoeForCausalLM(config)
  else:
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
  model = model.to(torch.float32).eval()

  def call(first):
    ids = np.stack([np.random.default_rng(first + i).integers(1, a.vocab_size, a.prompt)
                    for i in range(a.batch)])
    t0 = time.perf_counter()
    with torch.no_grad():
      out = model.generate(torch.as_tensor(ids), attention_mask=torch.ones(ids.shape),
                           do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=a.gen, min_new_tokens=a.gen, pad_token_id=0)
    seconds = time.perf_counter() - t0
    if out.shape[1] - a.prompt != a.gen:
      raise RuntimeError(f"generated {out.shape[1] - a.prompt} tokens, expected {a.gen}")
    return seconds

  compile_seconds = call(0)
  seconds = [call((r + 1) * a.batch) for r in range(a.repeats)]
  median = statistics.median(seconds)
  print(json.dumps({"impl": "hf_generate", "tokens_per_s": a.batch * a.gen / median,
                    "batch": a.batch, "prompt": a.prompt, "gen": a.gen, "seconds": median,
                    "seconds_all": seconds, "compile_seconds": compile_seconds,
                    "params": sum(x.numel() for x in model.parameters()),
                    "moe": bool(a.num_experts), "torch_threads": torch.get_num_threads(),
                    "transformers": transformers.__version__}))


if __name__ == "__main__":
  main()
