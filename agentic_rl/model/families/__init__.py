"""Model families: the one seam between Hugging Face checkpoints and our ModelSpec.

Each family maps a Hugging Face config.json to ModelSpec fields and back; the tensor layout
they share is `layout.rules(spec)`. To add a family: a module with `from_hf(cfg,
max_seq_len) -> fields` and `to_hf(spec) -> config dict`, and a row in FAMILIES keyed by
config.json's `model_type` (WORKSPACE.md, "Add a model family").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from agentic_rl.model.config import ModelSpec
from agentic_rl.model.families import hf_config, layout, llama, qwen3


@dataclasses.dataclass(frozen=True)
class Family:
  model_type: str
  from_hf: Callable[[Mapping[str, Any], int], dict[str, Any]]
  to_hf: Callable[[ModelSpec], dict[str, Any]]
  is_moe: bool = False


FAMILIES = {f.model_type: f for f in (
    Family("qwen3", qwen3.from_hf, qwen3.to_hf),
    Family("qwen3_moe", qwen3.from_hf_moe, qwen3.to_hf_moe, is_moe=True),
    Family("llama", llama.from_hf, llama.to_hf),
)}


def family_of(cfg: Mapping[str, Any]) -> Family:
  model_type = cfg.get("model_type")
  hf_config.require(model_type in FAMILIES, "model_type", model_type,
                    f"the known families are {sorted(FAMILIES)}")
  return FAMILIES[model_type]


def spec_from_hf(cfg: Mapping[str, Any], *, max_seq_len: int = 4096, **overrides) -> ModelSpec:
  """The ModelSpec of a Hugging Face config.json (a dict); `overrides` are ModelSpec fields
  set on top (dtype, a layer_pattern for the hybrid retrofit, ...)."""
  fields = family_of(cfg).from_hf(cfg, max_seq_len)
  fields.update(overrides)
  return ModelSpec(**fields)


def family_for_spec(spec: ModelSpec, model_type: str | None = None) -> Family:
  """The family a spec exports as: `model_type` if given, else Qwen3(-MoE) for q/k-normed
  specs and Llama otherwise."""
  if model_type is None:
    model_type = ("qwen3_moe" if spec.moe.num_experts else "qwen3") if spec.qk_norm else "llama"
  if model_type not in FAMILIES:
    raise ValueError(f"model_type={model_type!r}: the known families are {sorted(FAMILIES)}.")
  family = FAMILIES[model_type]
  if bool(spec.moe.num_experts) != family.is_moe:
    raise ValueError(f"model_type={model_type!r} does not fit config.model.moe.num_experts="
                     f"{spec.moe.num_experts}.")
  qwen = model_type.startswith("qwen3")
  if spec.qk_norm != qwen:
    raise ValueError(f"model_type={model_type!r} does not fit config.model.qk_norm="
                     f"{spec.qk_norm}: Qwen3 normalises q and k, Llama does not.")
  if qwen and spec.mlp_bias:
    raise ValueError(f"model_type={model_type!r} has no FFN biases "
                     "(config.model.mlp_bias=True).")
  layout.check_expressible(spec)
  return family
