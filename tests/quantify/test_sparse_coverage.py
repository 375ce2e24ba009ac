"""quantify/sparse_coverage.py against a brute-force loop and the model's own selection;
the indexer's cost by hand; launch.sparse_coverage end to end (slow)."""

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.kernels import reference
from agentic_rl.quantify import coverage_report
from agentic_rl.quantify import sparse_coverage as sc
from configs import quickstart
from tests.quantify.launch_command import run_launch


def _qk(t=29, n=4, kv=2, h=8, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(t, n, h)), rng.normal(size=(t, kv, h))


def _brute_force(q, k, block, topk):
  """Loops over heads and queries: dense softmax, mean-pooled block keys, own block plus
  the best past blocks, the mass on them, and the dense top-k's recall."""
  t, n, h = q.shape
  g = n // k.shape[1]
  cov, rec = [], []
  for head in range(n):
    kv = head // g
    for i in range(t):
      s = np.array([q[i, head] @ k[j, kv] / math.sqrt(h) for j in range(i + 1)])
      p = np.exp(s - s.max())
      p /= p.sum()
      qm = np.mean([q[i, kv * g + m] for m in range(g)], axis=0)
      own = i // block
      scores = []
      for c in range(own):
        keys = [k[j, kv] for j in range(c * block, min((c + 1) * block, t))]
        scores.append((-(qm @ np.mean(keys, axis=0)) / math.sqrt(h), c))
      chosen = {own} | {c for _, c in sorted(scores)[:topk // block - 1]}
      sel = [j for j in range(i + 1) if j // block in chosen]
      cov.append(p[sel].sum())
      if i + 1 <= topk:
        rec.append(1.0)
      else:
        top = sorted(range(i + 1), key=lambda j: (-p[j], j))[:topk]
        rec.append(len(set(top) & set(sel)) / topk)
  return float(np.mean(cov)), float(np.mean(rec))


@pytest.mark.parametrize("block,topk", [(1, 4), (4, 8), (4, 12), (8, 16)])
def test_coverage_and_recall_equal_a_brute_force_loop(block, topk):
  q, k = _qk()
  cov, rec = sc.coverage_and_recall(q, k, block, topk)
  want_cov, want_rec = _brute_force(q, k, block, topk)
  assert cov == pytest.approx(want_cov, abs=1e-12) and rec == pytest.approx(want_rec, abs=1e-12)
  assert 0 < cov < 1 and 0 < rec < 1


def test_coverage_is_1_when_k_holds_the_context():
  q, k = _qk(t=20)
  for block in (1, 4):
    assert sc.coverage_and_recall(q, k, block, 20) == pytest.approx((1.0, 1.0))


def test_selection_is_the_models_own():
  t, block, topk = 37, 4, 12
  q, k = _qk(t=t, seed=3)
  sel_ktt = sc.selected_tokens(q, k, block, topk)
  c = -(-t // block)
  keys = np.zeros((1, c * block) + k.shape[1:], np.float32)
  keys[0, :t] = k
  block_keys = reference.block_means(jnp.asarray(keys), jnp.asarray([t]), block_size=block)
  blocks_ktj = np.asarray(reference.select_blocks(
      jnp.asarray(q[None], jnp.float32), block_keys, jnp.arange(t)[None], block_size=block,
      num_selected=topk // block))[0]
  for head in range(k.shape[1]):
    for i in range(t):
      picked = {int(b) for b in blocks_ktj[head, i] if b >= 0}
      assert set(np.flatnonzero(sel_ktt[head, i]) // block) == picked, (head, i)


def test_indexer_cost_by_hand():
  # 1000 tokens in blocks of 8: 125 block keys; H=16, G=2 queries per kv head.
  cost = sc.indexer_cost(1000, 8, num_heads=4, num_kv_heads=2, head_dim=16, key_bytes=2)
  assert cost == {"scoring_flops": 2 * 16 * 125 + 16, "scoring_bytes": 125 * 16 * 2,
                  "selection_flops": 125, "selection_bytes": 500,
                  "indexer_flops_per_query": 4016 + 125}
  b1 = sc.indexer_cost(1000, 1, 4, 2, 16)["indexer_flops_per_query"]
  assert b1 / cost["indexer_flops_per_query"] == pytest.approx(
      (32 * 1000 + 16 + 1000) / (32 * 125 + 16 + 125))


def test_bad_grid_points_are_refused():
  with pytest.raises(ValueError, match="k must be a positive multiple of B"):
    sc.check_grid([(8, 12)], 100)
  with pytest.raises(ValueError, match="larger than the context"):
    sc.check_grid([(128, 128)], 100)
  with pytest.raises(ValueError, match="--topk_tokens 12 is not a multiple"):
    coverage_report.parse_grid([8, 16], [12])
  assert coverage_report.parse_grid([1, 8], [4, 16]) == [(1, 4), (1, 16), (8, 16)]


def test_design_pair_scales_k_with_the_context():
  assert sc.design_pair(32768, 32768) == ((8, 4096), (1, 2048))
  assert sc.design_pair(1024, 32768) == ((8, 128), (1, 64))
  assert sc.design_pair(10, 32768) == ((8, 8), (1, 1))  # At least one block, one token.


def test_plot_has_a_line_per_block_size(tmp_path):
  rows = [{"block_size": b, "topk_tokens": k, "coverage": 0.5} for b in (1, 8)
          for k in (16, 32)]
  fig = coverage_report.write_plot({"rows": rows}, str(tmp_path / "c.png"))
  assert len(fig.axes[0].lines) == 2
  assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # ~1 min: samples two task groups, then the float64 reference.
def test_sparse_coverage_on_the_shipped_base(tmp_path):
  out = str(tmp_path / "cov")
  run = run_launch(
      "sparse_coverage", "--config", "tests/train/tiny_config_file.py",
      "--checkpoint", quickstart.BASE, "--workdir", out, "--block_sizes", "1,8",
      "--topk_tokens", "16,64,4096", "--num_trajectories", "2", "--json", timeout=1200)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(run.stdout.strip().splitlines()[-1])
  rows = {(r["block_size"], r["topk_tokens"]): r for r in result["rows"]}
  assert set(rows) == {(1, 16), (1, 64), (1, 4096), (8, 16), (8, 64), (8, 4096)}
  for b in (1, 8):
    assert rows[(b, 16)]["coverage"] < rows[(b, 64)]["coverage"] < 1.0
    assert rows[(b, 4096)]["coverage"] == pytest.approx(1.0)  # k holds the context.
  # Finer blocks cover more at the same budget, and cost more to index.
  assert rows[(1, 64)]["coverage"] > rows[(8, 64)]["coverage"]
  assert rows[(1, 64)]["indexer_flops_per_query"] > 7 * rows[(8, 64)]["indexer_flops_per_query"]
  pair = result["seed_pair"]
  assert pair["context"] > 0 and 7 < pair["indexer_cost_ratio"] < 8.5
  report = json.load(open(os.path.join(out, "coverage.json")))
  assert report["layer_types"] == "G"  # The base's one sparse layer (SSSG).
  assert (open(os.path.join(out, "coverage.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize("flags,error", [
    (["--block_sizes", "2048", "--topk_tokens", "2048"], "larger than the context"),
    (["--block_sizes", "8", "--topk_tokens", "12"], "not a multiple of any"),
])
def test_the_command_refuses_a_bad_grid_before_any_work(tmp_path, flags, error):
  out = run_launch("sparse_coverage", "--checkpoint", "/nonexistent",
                   "--workdir", str(tmp_path), *flags)
  assert out.returncode != 0 and error in out.stderr
  assert not os.listdir(tmp_path)  # Nothing sampled, nothing written.
