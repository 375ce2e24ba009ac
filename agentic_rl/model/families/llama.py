"""Llama 3: GQA, RoPE with the 'llama3' frequency scaling, optional biases on the attention
projections (attention_bias: q, k, v and o) and on the FFN (mlp_bias)."""

from __future__ import annotations

from typing import Any, Mapping

from agentic_rl.model.config import MoESpec
from agentic_rl.model.families import hf_config


def from_hf(cfg: Mapping[str, Any], max_seq_len: int) -> dict[str, Any]:
  tp = cfg.get("pretraining_tp", 1) or 1
  hf_config.require(tp == 1, "pretraining_tp", tp, "only the merged (tp=1) weights load")
  fields = hf_config.common(cfg, max_seq_len)
  fields.update(qk_norm=False, attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)), num_dense_layers=0,
                moe=MoESpec(num_experts=0))
  return fields


def to_hf(spec) -> dict[str, Any]:
  return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
          "attention_bias": spec.attention_bias, "mlp_bias": spec.mlp_bias,
          **hf_config.common_hf(spec)}
