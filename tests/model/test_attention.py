"""The S, G and F attention layers: float64 references, reduction to dense, causality and
sparsity of the dependency structure, and selection replay.

Tolerances (fp32 vs float64 or vs another fp32 path): layer outputs atol = rtol = 2e-5
(outputs are O(1)); model logits (rms ~6) atol 1e-5; replay reproduces recorded logits
to 1e-6. Dependency checks are exact: a gradient that should vanish must be exactly 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model.attention import Attention
from agentic_rl.model.transformer import Model, replay_from_aux
from tests.kernels import numpy_attention as npa
from tests.model.model_fixtures import (check_block_causality, draw_like, draw_params,
                                        make_spec, padded_positions)

LAYER_TOL = dict(atol=2e-5, rtol=2e-5)
SPEC = make_spec("SGF", 3)  # only its attention fields matter for single layers
T = 20  # 5 blocks of 4; the window (8) and the selection (2 blocks) are both strict
X = jnp.asarray(np.random.default_rng(0).standard_normal((2, T, SPEC.d_model)), jnp.float32)
POS = jnp.asarray(padded_positions([T, 14], T))  # row 1 is padded after 14 tokens


class Layer:
  """One Attention module of a given type, numpy-drawn params, jitted apply."""

  def __init__(self, layer_type: str, seed: int):
    self.layer_type = layer_type
    self.module = Attention(SPEC, layer_type)
    shapes = jax.eval_shape(self.module.init, jax.random.key(0), X, POS)["params"]
    self.params = draw_like(shapes, seed)
    self.apply = jax.jit(self._apply)

  def _apply(self, params, x, positions, forced_blocks=None):
    return self.module.apply({"params": params}, x, positions, None, None, forced_blocks)


@functools.lru_cache(maxsize=None)
def layer(layer_type: str) -> Layer:
  return Layer(layer_type, seed={"S": 1, "G": 2, "F": 3}[layer_type])


def project(params, x, positions):
  """float64 q (roped), k (roped), v of one attention layer."""
  x = np.asarray(x, np.float64)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  q = npa.rope(np.einsum("btd,dnh->btnh", x, p["w_q_dnh"]), positions, SPEC.rope_theta)
  k = npa.rope(np.einsum("btd,dkh->btkh", x, p["w_k_dkh"]), positions, SPEC.rope_theta)
  v = np.einsum("btd,dkh->btkh", x, p["w_v_dkh"])
  return q, k, v


def reference_layer(layer_type, params, x, positions, blocks=None):
  """float64 layer output; for G, attention over the given blocks' tokens."""
  q, k, v = project(params, x, positions)
  positions = np.asarray(positions)
  if layer_type == "F":
    mask = npa.visibility(positions, positions)
  elif layer_type == "S":
    mask = npa.visibility(positions, positions, window=SPEC.sliding_window)
  else:
    mask = npa.blocks_token_mask(blocks, positions, x.shape[1], SPEC.block_size)
  o = npa.attention(q, k, v, mask)
  if layer_type == "S":
    gate = np.einsum("btd,dn->btn", np.asarray(x, np.float64),
                     np.asarray(params["w_gate_dn"], np.float64))
    o = o / (1.0 + np.exp(-(gate + np.asarray(params["b_gate_n"], np.float64))))[..., None]
  return np.einsum("btnh,nhd->btd", o, np.asarray(params["w_o_nhd"], np.float64))


def reference_selection_scores(params, x, positions):
  """float64 indexer scores [B, K, T, N] from block means of the (position-indexed) keys."""
  q, k, _ = project(params, x, positions)
  lengths = (np.asarray(positions).max(axis=1) + 1)
  return npa.raw_block_scores(q, npa.block_means(k, lengths, SPEC.block_size))


@pytest.mark.parametrize("layer_type", ["S", "G", "F"])
def test_layer_matches_float64_reference(layer_type):
  lay = layer(layer_type)
  y, new_cache, aux = lay.apply(lay.params, X, POS)
  assert new_cache is None
  blocks = None
  if layer_type == "G":
    blocks = np.asarray(aux["blocks"])
    npa.check_topk_selection(blocks, reference_selection_scores(lay.params, X, POS), POS,
                             SPEC.block_size, SPEC.num_selected_blocks)
  else:
    assert "blocks" not in aux
  want = reference_layer(layer_type, lay.params, X, POS, blocks)
  np.testing.assert_allclose(y, want, **LAYER_TOL)
  np.testing.assert_array_equal(np.asarray(y)[1, 14:], 0.0)  # padding queries output 0


@pytest.mark.parametrize("layer_type", ["S", "G", "F"])
def test_layer_output_depends_exactly_on_the_tokens_it_may_see(layer_type):
  """Jacobian sparsity of y_t w.r.t. x_s: exactly zero for every future s (causality), and
  for S outside the window, for G outside the selected blocks; nonzero on every visible
  (t, s) pair, so the mask is neither too loose nor too tight."""
  lay = layer(layer_type)
  x1, pos1 = X[:1], POS[:1]
  jac = jax.jit(jax.jacrev(lambda x: lay.apply(lay.params, x, pos1)[0]))(x1)
  depends_ts = np.any(np.asarray(jac)[0, :, :, 0] != 0.0, axis=(1, 3))  # [T, T]
  t_idx, s_idx = np.arange(T)[:, None], np.arange(T)[None, :]
  if layer_type == "F":
    want = s_idx <= t_idx
  elif layer_type == "S":
    want = (s_idx <= t_idx) & (t_idx - s_idx < SPEC.sliding_window)
  else:
    blocks = np.asarray(lay.apply(lay.params, x1, pos1)[2]["blocks"])
    # Every query head reads its group's blocks; the output mixes all heads.
    want = npa.blocks_token_mask(blocks, np.asarray(pos1), T, SPEC.block_size)[0].any(0)
    assert not np.all(want[s_idx <= t_idx]), "selection should be strictly sparse here"
  np.testing.assert_array_equal(depends_ts, want)


def test_selection_replay_forces_recorded_blocks_under_perturbed_weights():
  """The learner's weights differ from the sampler's: forced blocks are used exactly, and
  the output is attention with the perturbed weights over the recorded blocks."""
  lay = layer("G")
  _, _, aux = lay.apply(lay.params, X, POS)
  recorded = aux["blocks"]
  rng = np.random.default_rng(7)
  perturbed = dict(lay.params)
  for name in ("w_q_dnh", "w_k_dkh"):
    w = lay.params[name]
    perturbed[name] = w + jnp.asarray(0.5 * rng.standard_normal(w.shape) / np.sqrt(w.shape[0]),
                                      jnp.float32)
  _, _, free_aux = lay.apply(perturbed, X, POS)
  assert np.any(np.sort(free_aux["blocks"], -1) != np.sort(recorded, -1)), (
      "the perturbation should change the free selection, or the test proves nothing")
  y, _, forced_aux = lay.apply(perturbed, X, POS, recorded)
  np.testing.assert_array_equal(forced_aux["blocks"], recorded)
  want = reference_layer("G", perturbed, X, POS, np.asarray(recorded))
  np.testing.assert_allclose(y, want, **LAYER_TOL)


# --- Sparse layers reduce to dense ones (model level, same params) ----------------------

DENSE_FFN = {"moe.num_experts": 0}  # no router: a 1e-7 change must not flip an expert
F_SPEC = make_spec("F", 2, **DENSE_FFN)
G_WIDE_SPEC = make_spec("G", 2, topk_tokens=40, **DENSE_FFN)  # k = 40 = the whole context
S_WIDE_SPEC = make_spec("S", 2, sliding_window=40, **DENSE_FFN)  # W = 40 = the whole context
WIDE_LEN = 40
WIDE_POS = jnp.asarray(padded_positions([40, 23], WIDE_LEN))
WIDE_TOKENS = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, WIDE_LEN)), jnp.int32)


@functools.lru_cache(maxsize=None)
def jitted_forward(spec):
  return jax.jit(Model(spec).forward)


def valid_logits(spec, params):
  logits, _, aux = jitted_forward(spec)(params, WIDE_TOKENS, WIDE_POS)
  return np.asarray(logits)[np.asarray(WIDE_POS) >= 0], aux


def shapes_of(spec):
  return jax.tree.map(lambda s: (s.shape, s.dtype), Model(spec).param_shapes())


def test_layer_types_share_one_attention_param_tree():
  """G and F have identical params; S adds only its output gate (w_gate_dn, b_gate_n)."""
  f, g, s = shapes_of(F_SPEC), shapes_of(G_WIDE_SPEC), shapes_of(S_WIDE_SPEC)
  assert g == f
  for i in range(2):
    s_attn, f_attn = s[f"layer_{i}"]["attn"], f[f"layer_{i}"]["attn"]
    assert set(s_attn) - set(f_attn) == {"w_gate_dn", "b_gate_n"}
    assert {k: v for k, v in s_attn.items() if k in f_attn} == f_attn
    assert {k: v for k, v in s[f"layer_{i}"].items() if k != "attn"} == {
        k: v for k, v in f[f"layer_{i}"].items() if k != "attn"}
  assert set(s) == set(f)


def test_sparse_attention_with_k_at_least_the_context_equals_dense():
  params = draw_params(Model(G_WIDE_SPEC), seed=11)
  g_logits, aux = valid_logits(G_WIDE_SPEC, params)
  f_logits, _ = valid_logits(F_SPEC, params)
  assert check_block_causality(G_WIDE_SPEC, aux, WIDE_POS) == 2
  np.testing.assert_allclose(g_logits, f_logits, atol=1e-5, rtol=0)


def test_sliding_window_at_least_the_context_with_an_open_gate_equals_dense():
  """The S gate is sigmoid(x w + b), never exactly 1 in exact arithmetic. With w = 0 and
  b = 30 it is 1 - 9e-14, which float32 rounds to exactly 1.0 (asserted below), so the S
  layer computes exactly window-attention * 1: with W >= T that must be F. With the
  drawn (nonzero) gate the two must differ, so the comparison is not vacuous."""
  params = draw_params(Model(S_WIDE_SPEC), seed=12)
  assert float(jax.nn.sigmoid(jnp.float32(30.0))) == 1.0
  open_gate = jax.tree.map(lambda x: x, params)
  dense = jax.tree.map(lambda x: x, params)
  for i in range(2):
    attn = dict(params[f"layer_{i}"]["attn"])
    attn["w_gate_dn"] = jnp.zeros_like(attn["w_gate_dn"])
    attn["b_gate_n"] = jnp.full_like(attn["b_gate_n"], 30.0)
    open_gate[f"layer_{i}"] = dict(params[f"layer_{i}"], attn=attn)
    plain = {k: v for k, v in attn.items() if k not in ("w_gate_dn", "b_gate_n")}
    dense[f"layer_{i}"] = dict(params[f"layer_{i}"], attn=plain)
  s_logits, _ = valid_logits(S_WIDE_SPEC, open_gate)
  f_logits, _ = valid_logits(F_SPEC, dense)
  np.testing.assert_allclose(s_logits, f_logits, atol=1e-5, rtol=0)
  gated_logits, _ = valid_logits(S_WIDE_SPEC, params)
  assert np.max(np.abs(gated_logits - f_logits)) > 1e-2


# --- Selection replay and block causality at model level --------------------------------

HYBRID_SPEC = make_spec("GSG", 3, num_dense_layers=1)  # two G layers, MoE after layer 0


def perturb_attention(params, layer_names, scale, seed):
  rng = np.random.default_rng(seed)
  out = dict(params)
  for name in layer_names:
    attn = dict(params[name]["attn"])
    for w_name in ("w_q_dnh", "w_k_dkh"):
      w = attn[w_name]
      attn[w_name] = w + jnp.asarray(scale * rng.standard_normal(w.shape) / np.sqrt(
          w.shape[0]), w.dtype)
    out[name] = dict(params[name], attn=attn)
  return out


def test_model_selection_replay_reproduces_and_survives_perturbation():
  spec = HYBRID_SPEC
  model = Model(spec)
  fwd = jitted_forward(spec)
  params = draw_params(model, seed=13)
  logits, _, aux = fwd(params, WIDE_TOKENS, WIDE_POS)
  assert check_block_causality(spec, aux, WIDE_POS) == 2
  replay = replay_from_aux(aux)
  assert [sorted(e) for e in replay] == [["blocks"], ["experts"], ["blocks", "experts"]]
  # Same weights, forced choices: the recorded forward, to float32 round-off.
  replayed, _, replayed_aux = fwd(params, WIDE_TOKENS, WIDE_POS, replay=replay)
  valid = np.asarray(WIDE_POS) >= 0  # padding logits are unspecified
  np.testing.assert_allclose(np.asarray(replayed)[valid], np.asarray(logits)[valid], atol=1e-6,
                             rtol=0)
  # Perturbed attention weights: the free forward selects other blocks, the replayed one
  # attends exactly where the recorded forward did.
  perturbed = perturb_attention(params, ["layer_0", "layer_2"], 0.5, seed=14)
  _, _, free_aux = fwd(perturbed, WIDE_TOKENS, WIDE_POS)
  _, _, forced_aux = fwd(perturbed, WIDE_TOKENS, WIDE_POS, replay=replay)
  changed = False
  for i in (0, 2):
    recorded = np.asarray(aux["layers"][i]["blocks"])
    np.testing.assert_array_equal(forced_aux["layers"][i]["blocks"], recorded)
    np.testing.assert_array_equal(replayed_aux["layers"][i]["blocks"], recorded)
    changed |= bool(np.any(np.sort(free_aux["layers"][i]["blocks"], -1) != np.sort(recorded,
                                                                                     -1)))
  assert changed, "the perturbation should change the free selection"
  check_block_causality(spec, free_aux, WIDE_POS)


def test_replay_with_the_wrong_number_of_layers_is_rejected():
  model = Model(HYBRID_SPEC)
  with pytest.raises(ValueError, match=r"replay has 2 layer entries; the model has 3"):
    model.forward(None, WIDE_TOKENS, WIDE_POS, replay=({}, {}))
