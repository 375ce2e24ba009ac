"""How much of dense attention the block top-k indexer keeps, on real queries and keys
(`launch.sparse_coverage`).

For one sequence's queries q [T, N, H] and keys k [T, K, H] of one layer (after RoPE), and
a grid point (block size B, token budget k): the indexer (kernels/reference.select_blocks)
scores every past block by the group-mean query dotted with the block's mean key, keeps
the query's own block and the k/B - 1 best past blocks, per kv head. Then, per query head
and query position:

  coverage  the dense causal softmax mass that falls on the selected tokens
  recall    the share of the dense top-k tokens (by mass) that were selected

both averaged over heads and positions (a query with at most k visible tokens sees them
all: 1). The indexer's cost per query and kv head, at a context of T tokens:

  scoring   FLOPs 2*H*ceil(T/B) (dot with each block key) + H*(G - 1) (the group mean of
            G = N/K query heads); bytes ceil(T/B)*H*bytes (the block keys read)
  selection FLOPs ceil(T/B) (one comparison per score, a top-k's lower bound); bytes
            ceil(T/B)*4 (the fp32 scores read)

All in float64 numpy: this is the reference, not a fast path.
"""

from __future__ import annotations

import math

import numpy as np


def _softmax_rows(scores_qt: np.ndarray) -> np.ndarray:
  m = np.max(scores_qt, axis=-1, keepdims=True)
  e = np.exp(scores_qt - m)
  return e / e.sum(axis=-1, keepdims=True)


def dense_probs(q_tnh: np.ndarray, k_tkh: np.ndarray) -> np.ndarray:
  """Causal softmax attention probabilities [N, T, T] (query head n uses kv head n // G)."""
  t, n, h = q_tnh.shape
  g = n // k_tkh.shape[1]
  k_tnh = np.repeat(k_tkh, g, axis=1).astype(np.float64)
  scores_ntt = np.einsum("qnh,tnh->nqt", q_tnh.astype(np.float64), k_tnh) / math.sqrt(h)
  future = np.triu(np.ones((t, t), bool), 1)
  return _softmax_rows(np.where(future[None], -np.inf, scores_ntt))


def selected_tokens(q_tnh: np.ndarray, k_tkh: np.ndarray, block_size: int,
                    topk_tokens: int) -> np.ndarray:
  """bool [K, T, T]: token s is selected for query t under kv head k (the indexer's own
  block plus its best past blocks, as kernels/reference.select_blocks picks them)."""
  t, n, h = q_tnh.shape
  kv = k_tkh.shape[1]
  g = n // kv
  c = -(-t // block_size)
  num_selected = topk_tokens // block_size
  keys = np.zeros((c * block_size, kv, h))
  keys[:t] = k_tkh
  count = np.minimum(block_size, t - np.arange(c) * block_size)  # Valid keys per block.
  block_keys_ckh = keys.reshape(c, block_size, kv, h).sum(1) / count[:, None, None]
  q_mean_tkh = q_tnh.astype(np.float64).reshape(t, kv, g, h).mean(2)
  scores_ktc = np.einsum("tkh,ckh->ktc", q_mean_tkh, block_keys_ckh) / math.sqrt(h)
  own_t = np.arange(t) // block_size
  past_tc = np.arange(c)[None, :] < own_t[:, None]
  blocks_ktc = np.zeros((kv, t, c), bool)
  blocks_ktc[:, np.arange(t), own_t] = True
  if num_selected > 1 and c > 1:
    # Highest score first, ties to the lower index (lax.top_k's order); past blocks only.
    ranked_ktc = np.argsort(np.where(past_tc[None], -scores_ktc, np.inf), axis=-1,
                            kind="stable")[..., :num_selected - 1]
    keep_ktc = np.take_along_axis(np.broadcast_to(past_tc, scores_ktc.shape), ranked_ktc, -1)
    np.put_along_axis(blocks_ktc, ranked_ktc, keep_ktc | np.take_along_axis(
        blocks_ktc, ranked_ktc, -1), axis=-1)
  token_block = np.arange(t) // block_size
  causal_tt = np.tril(np.ones((t, t), bool))
  return blocks_ktc[:, :, token_block] & causal_tt[None]


def coverage_and_recall(q_tnh: np.ndarray, k_tkh: np.ndarray, block_size: int,
                        topk_tokens: int, probs_ntt: np.ndarray | None = None,
                        order_ntt: np.ndarray | None = None) -> tuple[float, float]:
  """(coverage, recall) of one sequence's layer at (B, k), averaged over heads and query
  positions. `probs_ntt` (dense_probs) and `order_ntt` (mass_order), when the caller
  already has them for this sequence and layer."""
  t, n, _ = q_tnh.shape
  g = n // k_tkh.shape[1]
  probs = dense_probs(q_tnh, k_tkh) if probs_ntt is None else probs_ntt
  order = mass_order(probs) if order_ntt is None else order_ntt
  sel_ntt = np.repeat(selected_tokens(q_tnh, k_tkh, block_size, topk_tokens), g, axis=0)
  coverage = float(np.mean(np.sum(probs * sel_ntt, axis=-1)))
  top = min(topk_tokens, t)
  hits_nq = np.take_along_axis(sel_ntt, order[..., :top], axis=-1).mean(-1)
  # A query that sees at most k tokens keeps them all.
  recall_nq = np.where(np.arange(t)[None, :] + 1 <= topk_tokens, 1.0, hits_nq)
  return coverage, float(recall_nq.mean())


def mass_order(probs_ntt: np.ndarray) -> np.ndarray:
  """Each query's tokens by falling dense mass (ties to the lower position); the future,
  at mass 0, comes last."""
  return np.argsort(-probs_ntt, axis=-1, kind="stable")


def indexer_cost(context: int, block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, key_bytes: int = 4) -> dict:
  """The indexer's FLOPs and bytes per query and kv head at `context` tokens (module doc)."""
  c = -(-context // block_size)
  g = num_heads // num_kv_heads
  scoring_flops = 2 * head_dim * c + head_dim * (g - 1)
  return {"scoring_flops": scoring_flops, "scoring_bytes": c * head_dim * key_bytes,
          "selection_flops": c, "selection_bytes": c * 4,
          "indexer_flops_per_query": scoring_flops + c}


def check_grid(grid: list[tuple[int, int]], context: int) -> None:
  """Raises on a grid point the indexer cannot run: k not a positive multiple of B, or B
  larger than the context."""
  for b, k in grid:
    if b <= 0 or k <= 0 or k % b:
      raise ValueError(f"grid point B={b}, k={k}: k must be a positive multiple of B.")
    if b > context:
      raise ValueError(f"grid point B={b}, k={k}: the block size is larger than the "
                       f"context ({context} tokens).")


def design_pair(context: int, design_context: int) -> tuple[tuple[int, int], tuple[int, int]]:
  """The design's (B=8, k=4096) and (B=1, k=2048) at `context`, k scaled by
  context / design_context and rounded to a multiple of B (at least one block)."""
  scale = context / design_context
  k8 = max(8, int(round(4096 * scale / 8)) * 8)
  k1 = max(1, int(round(2048 * scale)))
  return (8, k8), (1, k1)
