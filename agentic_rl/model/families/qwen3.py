"""Qwen3 and Qwen3-MoE: q/k RMSNorm, GQA, RoPE theta, optional attention bias, tied or
untied head; the MoE variant routes by softmax top-k without shared experts, renormalises
the top-k gates when norm_topk_prob, and picks MoE or dense per layer (decoder_sparse_step,
mlp_only_layers)."""

from __future__ import annotations

from typing import Any, Mapping

from agentic_rl.model.config import MoESpec
from agentic_rl.model.families import hf_config


def from_hf(cfg: Mapping[str, Any], max_seq_len: int) -> dict[str, Any]:
  fields = hf_config.common(cfg, max_seq_len)
  fields.update(qk_norm=True, attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=False, num_dense_layers=0, moe=MoESpec(num_experts=0))
  return fields


def from_hf_moe(cfg: Mapping[str, Any], max_seq_len: int) -> dict[str, Any]:
  fields = from_hf(cfg, max_seq_len)
  shared = cfg.get("shared_expert_intermediate_size") or 0
  hf_config.require(not shared, "shared_expert_intermediate_size", shared,
                    "Qwen3-MoE has no shared experts")
  step = int(cfg.get("decoder_sparse_step", 1) or 1)
  fields.update(
      moe_layer_step=step,
      dense_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
      moe=MoESpec(
          num_experts=int(hf_config.get(cfg, "num_experts", "num_local_experts")),
          num_experts_per_token=int(hf_config.get(cfg, "num_experts_per_tok")),
          d_ff_expert=int(hf_config.get(cfg, "moe_intermediate_size")),
          num_shared_experts=0, gate="softmax",
          renormalize=bool(cfg.get("norm_topk_prob", False)),
          aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0) or 0.0)))
  return fields


def to_hf(spec) -> dict[str, Any]:
  return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
          "attention_bias": spec.attention_bias, "use_sliding_window": False,
          **hf_config.common_hf(spec)}


def to_hf_moe(spec) -> dict[str, Any]:
  m = spec.moe
  return {**to_hf(spec), "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
          "num_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_token,
          "moe_intermediate_size": m.d_ff_expert, "norm_topk_prob": m.renormalize,
          "decoder_sparse_step": spec.moe_layer_step,
          "mlp_only_layers": sorted(set(spec.dense_layers)
                                    | set(range(spec.num_dense_layers))),
          "router_aux_loss_coef": m.aux_loss_coef}
