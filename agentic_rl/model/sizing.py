"""Parameter and KV-cache accounting, computed from shapes only (no weights)."""

from __future__ import annotations

import math

import jax

from agentic_rl.model import cache as cache_lib
from agentic_rl.model.config import ModelSpec
from agentic_rl.model.transformer import Model

CONTEXT_LENGTHS = (8192, 131072, 1048576)
_ROUTED_EXPERT_PARAMS = ("w_gate_edf", "w_up_edf", "w_down_efd")


def _is_routed_expert(path) -> bool:
  names = [getattr(p, "key", str(p)) for p in path]
  return "moe" in names and names[-1] in _ROUTED_EXPERT_PARAMS


def param_counts(spec: ModelSpec) -> dict[str, int]:
  """Total parameters and parameters active per token (k of E routed experts)."""
  shapes = Model(spec).param_shapes()
  total = routed = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
    n = math.prod(leaf.shape)
    total += n
    if _is_routed_expert(path):
      routed += n
  active = total - routed
  if spec.moe.num_experts:
    active += routed * spec.moe.num_experts_per_token // spec.moe.num_experts
  return {"params_total": int(total), "params_active": int(active),
          "params_routed_experts": int(routed)}


def kv_bytes_per_token(spec: ModelSpec, lengths=CONTEXT_LENGTHS) -> dict[str, float]:
  return {str(n): cache_lib.cache_bytes_per_sequence(spec, n) / n for n in lengths}


def model_report(spec: ModelSpec) -> dict:
  counts = param_counts(spec)
  kv = kv_bytes_per_token(spec)
  kv_dense = kv_bytes_per_token(spec.all_dense())
  return {
      "num_layers": spec.num_layers,
      "layer_types": "".join(spec.layer_types),
      **counts,
      "kv_bytes_per_token": kv,
      "kv_bytes_per_token_all_dense": kv_dense,
      "kv_reduction_vs_all_dense": {n: kv_dense[n] / kv[n] for n in kv},
      "kv_cache_bytes_per_sequence_at_max_len": cache_lib.cache_bytes_per_sequence(
          spec, spec.max_seq_len),
      "cache_dtype": spec.cache_dtype,
      "sparse_selected_blocks": spec.num_selected_blocks,
      "block_size": spec.block_size,
      "topk_tokens": spec.topk_tokens,
      "sliding_window": spec.sliding_window,
  }


def format_report(report: dict) -> str:
  def human(n):
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
      if n >= div:
        return f"{n / div:.2f}{unit}"
    return str(n)
  lines = [
      f"layers            {report['num_layers']}  ({report['layer_types'][:32]}"
      f"{'...' if len(report['layer_types']) > 32 else ''})",
      f"params total      {human(report['params_total'])}",
      f"params active/tok {human(report['params_active'])}",
      "KV bytes per token      this config    all dense    reduction",
  ]
  for n, v in report["kv_bytes_per_token"].items():
    d = report["kv_bytes_per_token_all_dense"][n]
    lines.append(f"  at {int(n):>8,d} ctx   {v:>12,.1f} {d:>12,.1f}   {d / v:>6.2f}x")
  return "\n".join(lines)

