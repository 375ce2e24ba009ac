"""`launch.sparse_coverage`: the indexer's coverage, recall and cost over a grid of block
sizes and token budgets, on the queries and keys of real trajectories.

The layers measured are the model's G layers (block top-k sparse), or every layer of a
model without any: what the indexer would keep if those layers were sparse. Each grid
point's coverage and recall are means over trajectories, layers, heads and positions
(quantify/sparse_coverage.py); its cost is per query and kv head at the longest
trajectory's context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.quantify import sparse_coverage as sc

# The design's pair (DESIGN_NOTES.md): B=8, k=4096 against B=1, k=2048; the indexer ~8x
# cheaper, coverage 78.06% against 79.09%. The notes do not say at what context; 32K
# tokens (k/T = 1/8 for B=8) is the default, --design_context changes it. At the
# architecture's million tokens, k/T would leave a tiny model's context one block.
DESIGN_CONTEXT = 1 << 15
DESIGN_COVERAGE = {"coverage_b8": 0.7806, "coverage_b1": 0.7909, "indexer_cost_ratio": 8.0}


def measured_layers(spec) -> list[int]:
  """The G layers, or every layer of a model without any."""
  sparse = [i for i, t in enumerate(spec.layer_types) if t == "G"]
  return sparse or list(range(spec.num_layers))


def capture_queries_keys(model, params, tokens_t: np.ndarray, layers: list[int]
                         ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
  """{layer: (q [T, N, H], k [T, K, H])} after RoPE, from one forward of one sequence."""
  t = len(tokens_t)
  _, state = jax.jit(lambda p, x, pos: model.module.apply(
      {"params": p}, x, pos, None, None, mutable=["intermediates"]))(
          params, jnp.asarray(tokens_t[None], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None])
  inter = jax.device_get(state["intermediates"])
  out = {}
  for i in layers:
    attn = inter[f"layer_{i}"]["attn"]
    out[i] = (np.asarray(attn["q_btnh"][0][0], np.float64),
              np.asarray(attn["k_btkh"][0][0], np.float64))
  return out


def parse_grid(block_sizes: list[int], topk_tokens: list[int]) -> list[tuple[int, int]]:
  """Every (B, k) with k a multiple of B, in order; a k that no B divides is an error."""
  grid = [(b, k) for b in block_sizes for k in topk_tokens if b > 0 and k % b == 0]
  for k in topk_tokens:
    if not any(b > 0 and k % b == 0 for b in block_sizes):
      raise ValueError(f"--topk_tokens {k} is not a multiple of any --block_sizes "
                       f"{block_sizes}.")
  return grid


def measure(model, params, trajectories, grid: list[tuple[int, int]],
            design_context: int = DESIGN_CONTEXT, key_bytes: int = 4) -> dict:
  """The report: one row per grid point, and the design's pair scaled to this context."""
  spec = model.spec
  layers = measured_layers(spec)
  context = max(t.length for t in trajectories)
  pair = sc.design_pair(context, design_context)
  points = list(dict.fromkeys(list(grid) + [p for p in pair if p[0] <= context]))
  sums = {p: [0.0, 0.0, 0] for p in points}
  for traj in trajectories:
    captured = capture_queries_keys(model, params, np.asarray(traj.tokens), layers)
    for q_tnh, k_tkh in captured.values():
      probs = sc.dense_probs(q_tnh, k_tkh)
      order = sc.mass_order(probs)
      for p in points:
        cov, rec = sc.coverage_and_recall(q_tnh, k_tkh, *p, probs_ntt=probs, order_ntt=order)
        sums[p][0] += cov
        sums[p][1] += rec
        sums[p][2] += 1

  def row(p):
    cost = sc.indexer_cost(context, p[0], spec.num_heads, spec.num_kv_heads, spec.head_dim,
                           key_bytes)
    return {"block_size": p[0], "topk_tokens": p[1], "coverage": sums[p][0] / sums[p][2],
            "recall": sums[p][1] / sums[p][2], **cost}

  rows = {p: row(p) for p in points}
  (b8, b1) = pair
  seed_pair = {"context": context, "design_context": design_context,
               "b8_topk_tokens": b8[1], "b1_topk_tokens": b1[1],
               "coverage_b8": rows[b8]["coverage"] if b8 in rows else None,
               "coverage_b1": rows[b1]["coverage"],
               "indexer_cost_ratio": (rows[b1]["indexer_flops_per_query"]
                                      / rows[b8]["indexer_flops_per_query"]
                                      if b8 in rows else None),
               "design": DESIGN_COVERAGE}
  return {"rows": [rows[p] for p in grid], "seed_pair": seed_pair, "layers": layers,
          "layer_types": "".join(spec.layer_types[i] for i in layers),
          "trajectories": len(trajectories), "context": context}


def markdown(report: dict) -> str:
  lines = [f"# Sparse attention coverage\n\nLayers {report['layers']} "
           f"({report['layer_types']}), {report['trajectories']} trajectories, context "
           f"{report['context']} tokens.", "",
           "| B | k | coverage | recall | indexer FLOPs/query | scoring bytes |",
           "|---|---|---|---|---|---|"]
  for r in report["rows"]:
    lines.append(f"| {r['block_size']} | {r['topk_tokens']} | {r['coverage']:.4f} | "
                 f"{r['recall']:.4f} | {r['indexer_flops_per_query']} | "
                 f"{r['scoring_bytes']} |")
  s = report["seed_pair"]
  fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
  lines += ["", f"The design's pair at this context (k scaled by {s['context']}/"
            f"{s['design_context']}): B=8, k={s['b8_topk_tokens']} against B=1, "
            f"k={s['b1_topk_tokens']}.", "",
            "| | coverage B=8 | coverage B=1 | indexer cost ratio (B=1 / B=8) |",
            "|---|---|---|---|",
            f"| here | {fmt(s['coverage_b8'])} | {fmt(s['coverage_b1'])} | "
            f"{fmt(s['indexer_cost_ratio'])} |",
            f"| design | {s['design']['coverage_b8']:.4f} | {s['design']['coverage_b1']:.4f} | "
            f"{s['design']['indexer_cost_ratio']:.1f} |"]
  return "\n".join(lines) + "\n"


def write_plot(report: dict, path: str):
  """Coverage against k, one line per block size. Returns the figure."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(6, 4))
  FigureCanvasAgg(fig)
  ax = fig.add_subplot(1, 1, 1)
  for b in sorted({r["block_size"] for r in report["rows"]}):
    rows = [r for r in report["rows"] if r["block_size"] == b]
    ax.plot([r["topk_tokens"] for r in rows], [r["coverage"] for r in rows], marker="o",
            label=f"B={b}")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("token budget k")
  ax.set_ylabel("dense attention mass covered")
  ax.set_ylim(0, 1.02)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=80)
  return fig
