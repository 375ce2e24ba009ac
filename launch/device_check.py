"""Every Pallas attention kernel, forward and backward, compiled and timed on whatever
accelerator is present, against the jnp reference: which ran, how far apart, how fast.

    python -m launch.device_check --json
    python -m launch.device_check --batch 4 --seq_len 2048 --json   # on a GPU / TPU

On a GPU or TPU the kernels compile for it; on the CPU they run in Pallas interpret mode
(slow: the defaults are sized for it; --seq_len 4096 suits an accelerator). Each kernel:
the forward, then the gradient of sum(out * g) in q, k, v. Prints {"backend", "device",
"pallas_mode", "shape", "kernels": {name: {"ran", "forward_max_abs_diff",
"grad_max_abs_diff", "pallas_ms", "reference_ms", "pallas_grad_ms", "reference_grad_ms",
"compile_s"}}, "seconds"}. One short run covers a lent GPU (under 5 minutes).
"""

from __future__ import annotations

import json
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.kernels import dispatch
from agentic_rl.kernels import pallas_ops
from agentic_rl.kernels import reference

_BATCH = flags.DEFINE_integer("batch", 1, "Sequences.")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Query and key positions.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 2, "KV heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dim.")
_WINDOW = flags.DEFINE_integer("window", 128, "Sliding window of the S-layer kernel.")
_BLOCK = flags.DEFINE_integer("block_size", 8, "Block size of the block-sparse kernel.")
_TOPK = flags.DEFINE_integer("topk_tokens", 64, "Tokens selected per query group.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls (median).")
_JSON = flags.DEFINE_bool("json", False, "Print only the JSON report.")


def _timed(fn, args, repeats):
  """(compile seconds, median ms, output) of jitted `fn` on `args`."""
  jitted = jax.jit(fn)
  t0 = time.perf_counter()
  out = jax.block_until_ready(jitted(*args))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return compile_s, statistics.median(times), out


def _cases(b, t, n, kv, h, window, block_size, topk):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  block_keys = reference.block_means(k, jnp.full((b,), t, jnp.int32), block_size=block_size)
  blocks = reference.select_blocks(q, block_keys, pos, block_size=block_size,
                                   num_selected=topk // block_size)
  return (q, k, v), {
      "flash_causal": lambda ops: lambda q, k, v: ops.causal_attention(q, k, v, pos, pos),
      "flash_sliding_window": lambda ops: lambda q, k, v: ops.sliding_window_attention(
          q, k, v, pos, pos, window=window),
      "block_sparse": lambda ops: lambda q, k, v: ops.block_sparse_attention(
          q, k, v, blocks, pos, block_size=block_size),
  }


def main(argv):
  del argv
  t_start = time.perf_counter()
  platform = jax.default_backend()
  on_accelerator = dispatch.resolve_backend("auto", platform) == "pallas"
  pallas = pallas_ops.make_ops(interpret=not on_accelerator)
  (q, k, v), cases = _cases(_BATCH.value, _SEQ.value, _HEADS.value, _KV_HEADS.value,
                            _HEAD_DIM.value, _WINDOW.value, _BLOCK.value, _TOPK.value)
  g = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)
  kernels = {}
  for name, bind in cases.items():
    row = {"ran": "pallas" if on_accelerator else "pallas_interpret"}
    outs = {}
    for label, ops in (("pallas", pallas), ("reference", dispatch.REFERENCE_OPS)):
      fn = bind(ops)
      grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * g), argnums=(0, 1, 2))
      compile_s, ms, out = _timed(fn, (q, k, v), _REPEATS.value)
      grad_compile_s, grad_ms, grads = _timed(grad, (q, k, v), _REPEATS.value)
      row[f"{label}_ms"], row[f"{label}_grad_ms"] = ms, grad_ms
      if label == "pallas":
        row["compile_s"] = compile_s + grad_compile_s
      outs[label] = (out, grads)
    (out_p, grads_p), (out_r, grads_r) = outs["pallas"], outs["reference"]
    row["forward_max_abs_diff"] = float(jnp.max(jnp.abs(out_p - out_r)))
    row["grad_max_abs_diff"] = max(float(jnp.max(jnp.abs(a - b)))
                                   for a, b in zip(grads_p, grads_r))
    kernels[name] = row
  report = {
      "backend": platform, "device": str(jax.devices()[0].device_kind),
      "pallas_mode": "compiled" if on_accelerator else "interpret",
      "shape": {"batch": _BATCH.value, "seq_len": _SEQ.value, "num_heads": _HEADS.value,
                "num_kv_heads": _KV_HEADS.value, "head_dim": _HEAD_DIM.value,
                "window": _WINDOW.value, "block_size": _BLOCK.value,
                "topk_tokens": _TOPK.value},
      "kernels": kernels, "seconds": time.perf_counter() - t_start,
  }
  print(json.dumps(report) if _JSON.value else json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
