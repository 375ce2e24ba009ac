"""The Hugging Face decoder layout the three families share (Llama's naming), as rules.

Qwen3, Qwen3-MoE and Llama 3 name their tensors the same way; what differs (q/k norms,
biases, MoE layers, a tied head) follows from the ModelSpec, so one function lists every
param's rule. Params with no Hugging Face counterpart (our S gates, the value head, a
routing bias) are listed by `fresh_params`: an import leaves them at their initial values.
Our names are those of the unrolled layout (`layer_{i}/...`), which params files hold
whatever config.model.scan_layers says (model/layer_stack.py converts).
"""

from __future__ import annotations

from agentic_rl.model.config import ModelSpec
from agentic_rl.model.families.tensors import TensorRule


def rules(spec: ModelSpec) -> list[TensorRule]:
  d, n, k, h, v = spec.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size
  out = [TensorRule("embed/embedding", ("model.embed_tokens.weight",), "copy", (v, d))]
  for i in range(spec.num_layers):
    ours, hf = f"layer_{i}", f"model.layers.{i}"
    a, ha = f"{ours}/attn", f"{hf}.self_attn"
    out += [
        TensorRule(f"{ours}/attn_norm/scale", (f"{hf}.input_layernorm.weight",), "copy", (d,)),
        TensorRule(f"{ours}/ffn_norm/scale", (f"{hf}.post_attention_layernorm.weight",), "copy",
                   (d,)),
        TensorRule(f"{a}/w_q_dnh", (f"{ha}.q_proj.weight",), "linear", (d, n, h)),
        TensorRule(f"{a}/w_k_dkh", (f"{ha}.k_proj.weight",), "linear", (d, k, h)),
        TensorRule(f"{a}/w_v_dkh", (f"{ha}.v_proj.weight",), "linear", (d, k, h)),
        TensorRule(f"{a}/w_o_nhd", (f"{ha}.o_proj.weight",), "linear", (n, h, d), in_axes=2),
    ]
    if spec.attention_bias:
      out += [TensorRule(f"{a}/b_q_nh", (f"{ha}.q_proj.bias",), "bias", (n, h)),
              TensorRule(f"{a}/b_k_kh", (f"{ha}.k_proj.bias",), "bias", (k, h)),
              TensorRule(f"{a}/b_v_kh", (f"{ha}.v_proj.bias",), "bias", (k, h)),
              TensorRule(f"{a}/b_o_d", (f"{ha}.o_proj.bias",), "bias", (d,))]
    if spec.qk_norm:
      out += [TensorRule(f"{a}/q_norm/scale", (f"{ha}.q_norm.weight",), "copy", (h,)),
              TensorRule(f"{a}/k_norm/scale", (f"{ha}.k_norm.weight",), "copy", (h,))]
    out += _moe(spec, i) if spec.is_moe_layer(i) else _dense_ffn(spec, i)
  out.append(TensorRule("final_norm/scale", ("model.norm.weight",), "copy", (d,)))
  if not spec.tie_embeddings:
    out.append(TensorRule("unembed/kernel", ("lm_head.weight",), "linear", (d, v)))
  return out


def _dense_ffn(spec: ModelSpec, i: int) -> list[TensorRule]:
  d, f = spec.d_model, spec.d_ff
  ours, hf = f"layer_{i}/ffn", f"model.layers.{i}.mlp"
  out = [TensorRule(f"{ours}/w_gate_df", (f"{hf}.gate_proj.weight",), "linear", (d, f)),
         TensorRule(f"{ours}/w_up_df", (f"{hf}.up_proj.weight",), "linear", (d, f)),
         TensorRule(f"{ours}/w_down_fd", (f"{hf}.down_proj.weight",), "linear", (f, d))]
  if spec.mlp_bias:
    out += [TensorRule(f"{ours}/b_gate_f", (f"{hf}.gate_proj.bias",), "bias", (f,)),
            TensorRule(f"{ours}/b_up_f", (f"{hf}.up_proj.bias",), "bias", (f,)),
            TensorRule(f"{ours}/b_down_d", (f"{hf}.down_proj.bias",), "bias", (d,))]
  return out


def _moe(spec: ModelSpec, i: int) -> list[TensorRule]:
  d, m = spec.d_model, spec.moe
  e, f = m.num_experts, m.d_ff_expert
  ours, hf = f"layer_{i}/moe", f"model.layers.{i}.mlp"

  def experts(proj):
    return tuple(f"{hf}.experts.{j}.{proj}.weight" for j in range(e))

  return [TensorRule(f"{ours}/w_router_de", (f"{hf}.gate.weight",), "linear", (d, e)),
          TensorRule(f"{ours}/w_gate_edf", experts("gate_proj"), "experts", (e, d, f)),
          TensorRule(f"{ours}/w_up_edf", experts("up_proj"), "experts", (e, d, f)),
          TensorRule(f"{ours}/w_down_efd", experts("down_proj"), "experts", (e, f, d))]


def check_expressible(spec: ModelSpec) -> None:
  """Raises ValueError naming what a Hugging Face decoder of these families cannot hold."""
  if spec.moe.num_experts and spec.moe.num_shared_experts:
    raise ValueError(f"config.model.moe.num_shared_experts={spec.moe.num_shared_experts}: "
                     "Qwen3-MoE has no shared experts.")
  if spec.moe.num_experts and spec.moe.gate != "softmax":
    raise ValueError(f"config.model.moe.gate={spec.moe.gate!r}: Qwen3-MoE routes by softmax.")


def fresh_params(spec: ModelSpec, param_names: list[str]) -> list[str]:
  """Our params (slash paths) that no Hugging Face tensor fills."""
  mapped = {r.ours for r in rules(spec)}
  return [name for name in param_names if name not in mapped]


def nest(flat: dict[str, object]) -> dict:
  """{'a/b/c': x} -> {'a': {'b': {'c': x}}}: the flax params tree of slash paths."""
  tree: dict = {}
  for path, value in flat.items():
    *parents, leaf = path.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree
