"""The model's config section: defaults, validation and the per-layer plan.

Every model option lives in one `ml_collections.ConfigDict` (`config.model`).
`validate` turns a bad value into a `ValueError` that names the field, the
value and what was expected, before any array is allocated.
"""

from __future__ import annotations

import dataclasses

import ml_collections

# S: gated sliding-window attention (ring-buffer cache).
# G: block top-k sparse grouped-query attention (full cache + block summaries).
# F: dense causal attention (full cache).
LAYER_TYPES = ("S", "G", "F")
GATE_FUNCTIONS = ("softmax", "sigmoid")
DTYPES = ("float32", "bfloat16", "float16")
KERNEL_BACKENDS = ("reference", "pallas")


def default_model_config() -> ml_collections.ConfigDict:
  """A small hybrid MoE; configs override what they need."""
  c = ml_collections.ConfigDict()
  c.vocab_size = 320
  c.d_model = 64
  c.num_layers = 4
  # Repeated (and truncated) to num_layers: "SSSG" is the 3:1 hybrid.
  c.layer_pattern = "SSSG"
  c.num_heads = 4
  c.num_kv_heads = 2
  c.head_dim = 16
  c.rope_theta = 10_000.0
  c.norm_eps = 1e-6
  c.tie_embeddings = True
  c.value_head = False  # A critic read-out on the same trunk (GAE); aux["values"].
  c.max_seq_len = 512  # Capacity of full (F, G) caches; positions must stay below it.

  c.sliding_window = 32  # W for S layers.
  c.block_size = 8  # B for G layers.
  c.topk_tokens = 32  # k for G layers: k / B blocks are selected per query group.

  c.num_dense_layers = 1  # The first N layers use a dense FFN instead of MoE.
  c.d_ff = 128  # Hidden size of the dense FFN.

  c.moe = ml_collections.ConfigDict()
  c.moe.num_experts = 8
  c.moe.num_experts_per_token = 2
  c.moe.d_ff_expert = 32
  c.moe.num_shared_experts = 1
  c.moe.gate = "softmax"  # or "sigmoid"
  c.moe.renormalize = True
  c.moe.aux_loss_coef = 1e-2  # Switch-style load-balancing loss; 0 turns it off.
  c.moe.use_routing_bias = False  # Aux-loss-free balancing: a bias that only affects selection.
  c.moe.routing_bias_rate = 1e-3  # Step size of the bias update (sign of load error).

  c.dtype = "float32"  # Compute dtype.
  c.param_dtype = "float32"
  c.cache_dtype = "float32"  # bfloat16 makes a cheaper (route B) sampler cache.
  c.kernel_backend = "reference"  # "pallas" on TPU/GPU, or in interpret mode on CPU.
  c.pallas_interpret = False
  return c


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A hashable, validated view of `config.model`, safe as a jit static arg."""

  vocab_size: int
  d_model: int
  num_layers: int
  layer_types: tuple[str, ...]
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float
  norm_eps: float
  tie_embeddings: bool
  value_head: bool
  max_seq_len: int
  sliding_window: int
  block_size: int
  topk_tokens: int
  num_dense_layers: int
  d_ff: int
  num_experts: int
  num_experts_per_token: int
  d_ff_expert: int
  num_shared_experts: int
  gate: str
  renormalize: bool
  aux_loss_coef: float
  use_routing_bias: bool
  routing_bias_rate: float
  dtype: str
  param_dtype: str
  cache_dtype: str
  kernel_backend: str
  pallas_interpret: bool

  @property
  def num_selected_blocks(self) -> int:
    return self.topk_tokens // self.block_size

  @property
  def num_blocks(self) -> int:
    """Blocks in a full cache of max_seq_len positions."""
    return -(-self.max_seq_len // self.block_size)

  def is_moe_layer(self, layer: int) -> bool:
    return self.num_experts > 0 and layer >= self.num_dense_layers

  def replay_keys(self, layer: int) -> tuple[str, ...]:
    """What layer `layer` records in aux["layers"] and a replay can force: "experts" on
    MoE layers, "blocks" on block-sparse (G) layers. Consumers ask this, not the letters."""
    return ((("experts",) if self.is_moe_layer(layer) else ())
            + (("blocks",) if self.layer_types[layer] == "G" else ()))

  def replace(self, **changes) -> "ModelSpec":
    return dataclasses.replace(self, **changes)

  def all_dense(self) -> "ModelSpec":
    """The same model with every attention layer dense (F)."""
    return self.replace(layer_types=("F",) * self.num_layers)


def dense_pattern(pattern: str) -> str:
  """`pattern` with every block-sparse G layer made dense F. They share parameters, and the
  dense layer attends to every key, so no block choice can differ between sampler and
  learner (route A)."""
  return pattern.upper().replace("G", "F")


def expand_pattern(pattern: str, num_layers: int) -> tuple[str, ...]:
  pattern = pattern.upper()
  if not pattern:
    raise ValueError("config.model.layer_pattern is empty; expected e.g. 'SSSG'.")
  bad = sorted(set(pattern) - set(LAYER_TYPES))
  if bad:
    raise ValueError(
        f"config.model.layer_pattern={pattern!r} has unknown layer types {bad}; "
        f"expected letters from {LAYER_TYPES} (S: sliding window, G: sparse, F: dense).")
  return tuple((pattern * (num_layers // len(pattern) + 1))[:num_layers])


def _require(ok: bool, field: str, value, expected: str):
  if not ok:
    raise ValueError(f"config.model.{field}={value!r}: expected {expected}.")


def validate(model_config: ml_collections.ConfigDict) -> ModelSpec:
  """Checks `config.model` and returns its frozen spec."""
  c = model_config
  for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "max_seq_len", "sliding_window", "block_size", "topk_tokens"):
    v = c[field]
    _require(isinstance(v, int) and v > 0, field, v, "a positive integer")
  _require(c.num_heads % c.num_kv_heads == 0, "num_heads", c.num_heads,
           f"a multiple of num_kv_heads={c.num_kv_heads} (grouped-query attention)")
  _require(c.head_dim % 2 == 0, "head_dim", c.head_dim, "an even number (RoPE rotates pairs)")
  _require(c.topk_tokens % c.block_size == 0, "topk_tokens", c.topk_tokens,
           f"a multiple of block_size={c.block_size}")
  _require(0 <= c.num_dense_layers <= c.num_layers, "num_dense_layers", c.num_dense_layers,
           f"between 0 and num_layers={c.num_layers}")
  _require(c.d_ff > 0 or c.num_dense_layers == 0, "d_ff", c.d_ff,
           "a positive integer when num_dense_layers > 0")
  m = c.moe
  _require(m.num_experts >= 0, "moe.num_experts", m.num_experts, "0 (no MoE) or more")
  if m.num_experts > 0:
    _require(1 <= m.num_experts_per_token <= m.num_experts, "moe.num_experts_per_token",
             m.num_experts_per_token, f"between 1 and moe.num_experts={m.num_experts}")
    _require(m.d_ff_expert > 0, "moe.d_ff_expert", m.d_ff_expert, "a positive integer")
  _require(m.num_shared_experts >= 0, "moe.num_shared_experts", m.num_shared_experts, ">= 0")
  _require(m.gate in GATE_FUNCTIONS, "moe.gate", m.gate, f"one of {GATE_FUNCTIONS}")
  for field in ("dtype", "param_dtype", "cache_dtype"):
    _require(c[field] in DTYPES, field, c[field], f"one of {DTYPES}")
  _require(c.kernel_backend in KERNEL_BACKENDS, "kernel_backend", c.kernel_backend,
           f"one of {KERNEL_BACKENDS}")
  layer_types = expand_pattern(c.layer_pattern, c.num_layers)
  return ModelSpec(
      vocab_size=c.vocab_size, d_model=c.d_model, num_layers=c.num_layers,
      layer_types=layer_types, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
      head_dim=c.head_dim, rope_theta=float(c.rope_theta), norm_eps=float(c.norm_eps),
      tie_embeddings=bool(c.tie_embeddings), value_head=bool(c.value_head),
      max_seq_len=c.max_seq_len,
      sliding_window=c.sliding_window, block_size=c.block_size, topk_tokens=c.topk_tokens,
      num_dense_layers=c.num_dense_layers, d_ff=c.d_ff, num_experts=m.num_experts,
      num_experts_per_token=m.num_experts_per_token, d_ff_expert=m.d_ff_expert,
      num_shared_experts=m.num_shared_experts, gate=m.gate, renormalize=bool(m.renormalize),
      aux_loss_coef=float(m.aux_loss_coef), use_routing_bias=bool(m.use_routing_bias),
      routing_bias_rate=float(m.routing_bias_rate), dtype=c.dtype, param_dtype=c.param_dtype,
      cache_dtype=c.cache_dtype, kernel_backend=c.kernel_backend,
      pallas_interpret=bool(c.pallas_interpret))
