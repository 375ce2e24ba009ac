"""Uncached S (sliding-window) layers with positions that do not start at 0.

The uncached S path lays tokens out in a buffer of T slots; it used to index that
buffer by position, so a row whose positions did not start at 0 (a window of a longer
sequence, positions with gaps) lost every token at position >= T: those queries came
back wrong (zero attention output) and their keys vanished for the others.

Layer level: against a float64 numpy sliding-window attention on the same projections
(atol = rtol = 2e-5; outputs are O(1)). Model level: an S/F-only model depends on
positions only through differences (RoPE, window, causality), so shifting every
position by a constant leaves the logits unchanged up to float32 RoPE rounding at the
larger angles (atol 1e-4; logits rms ~6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model.attention import Attention
from agentic_rl.model.transformer import Model
from tests.kernels import numpy_attention as npa
from tests.model.model_fixtures import draw_like, draw_params, make_spec

SPEC = make_spec("S", 1)  # W = 8
T = 20
X = jnp.asarray(np.random.default_rng(0).standard_normal((3, T, SPEC.d_model)), jnp.float32)


def positions():
  pos = np.full((3, T), -1, np.int32)
  pos[0] = 13 + np.arange(T)  # a window of a longer sequence: 13..32
  pos[1, :14] = 5 + np.arange(14)  # 5..18, then padding
  # Gaps wider than the window, shuffled, padding in between.
  gaps = np.array([2, 3, 4, 17, 18, 19, 20, 21, 40, 41, 60, 61, 62, 63, 64, 65])
  order = np.random.default_rng(1).permutation(T)
  pos[2, order[:len(gaps)]] = gaps
  return pos


def reference_s_layer(params, x, pos):
  """float64 gated sliding-window attention layer (numpy, positions decide visibility)."""
  x = np.asarray(x, np.float64)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  q = npa.rope(np.einsum("btd,dnh->btnh", x, p["w_q_dnh"]), pos, SPEC.rope_theta)
  k = npa.rope(np.einsum("btd,dkh->btkh", x, p["w_k_dkh"]), pos, SPEC.rope_theta)
  v = np.einsum("btd,dkh->btkh", x, p["w_v_dkh"])
  o = npa.attention(q, k, v, npa.visibility(pos, pos, window=SPEC.sliding_window))
  gate = np.einsum("btd,dn->btn", x, p["w_gate_dn"]) + p["b_gate_n"]
  o = o / (1.0 + np.exp(-gate))[..., None]
  return np.einsum("btnh,nhd->btd", o, p["w_o_nhd"])


def test_uncached_s_layer_matches_float64_with_positions_not_starting_at_zero():
  module = Attention(SPEC, "S")
  pos = positions()
  shapes = jax.eval_shape(module.init, jax.random.key(0), X, jnp.asarray(pos))["params"]
  params = draw_like(shapes, seed=4)
  y, _, _ = jax.jit(lambda p, x, q: module.apply({"params": p}, x, q))(params, X,
                                                                        jnp.asarray(pos))
  want = reference_s_layer(params, X, pos)
  np.testing.assert_allclose(np.asarray(y), want, atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(np.asarray(y)[pos < 0], 0.0)  # padding outputs 0


@pytest.mark.parametrize("pattern", ["S", "SF"])
@pytest.mark.parametrize("shift", [5, 13, 200])
def test_uncached_logits_do_not_depend_on_where_positions_start(pattern, shift):
  spec = make_spec(pattern, 2, num_dense_layers=1)
  model = Model(spec)
  params = draw_params(model, seed=6)
  toks = np.random.default_rng(2).integers(0, 64, (2, T)).astype(np.int32)
  pos = np.stack([np.arange(T), np.where(np.arange(T) < 15, np.arange(T), -1)]).astype(np.int32)
  want, _, _ = model.forward(params, toks, pos)
  got, _, _ = model.forward(params, toks, np.where(pos >= 0, pos + shift, -1))
  valid = pos >= 0
  np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-4,
                             rtol=0)
