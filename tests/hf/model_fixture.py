"""Tiny random Hugging Face models that transformers builds from a config, offline.

The independent reference for the import, the export and the logit parity: transformers'
own Qwen3, Qwen3-MoE and Llama modules, in float32 on the CPU.
"""

from __future__ import annotations

import numpy as np

FAMILY_CONFIGS = {
    "qwen3": dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=False, rope_theta=10_000.0, rms_norm_eps=1e-6),
    "qwen3_moe": dict(vocab_size=96, hidden_size=32, intermediate_size=48,
                      moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
                      tie_word_embeddings=False, rms_norm_eps=1e-6),
    "llama": dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                  rope_theta=500_000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}),
}


def build(model_type: str, seed: int = 0, **overrides):
  """A transformers model of `model_type` with random weights (biases and norm scales too,
  so a dropped or misplaced one shows in the logits)."""
  import torch
  import transformers

  config_cls = {"qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
                "llama": transformers.LlamaConfig}[model_type]
  model_cls = {"qwen3": transformers.Qwen3ForCausalLM,
               "qwen3_moe": transformers.Qwen3MoeForCausalLM,
               "llama": transformers.LlamaForCausalLM}[model_type]
  torch.manual_seed(seed)
  config = config_cls(**{**FAMILY_CONFIGS[model_type], **overrides})
  config._attn_implementation = "eager"
  model = model_cls(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.copy_(0.1 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  return model


def state_dict(model) -> dict[str, np.ndarray]:
  return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def logits(model, tokens_bt: np.ndarray) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(torch.as_tensor(tokens_bt, dtype=torch.long)).logits.float().numpy()
