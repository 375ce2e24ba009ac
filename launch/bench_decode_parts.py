"""Where a decode step's time goes: its parts timed on their own, each jitted.

    python -m launch.bench_decode_parts --json
    python -m launch.bench_decode_parts --batch 64 --positions 256 --json

Parts (launch.bench_sampler's default shape, fp32):
  attention_ms      one layer's one-query attention over --positions cached keys
                    (`reference.masked_attention` at T = 1, the decode path);
  moe_experts_ms    one MoE layer's experts on batch x top-k rows sorted by expert, by
                    `ragged_dot` and by the grouped matmul (config.model.moe.expert_matmul),
                    and one dense expert on every row (the active-FLOP floor, x2 padding);
  forward_ms        the whole dense model's cached decode step (cache donated, kv_len the
                    power-of-two bucket the engine would pick) and its uncached T = 1 forward
                    (every matmul, no cache read);
  read_gb_per_s     this machine's bytes roofline: a jitted sum over an array the size of
                    one layer's K and V.
Each figure is the mean of --iters calls after one that compiles.
"""

from __future__ import annotations

import json
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.kernels import reference
from agentic_rl.model import moe
from agentic_rl.model.config import ModelSpec, MoESpec
from agentic_rl.model.transformer import Model

_BATCH = flags.DEFINE_integer("batch", 64, "Rows decoded together.")
_POSITIONS = flags.DEFINE_integer("positions", 256, "Cached positions each row attends to.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 2, "Key/value heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head size.")
_EXPERTS = flags.DEFINE_integer("num_experts", 8, "Experts of the MoE part.")
_TOP = flags.DEFINE_integer("experts_per_tok", 2, "Experts per token.")
_D_FF_EXPERT = flags.DEFINE_integer("d_ff_expert", 256, "Expert MLP hidden size.")
_ITERS = flags.DEFINE_integer("iters", 50, "Timed calls per figure.")
_JSON = flags.DEFINE_bool("json", False, "Print only the JSON report.")


def _ms(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(_ITERS.value):
    out = fn(*args)
  jax.block_until_ready(out)
  return 1e3 * (time.perf_counter() - t0) / _ITERS.value


def _attention(rng) -> dict:
  b, s = _BATCH.value, _POSITIONS.value
  k, n, h = _KV_HEADS.value, _HEADS.value, _HEAD_DIM.value
  q = jnp.asarray(rng.standard_normal((b, 1, n, h)), jnp.float32)
  keys, values = (jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32)
                  for _ in range(2))
  mask = jnp.asarray(np.arange(s)[None, None, :] <= (3 * s) // 4, bool) & jnp.ones((b, 1, 1),
                                                                                  bool)
  total = jax.jit(lambda x: jnp.sum(x))
  kv = jnp.concatenate([keys.ravel(), values.ravel()])
  read_ms = _ms(total, kv)
  return {"attention_ms": _ms(jax.jit(reference.masked_attention), q, keys, values, mask),
          "read_gb_per_s": kv.nbytes / (read_ms * 1e6)}


def _experts(rng) -> dict:
  rows, e, d, f = _BATCH.value * _TOP.value, _EXPERTS.value, _D_MODEL.value, _D_FF_EXPERT.value
  x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
  w = [jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]), jnp.float32)
       for shape in ((e, d, f), (e, d, f), (e, f, d))]
  groups = jnp.asarray(np.bincount(rng.integers(0, e, rows), minlength=e), jnp.int32)
  out = {}
  for matmul in ("ragged_dot", "grouped"):
    fn = jax.jit(lambda x, *w, m=matmul: moe._routed_swiglu(x, *w, expert_matmul=m))
    out[matmul] = _ms(fn, x, *w, groups)
  one = jax.jit(lambda x, a, b, c: (jax.nn.silu(x @ a[0]) * (x @ b[0])) @ c[0])
  out["one_expert_every_row"] = _ms(one, x, *w)
  return {"moe_experts_ms": out, "moe_rows": rows,
          "moe_group_bound": moe.group_bound(rows, e)}


def _forward() -> dict:
  b, s = _BATCH.value, _POSITIONS.value
  capacity = -(-(s + 8) // 8) * 8
  spec = ModelSpec(vocab_size=512, d_model=_D_MODEL.value, num_layers=4, layer_pattern="F",
                   num_heads=_HEADS.value, num_kv_heads=_KV_HEADS.value,
                   head_dim=_HEAD_DIM.value, d_ff=1024, max_seq_len=capacity, qk_norm=True,
                   tie_embeddings=False, dtype="float32", param_dtype="float32",
                   num_dense_layers=4, moe=MoESpec(num_experts=0))
  model = Model(spec)
  params = model.init(jax.random.key(0))
  tokens = jnp.zeros((b, 1), jnp.int32)
  positions = jnp.full((b, 1), s - 1, jnp.int32)
  kv_len = 8
  while kv_len < s:
    kv_len *= 2
  kv_len = None if kv_len >= capacity else kv_len
  step = jax.jit(lambda p, t, q, c: model.forward(p, t, q, c, kv_len=kv_len)[:2],
                 donate_argnums=(3,))
  cache = dict(model.init_cache(b, capacity), lengths=jnp.full((b,), s - 1, jnp.int32))
  _, cache = step(params, tokens, positions, cache)
  jax.block_until_ready(cache)
  t0 = time.perf_counter()
  for _ in range(_ITERS.value):
    # The same position each call: the cache holds s - 1 tokens before every step.
    cache = dict(cache, lengths=jnp.full((b,), s - 1, jnp.int32))
    _, cache = step(params, tokens, positions, cache)
  jax.block_until_ready(cache)
  cached_ms = 1e3 * (time.perf_counter() - t0) / _ITERS.value
  uncached = jax.jit(lambda p, t, q: model.forward(p, t, q)[0])
  return {"forward_ms": {"cached_decode": cached_ms,
                         "uncached_t1": _ms(uncached, params, tokens, jnp.zeros_like(tokens))},
          "kv_len": kv_len, "capacity": capacity}


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  report = {"batch": _BATCH.value, "positions": _POSITIONS.value,
            "backend": jax.default_backend()}
  report.update(_attention(rng))
  report.update(_experts(rng))
  report.update(_forward())
  print(json.dumps(report) if _JSON.value else json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
