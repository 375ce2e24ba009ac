"""Reading a Hugging Face config.json: the fields every family shares, in both spellings.

Hub checkpoints carry either transformers 4.x's `rope_theta` + `rope_scaling` or 5.x's
`rope_parameters` (the same keys, plus `rope_theta`, in one dict). Both read to the same
(theta, RopeScalingSpec). A value the import cannot express is an `UnsupportedConfig`
naming the config.json field, raised before any tensor is read.
"""

from __future__ import annotations

from typing import Any, Mapping

from agentic_rl.model.config import RopeScalingSpec


DEFAULT_ROPE_THETA = 10_000.0


class UnsupportedConfig(ValueError):
  """A config.json field value our model cannot express (named in the message)."""


def require(ok: bool, field: str, value: Any, why: str) -> None:
  if not ok:
    raise UnsupportedConfig(f"config.json {field}={value!r} is not supported: {why}.")


def get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
  """The first of `names` the config has (fields renamed across transformers versions)."""
  for name in names:
    if name in cfg and cfg[name] is not None:
      return cfg[name]
  if default is None:
    raise UnsupportedConfig(f"config.json has no {' or '.join(names)}: the import needs it.")
  return default


def rope(cfg: Mapping[str, Any]) -> tuple[float, RopeScalingSpec]:
  """(theta, scaling) from either spelling."""
  params = cfg.get("rope_parameters")  # 5.x
  if isinstance(params, Mapping) and set(params) and all(isinstance(v, Mapping)
                                                         for v in params.values()):
    raise UnsupportedConfig("config.json rope_parameters holds one entry per layer type "
                            f"({sorted(params)}): per-layer-type RoPE is not supported.")
  params = params if isinstance(params, Mapping) else {}
  # transformers 5 reads rope_scaling when it is set, else rope_parameters; so do we.
  legacy = cfg.get("rope_scaling")
  field = "rope_scaling" if legacy else "rope_parameters"
  scaling = dict(legacy) if legacy else dict(params)
  # Absent in both spellings: transformers' class default for all three families.
  theta = scaling.get("rope_theta", cfg.get("rope_theta",
                                            params.get("rope_theta", DEFAULT_ROPE_THETA)))
  require(isinstance(theta, (int, float)) and theta > 0, "rope_theta", theta,
          "a positive number is needed (in rope_theta or rope_parameters.rope_theta)")
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return float(theta), RopeScalingSpec()
  require(kind == "llama3", f"{field}.rope_type", kind,
          "the import knows RoPE types 'default' and 'llama3'")
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  missing = [k for k in keys if k not in scaling]
  require(not missing, field, dict(scaling), f"llama3 scaling needs {missing}")
  return float(theta), RopeScalingSpec(
      kind="llama3", factor=float(scaling["factor"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_len=int(scaling["original_max_position_embeddings"]))


def rope_fields(spec) -> dict[str, Any]:
  """The transformers 4.x spelling, which 4.x and 5.x both read."""
  s = spec.rope_scaling
  scaling = None if s.kind == "none" else {
      "rope_type": s.kind, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
      "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings":
      s.original_max_len}
  return {"rope_theta": spec.rope_theta, "rope_scaling": scaling}


def common(cfg: Mapping[str, Any], max_seq_len: int) -> dict[str, Any]:
  """The ModelSpec fields every decoder family spells the same way."""
  act = cfg.get("hidden_act", "silu")
  require(act == "silu", "hidden_act", act, "the FFN is SwiGLU (silu)")
  d_model = int(get(cfg, "hidden_size"))
  num_heads = int(get(cfg, "num_attention_heads"))
  theta, scaling = rope(cfg)
  window = cfg.get("use_sliding_window", False)
  require(not window, "use_sliding_window", window,
          "this family's sliding-window attention is not imported (our S layers are an "
          "option on top: config.model.layer_pattern)")
  kinds = set(cfg.get("layer_types") or ["full_attention"])
  require(kinds == {"full_attention"}, "layer_types", sorted(kinds),
          "only full_attention layers are imported")
  max_positions = int(cfg.get("max_position_embeddings") or max_seq_len)
  return {
      "vocab_size": int(get(cfg, "vocab_size")),
      "d_model": d_model,
      "num_layers": int(get(cfg, "num_hidden_layers")),
      "layer_pattern": "F",
      "num_heads": num_heads,
      "num_kv_heads": int(get(cfg, "num_key_value_heads", default=num_heads)),
      "head_dim": int(get(cfg, "head_dim", default=d_model // num_heads)),
      "rope_theta": theta,
      "rope_scaling": scaling,
      "norm_eps": float(get(cfg, "rms_norm_eps", default=1e-6)),
      "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
      "max_seq_len": min(max_positions, max_seq_len),
      "d_ff": int(get(cfg, "intermediate_size")),
  }


def common_hf(spec) -> dict[str, Any]:
  return {
      "vocab_size": spec.vocab_size, "hidden_size": spec.d_model,
      "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
      "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
      "rms_norm_eps": spec.norm_eps, "tie_word_embeddings": spec.tie_embeddings,
      "max_position_embeddings": spec.max_seq_len, "intermediate_size": spec.d_ff,
      # Both spellings: transformers 5 reads dtype, 4.x torch_dtype.
      "hidden_act": "silu", "dtype": spec.param_dtype, "torch_dtype": spec.param_dtype,
      **rope_fields(spec),
  }
