"""The model's config section (`config.model`): defaults, checks and the per-layer plan.

`ModelSpec` (with its nested `moe` section) holds the defaults and the checks
(agentic_rl/config_schema.py); `default_model_config` generates the ConfigDict that
config files edit, and `validate` builds the spec back by field name, so a bad value is a
`ValueError` naming `config.model.<field>` before any array is allocated. The spec is
hashable: safe as a jit static argument.
"""

from __future__ import annotations

import dataclasses
import functools

import ml_collections

from agentic_rl.config_schema import (check, from_config_dict, is_int, is_number, one_of,
                                      to_config_dict)

@dataclasses.dataclass(frozen=True)
class LayerKind:
  """What an attention layer type brings. The one place the cache layout, replay, route A
  and sizing read it from: consumers ask the kind, they do not test letters."""
  name: str
  ring_cache: bool  # A ring buffer of sliding_window slots; else a full position-indexed cache.
  block_summaries: bool  # Mean key per block beside the full cache (block selection).
  replay: tuple[str, ...]  # What it records in aux["layers"][i] and a replay can force.
  consistent: str  # The letter route A uses: same params, no choice sampler and learner
  # could make differently.


LAYER_KINDS = {
    "S": LayerKind("gated sliding window", ring_cache=True, block_summaries=False,
                   replay=(), consistent="S"),
    "G": LayerKind("block top-k sparse GQA", ring_cache=False, block_summaries=True,
                   replay=("blocks",), consistent="F"),
    "F": LayerKind("dense causal", ring_cache=False, block_summaries=False, replay=(),
                   consistent="F"),
}
LAYER_TYPES = tuple(LAYER_KINDS)
GATE_FUNCTIONS = ("softmax", "sigmoid")
MOE_DISPATCHES = ("dropless", "all_to_all", "ragged_all_to_all")
EXPERT_MATMULS = ("auto", "ragged_dot", "grouped")
# The S layers' per-head output gate: sigmoid(x W + b) (the project's own); 2 sigmoid(x W + b),
# exactly 1 at zero weights, so a dense model retrofitted to S layers starts unchanged; none.
S_GATES = ("sigmoid", "unit_sigmoid", "none")
ROPE_SCALINGS = ("none", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
KERNEL_BACKENDS = ("reference", "pallas", "auto")
# What the backward recomputes (jax.checkpoint per layer): nothing; everything but each
# layer's input; everything but the matmul outputs (jax's dots_with_no_batch_dims_saveable).
REMAT_POLICIES = ("none", "full", "save_dots")


@dataclasses.dataclass(frozen=True)
class LayerScan:
  """How config.model.scan_layers lays the stack out: the first `unrolled` layers as
  themselves (`layer_0` ..), then `repeats` groups of `period` layers under one `nn.scan`
  (`layers/slot_j`, each param with a leading axis of `repeats`). Layer
  `unrolled + r * period + j` is slot j of repeat r; every repeat of a slot has one kind."""
  unrolled: int
  period: int
  repeats: int

  def layer(self, slot: int, repeat: int) -> int:
    return self.unrolled + repeat * self.period + slot

  def place(self, layer: int) -> tuple[int, int] | None:
    """(slot, repeat) of a scanned layer; None for an unrolled one."""
    if layer < self.unrolled:
      return None
    repeat, slot = divmod(layer - self.unrolled, self.period)
    return slot, repeat


@functools.lru_cache(maxsize=64)
def plan_layer_scan(kinds: tuple) -> LayerScan | None:
  """The layout that compiles the fewest layers (unrolled ones plus one group), fewer
  unrolled first on a tie: a group of P layers repeating at least twice to the end of the
  stack after the unrolled ones, each layer of the kind of its slot. None if none exists
  (only a scan of one repeat, which bounds nothing)."""
  best = None
  n = len(kinds)
  for unrolled in range(n):
    if best is not None and unrolled + 1 >= best.unrolled + best.period:
      break
    rest = kinds[unrolled:]
    for period in range(1, len(rest) // 2 + 1):
      if best is not None and unrolled + period >= best.unrolled + best.period:
        break
      if len(rest) % period == 0 and all(k == rest[i % period] for i, k in enumerate(rest)):
        best = LayerScan(unrolled, period, len(rest) // period)
        break
  return best


def _positive_int(field: str, value) -> None:
  check(is_int(value) and value > 0, field, value, "a positive integer")


@dataclasses.dataclass(frozen=True)
class MoESpec:
  """`config.model.moe`: the routed experts of the MoE layers."""

  num_experts: int = 8  # 0 = no MoE (every layer dense).
  num_experts_per_token: int = 2
  d_ff_expert: int = 32
  num_shared_experts: int = 1
  gate: str = "softmax"  # or "sigmoid"
  renormalize: bool = True
  aux_loss_coef: float = 1e-2  # Switch-style load-balancing loss; 0 turns it off.
  use_routing_bias: bool = False  # Aux-loss-free balancing: a bias that only affects selection.
  routing_bias_rate: float = 1e-3  # Step size of the bias update (sign of load error).
  # 'dropless': every expert's rows on this device (ragged_dot). 'all_to_all': expert
  # parallel over the context mesh's `expert` axis (jax.set_mesh), capacity_factor times an
  # even share of rows per expert and source shard; overflow is dropped and counted.
  # 'ragged_all_to_all': expert parallel and dropless (jax.lax.ragged_all_to_all on TPU/GPU;
  # an emulation of it on XLA:CPU). See parallel/expert_parallel.py.
  dispatch: str = "dropless"
  capacity_factor: float = 1.25
  # How each device runs its experts on rows sorted by expert. 'ragged_dot': one
  # jax.lax.ragged_dot per matrix (TPU/GPU run only each group's rows; XLA:CPU runs every
  # expert on every row). 'grouped': each expert's rows padded to a static bound (twice an
  # even share) and batched matmuls, E times fewer FLOPs on CPU; when a group passes the
  # bound the call takes ragged_dot instead (lax.cond), so it stays exact and dropless.
  # 'auto': grouped on CPU, ragged_dot elsewhere.
  expert_matmul: str = "auto"

  def __post_init__(self):
    check(is_int(self.num_experts) and self.num_experts >= 0, "num_experts", self.num_experts,
          "0 (no MoE) or more")
    if self.num_experts > 0:
      check(is_int(self.num_experts_per_token)
            and 1 <= self.num_experts_per_token <= self.num_experts,
            "num_experts_per_token", self.num_experts_per_token,
            f"between 1 and moe.num_experts={self.num_experts}")
      _positive_int("d_ff_expert", self.d_ff_expert)
    check(is_int(self.num_shared_experts) and self.num_shared_experts >= 0,
          "num_shared_experts", self.num_shared_experts, ">= 0")
    one_of(self.gate, "gate", GATE_FUNCTIONS)
    one_of(self.dispatch, "dispatch", MOE_DISPATCHES)
    one_of(self.expert_matmul, "expert_matmul", EXPERT_MATMULS)
    check(is_number(self.capacity_factor) and self.capacity_factor > 0, "capacity_factor",
          self.capacity_factor, "a number > 0 (rows per expert, in even shares)")

  def replace(self, **changes) -> "MoESpec":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class RopeScalingSpec:
  """`config.model.rope_scaling`: how RoPE frequencies stretch past the pretraining context.

  kind 'llama3' (Llama 3.1+): wavelengths longer than original_max_len / low_freq_factor are
  divided by `factor`, those shorter than original_max_len / high_freq_factor are kept, and
  the band between is interpolated (model/rope.py)."""

  kind: str = "none"  # or "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192

  def __post_init__(self):
    one_of(self.kind, "kind", ROPE_SCALINGS)
    if self.kind == "llama3":
      check(self.factor >= 1.0, "factor", self.factor, ">= 1")
      check(0 < self.low_freq_factor < self.high_freq_factor, "low_freq_factor",
            self.low_freq_factor, f"positive and below high_freq_factor={self.high_freq_factor}")
      _positive_int("original_max_len", self.original_max_len)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """`config.model` as checked: a small hybrid MoE by default; configs override what they
  need."""

  vocab_size: int = 320
  d_model: int = 64
  num_layers: int = 4
  # Repeated (and truncated) to num_layers: "SSSG" is the 3:1 hybrid. See `layer_types`.
  layer_pattern: str = "SSSG"
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  rope_theta: float = 10_000.0
  rope_scaling: RopeScalingSpec = RopeScalingSpec()
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  # Architecture options of the Hugging Face families (model/families/): Qwen3's RMSNorm of
  # each query and key head before RoPE; Llama's biases on q, k, v, o and on the FFN.
  qk_norm: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False
  s_gate: str = "sigmoid"  # The S layers' output gate: S_GATES.
  value_head: bool = False  # A critic read-out on the same trunk (GAE); aux["values"].
  max_seq_len: int = 512  # Capacity of full (F, G) caches; positions must stay below it.

  sliding_window: int = 32  # W for S layers.
  block_size: int = 8  # B for G layers.
  topk_tokens: int = 32  # k for G layers: k / B blocks are selected per query group.

  num_dense_layers: int = 1  # The first N layers use a dense FFN instead of MoE.
  # Qwen-MoE's per-layer choice: layer i is MoE only if (i + 1) % moe_layer_step == 0 and i is
  # not in dense_layers (decoder_sparse_step, mlp_only_layers), on top of num_dense_layers.
  moe_layer_step: int = 1
  dense_layers: tuple[int, ...] = ()
  d_ff: int = 128  # Hidden size of the dense FFN.

  moe: MoESpec = MoESpec()

  dtype: str = "float32"  # Compute dtype.
  param_dtype: str = "float32"
  cache_dtype: str = "float32"  # bfloat16 makes a cheaper (route B) sampler cache.
  # "pallas" on TPU/GPU, or in interpret mode on CPU; "auto": Pallas on TPU/GPU, else the
  # reference (kernels/dispatch.py).
  kernel_backend: str = "reference"
  remat: str = "none"  # Per-layer rematerialisation in the backward: REMAT_POLICIES.
  # Vocabulary rows per chunk of the learner's read-out (log-probs, entropy, SFT loss): the
  # [B, T, V] fp32 logits are never built (rl/chunked_logprobs.py). 0 = full logits at once.
  readout_chunk: int = 256
  # One nn.scan over the repeating group of layers (`layer_scan`), so compile time stays
  # bounded in num_layers. Params sit under `layers/slot_j` with a leading repeat axis;
  # files on disk keep the unrolled layout (model/layer_stack.py converts).
  scan_layers: bool = False
  pallas_interpret: bool = False

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_seq_len", "sliding_window", "block_size", "topk_tokens"):
      _positive_int(name, getattr(self, name))
    check(self.num_heads % self.num_kv_heads == 0, "num_heads", self.num_heads,
          f"a multiple of num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    check(self.head_dim % 2 == 0, "head_dim", self.head_dim,
          "an even number (RoPE rotates pairs)")
    check(self.topk_tokens % self.block_size == 0, "topk_tokens", self.topk_tokens,
          f"a multiple of block_size={self.block_size}")
    check(is_int(self.num_dense_layers) and 0 <= self.num_dense_layers <= self.num_layers,
          "num_dense_layers", self.num_dense_layers, f"between 0 and num_layers={self.num_layers}")
    _positive_int("moe_layer_step", self.moe_layer_step)
    bad = [i for i in self.dense_layers if not (is_int(i) and 0 <= i < self.num_layers)]
    check(not bad, "dense_layers", self.dense_layers,
          f"layer indices in [0, num_layers={self.num_layers})")
    has_dense = any(not self.is_moe_layer(i) for i in range(self.num_layers))
    check(is_int(self.d_ff) and (self.d_ff > 0 or not has_dense), "d_ff",
          self.d_ff, "a positive integer when a layer has a dense FFN")
    one_of(self.s_gate, "s_gate", S_GATES)
    for name in ("dtype", "param_dtype", "cache_dtype"):
      one_of(getattr(self, name), name, DTYPES)
    one_of(self.kernel_backend, "kernel_backend", KERNEL_BACKENDS)
    one_of(self.remat, "remat", REMAT_POLICIES)
    check(is_int(self.readout_chunk) and self.readout_chunk >= 0 and self.readout_chunk % 8 == 0,
          "readout_chunk", self.readout_chunk,
          "0 (full logits) or a positive multiple of 8 (whole bytes of the packed sampling mask)")
    expand_pattern(self.layer_pattern, self.num_layers)  # Bad letters fail here, not later.
    if self.scan_layers:
      kinds = ", ".join(f"{t}{'/moe' if m else ''}" for t, m in self.layer_kinds)
      check(self.layer_scan is not None, "scan_layers", self.scan_layers,
            "layers whose kinds (attention letter, MoE or dense FFN) repeat: a group of "
            "layers at least twice to the end of the stack, after any unrolled leading "
            f"layers. Layers 0..{self.num_layers - 1} are {kinds}; make the MoE layers "
            "regular (num_dense_layers, dense_layers, moe_layer_step) or set "
            "scan_layers=False")

  @property
  def layer_types(self) -> tuple[str, ...]:
    """One letter per layer: layer_pattern repeated (and truncated) to num_layers."""
    return expand_pattern(self.layer_pattern, self.num_layers)

  @property
  def layer_kinds(self) -> tuple[tuple[str, bool], ...]:
    """(letter, is MoE) per layer: two layers of one kind have the same params tree."""
    return tuple((t, self.is_moe_layer(i)) for i, t in enumerate(self.layer_types))

  @property
  def layer_scan(self) -> LayerScan | None:
    """The scanned layout under scan_layers (`plan_layer_scan`); None without it."""
    return plan_layer_scan(self.layer_kinds) if self.scan_layers else None

  @property
  def num_selected_blocks(self) -> int:
    return self.topk_tokens // self.block_size

  @property
  def num_blocks(self) -> int:
    """Blocks in a full cache of max_seq_len positions."""
    return -(-self.max_seq_len // self.block_size)

  def is_moe_layer(self, layer: int) -> bool:
    return (self.moe.num_experts > 0 and layer >= self.num_dense_layers
            and layer not in self.dense_layers and (layer + 1) % self.moe_layer_step == 0)

  def replay_keys(self, layer: int) -> tuple[str, ...]:
    """What layer `layer` records in aux["layers"] and a replay can force: "experts" on
    MoE layers, "blocks" on block-sparse (G) layers. Consumers ask this, not the letters."""
    return ((("experts",) if self.is_moe_layer(layer) else ())
            + LAYER_KINDS[self.layer_types[layer]].replay)

  def params_started_fresh(self) -> tuple[str, ...]:
    """Param names (or '/'-ending prefixes) a base may lack; loading one starts them at
    init. The value head (route A's critic, which a policy base has none of), and the S
    layers' gates under s_gate='unit_sigmoid' (zero weights give a gate of exactly 1): a
    dense base, such as an imported Hugging Face model, lacks them, and the retrofitted
    hybrid starts as a pass-through. Names are in the unrolled layout params files keep
    (`layer_{i}/...`) whatever scan_layers says."""
    gates = () if self.s_gate != "unit_sigmoid" else tuple(
        f"layer_{i}/attn/{name}" for i, kind in enumerate(self.layer_types)
        if kind == "S" for name in ("w_gate_dn", "b_gate_n"))
    return ("value_head/",) + gates

  def replace(self, **changes) -> "ModelSpec":
    return dataclasses.replace(self, **changes)

  def all_dense(self) -> "ModelSpec":
    """The same model with every attention layer dense (F)."""
    return self.replace(layer_pattern="F")


def dense_pattern(pattern: str) -> str:
  """`pattern` with each layer replaced by its kind's `consistent` letter: block-sparse G
  becomes dense F (same parameters, every key attended, so no block choice can differ
  between sampler and learner: route A). Unknown letters stay for validation to name."""
  return "".join(LAYER_KINDS[c].consistent if c in LAYER_KINDS else c
                 for c in pattern.upper())


def expand_pattern(pattern: str, num_layers: int) -> tuple[str, ...]:
  """`pattern` repeated (and truncated) to `num_layers` letters; a bad letter is a
  FieldError naming layer_pattern (config.model.layer_pattern once `validate` adds the
  path)."""
  check(isinstance(pattern, str) and bool(pattern), "layer_pattern", pattern,
        "letters of layer types, e.g. 'SSSG'")
  pattern = pattern.upper()
  bad = sorted(set(pattern) - set(LAYER_TYPES))
  check(not bad, "layer_pattern", pattern,
        f"letters from {LAYER_TYPES} ("
        + ", ".join(f"{c}: {k.name}" for c, k in LAYER_KINDS.items())
        + f"), not the unknown layer types {bad}")
  return tuple((pattern * (num_layers // len(pattern) + 1))[:num_layers])


def default_model_config() -> ml_collections.ConfigDict:
  return to_config_dict(ModelSpec())


def validate(model_config) -> ModelSpec:
  """Checks `config.model` (a ConfigDict, or a built ModelSpec) and returns its spec."""
  return from_config_dict(ModelSpec, model_config, "config.model")
