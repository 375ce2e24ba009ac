"""Per-device memory of a run on a mesh, from shapes and the sharding rules only.

Nothing is allocated: params and optimiser state are `jax.eval_shape` trees, each leaf's
bytes divided by how many shards its PartitionSpec (rules.py) splits it into.

  params        the model's params in config.model.param_dtype
  optimizer     the learner's optax state (AdamW moments, clip state), eval_shape'd
  gradients     one gradient per param, in the param dtype
  reference     the frozen KL reference policy, when config.rl.loss.kl_coef > 0
  activations   what the backward keeps for one micro-batch of `batch` sequences of
                `seq_len` tokens under config.model.remat (`activation_bytes`): per layer
                and token, the residual input, the two norm outputs, q, k, v and the
                attention output, the FFN's gate, up and product (for MoE, P of them at
                d_ff_expert, plus shared experts and router scores), less what remat
                recomputes; plus the float32 logits and their log-softmax. Attention
                is assumed flash-style (kernel_backend='pallas' on TPU/GPU): the
                reference kernels' [T, S] scores are not counted. Batch rows split over data x fsdp x expert,
                heads, FFN hidden and vocab over tensor (when they divide).
  kv_cache      the sampler's caches: `slots` sequences of `rollout_len` tokens
                (model/cache.cache_bytes_per_sequence), rows over data x fsdp x expert, kv heads
                over tensor when they divide.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from agentic_rl.model import cache as cache_lib
from agentic_rl.model.config import ModelSpec
from agentic_rl.model.transformer import Model
from agentic_rl.parallel import rules


def _shards(spec, sizes) -> int:
  n = 1
  for entry in spec:
    for axis in (entry if isinstance(entry, tuple) else (entry,)):
      if axis is not None:
        n *= sizes[axis]
  return n


def tree_bytes_per_device(tree, sizes: dict[str, int]) -> int:
  specs = jax.tree.leaves(rules.param_specs(tree, sizes), is_leaf=lambda x: isinstance(x, rules.P))
  leaves = jax.tree.leaves(tree)
  return int(sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize // _shards(s, sizes)
                 for leaf, s in zip(leaves, specs)))


def _split(dim: int, size: int) -> float:
  return dim / size if size > 1 and dim % size == 0 else float(dim)


def _layer_terms(spec: ModelSpec, i: int, t: int) -> dict[str, float]:
  """Per token, bytes a layer's backward may keep: its input, the rest of the attention
  (norm outputs, q, k, v, attention output), the matmul outputs among them, and the FFN's
  (gate, up and product per active expert; router scores in float32)."""
  itemsize = np.dtype(spec.dtype).itemsize
  d = spec.d_model
  q = _split(spec.num_heads, t) * spec.head_dim
  kv = _split(spec.num_kv_heads, t) * spec.head_dim
  if spec.is_moe_layer(i):
    m = spec.moe
    width = (m.num_experts_per_token + m.num_shared_experts) * _split(m.d_ff_expert, t)
    # Only the shared experts' and the router's are plain dots: the routed experts' are
    # ragged_dot (or batched einsums under expert parallelism), which save_dots recomputes.
    dot_width = m.num_shared_experts * _split(m.d_ff_expert, t)
    # Router scores (float32), each token's P dispatched rows, and their float32 outputs
    # before the gates combine them (moe.py, expert_parallel.py).
    scores = m.num_experts * 4
    router = scores + m.num_experts_per_token * d * (itemsize + 4)
  else:
    width = dot_width = _split(spec.d_ff, t)
    scores = router = 0
  return {"input": d * itemsize,
          "attention": (2 * d + 2 * q + 2 * kv) * itemsize,
          "attention_dots": (q + 2 * kv + d) * itemsize,
          "ffn": 3 * width * itemsize + router,
          "ffn_dots": (2 * dot_width + d) * itemsize + scores}


def activation_bytes(spec: ModelSpec, sizes: dict[str, int], batch: int, seq_len: int) -> int:
  """Bytes the backward keeps for one micro-batch under config.model.remat: 'none' keeps
  every layer's activations; 'full' each layer's input, plus one layer recomputed at a
  time; 'save_dots' each layer's input and matmul outputs, plus one layer recomputed."""
  rows = _split(batch, rules.batch_shards(sizes))  # rules.py keeps an undivided batch whole.
  terms = [_layer_terms(spec, i, sizes["tensor"]) for i in range(spec.num_layers)]
  whole = [x["input"] + x["attention"] + x["ffn"] for x in terms]
  if spec.remat == "none":
    per_token = sum(whole)
  elif spec.remat == "full":
    per_token = sum(x["input"] for x in terms) + max(whole)
  else:
    per_token = sum(x["input"] + x["attention_dots"] + x["ffn_dots"] for x in terms) + max(whole)
  logits = 2 * _split(spec.vocab_size, sizes["tensor"]) * 4  # float32 logits, log-softmax
  return int(rows * seq_len * (per_token + logits))


def plan(spec: ModelSpec, sizes: dict[str, int], *, batch: int, seq_len: int, slots: int,
         rollout_len: int, optimizer=None, kl_reference: bool = False,
         hbm_bytes: int | None = None) -> dict:
  params = Model(spec).param_shapes()
  params_b = tree_bytes_per_device(params, sizes)
  breakdown = {"params": params_b, "gradients": params_b}
  if optimizer is not None:
    breakdown["optimizer"] = tree_bytes_per_device(jax.eval_shape(optimizer.init, params),
                                                   sizes)
  if kl_reference:
    breakdown["reference"] = params_b
  breakdown["activations"] = activation_bytes(spec, sizes, batch, seq_len)
  rows = _split(slots, rules.batch_shards(sizes))
  kv_split = sizes["tensor"] if spec.num_kv_heads % sizes["tensor"] == 0 else 1
  breakdown["kv_cache"] = int(rows * cache_lib.cache_bytes_per_sequence(
      spec, rollout_len) / kv_split)
  total = int(sum(breakdown.values()))
  return {"per_device_bytes": total, "breakdown": breakdown, "hbm_bytes": hbm_bytes,
          "fits": None if hbm_bytes is None else total <= hbm_bytes, "mesh": sizes,
          "devices": math.prod(sizes.values()),
          "workload": {"batch": batch, "seq_len": seq_len, "slots": slots,
                       "rollout_len": rollout_len, "remat": spec.remat}}
