"""The one forward: its output contract, causality of its gradient, numerical gradients,
routing replay at model level, and jit vs eager.

Model: "SGF" (dense FFN, then two MoE layers with a routing bias), untied embeddings so
the gradient w.r.t. an input embedding row is not mixed with the unembedding.
Tolerances: replayed logits vs recorded atol 1e-6; jit vs eager atol 1e-5 (logits rms ~6);
central differences (float32 forward, float64 loss sum) within 2% of the analytic
directional derivative plus 1e-3 of its scale; gradients that must vanish are exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model.transformer import Model, replay_from_aux
from tests.model.model_fixtures import (check_block_causality, draw_params, make_spec,
                                        padded_positions)

SPEC = make_spec("SGF", 3, num_dense_layers=1, tie_embeddings=False,
                 **{"moe.use_routing_bias": True})
MODEL = Model(SPEC)
T = 32
LENGTHS = [32, 19]
POS = jnp.asarray(padded_positions(LENGTHS, T))
VALID = np.asarray(POS) >= 0
# Row 0 holds 32 distinct tokens, so each embedding row belongs to exactly one position.
TOKENS = jnp.asarray(np.stack([np.random.default_rng(0).permutation(SPEC.vocab_size)[:T],
                               np.random.default_rng(1).integers(0, SPEC.vocab_size, T)]),
                     jnp.int32)
PARAMS = draw_params(MODEL, seed=21)

fwd = jax.jit(MODEL.forward)


def _contracted(params, ct_btv, replay):
  logits, _, _ = MODEL.forward(params, TOKENS, POS, replay=replay)
  return jnp.sum(logits * ct_btv)


grad_fn = jax.jit(jax.grad(_contracted))  # grad of <logits, ct> w.r.t. params


@pytest.fixture(scope="module")
def recorded():
  logits, cache, aux = fwd(PARAMS, TOKENS, POS)
  return np.asarray(logits), cache, aux


def test_forward_contract(recorded):
  logits, cache, aux = recorded
  assert logits.shape == (2, T, SPEC.vocab_size) and logits.dtype == np.float32
  assert cache is None
  assert len(aux["layers"]) == SPEC.num_layers
  assert "experts" not in aux["layers"][0]  # layer 0 is dense
  for i in (1, 2):
    assert aux["layers"][i]["experts"].shape == (2, T, SPEC.moe.num_experts_per_token)
  assert aux["layers"][1]["blocks"].shape == (2, SPEC.num_kv_heads, T,
                                              SPEC.num_selected_blocks)
  assert check_block_causality(SPEC, aux, POS) == 1
  assert aux["moe_aux_loss"].shape == () and np.isfinite(aux["moe_aux_loss"])
  assert np.all(np.isfinite(logits))


@pytest.mark.parametrize("t", [0, 3, 8, 13, 31])
def test_logits_get_exactly_zero_gradient_from_later_tokens(t):
  ct = np.zeros((2, T, SPEC.vocab_size), np.float32)
  ct[0, t] = np.random.default_rng(t).standard_normal(SPEC.vocab_size)
  grads = grad_fn(PARAMS, jnp.asarray(ct), None)
  row_grad = np.abs(np.asarray(grads["embed"]["embedding"])).sum(-1)  # [V]
  tokens = np.asarray(TOKENS[0])
  assert np.all(row_grad[tokens[t + 1:]] == 0.0), "a later token influences logits at t"
  assert np.all(row_grad[tokens[:t + 1]] > 0.0), "an earlier token has no influence at t"


def _leaf(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _with_leaf(tree, path, value):
  if not path:
    return value
  out = dict(tree)
  out[path[0]] = _with_leaf(tree[path[0]], path[1:], value)
  return out


GRAD_CHECKED = [
    ("embed", "embedding"),
    ("layer_0", "attn", "w_q_dnh"),       # S
    ("layer_0", "attn", "w_gate_dn"),     # S output gate
    ("layer_0", "attn", "b_gate_n"),
    ("layer_0", "ffn", "w_up_df"),        # dense FFN
    ("layer_1", "attn", "w_k_dkh"),       # G
    ("layer_1", "attn", "w_o_nhd"),
    ("layer_1", "moe", "w_router_de"),    # router: gates get gradient under replay
    ("layer_1", "moe", "w_gate_edf"),     # routed experts
    ("layer_2", "attn", "w_v_dkh"),       # F
    ("layer_2", "moe", "shared_experts", "w_down_fd"),
    ("layer_2", "attn_norm", "scale"),
    ("final_norm", "scale"),
    ("unembed", "kernel"),
]


def test_gradients_match_central_differences(recorded):
  """With routing and block selection replayed, the forward is smooth in the params, so
  central differences are valid; checked along a random direction in each param."""
  _, _, aux = recorded
  replay = replay_from_aux(aux)
  rng = np.random.default_rng(3)
  ct = np.where(VALID[..., None], rng.standard_normal((2, T, SPEC.vocab_size)), 0.0)
  grads = grad_fn(PARAMS, jnp.asarray(ct, jnp.float32), replay)

  def loss(params):  # float64 contraction of the float32 logits: less round-off
    logits, _, _ = fwd(params, TOKENS, POS, replay=replay)
    return float(np.sum(np.asarray(logits, np.float64) * ct))

  for path in GRAD_CHECKED:
    w = _leaf(PARAMS, path)
    direction = rng.standard_normal(w.shape)
    direction /= np.linalg.norm(direction)
    analytic = float(np.sum(np.asarray(_leaf(grads, path), np.float64) * direction))
    eps = 1e-2 * max(1.0, float(np.sqrt(np.mean(np.asarray(w) ** 2))) * np.sqrt(w.size))
    plus = loss(_with_leaf(PARAMS, path, w + jnp.asarray(eps * direction, w.dtype)))
    minus = loss(_with_leaf(PARAMS, path, w - jnp.asarray(eps * direction, w.dtype)))
    numeric = (plus - minus) / (2 * eps)
    scale = float(np.linalg.norm(np.asarray(_leaf(grads, path))))
    assert abs(numeric - analytic) <= 2e-2 * abs(analytic) + 1e-3 * scale, (
        path, numeric, analytic, scale)


def test_replayed_gradient_equals_the_free_gradient(recorded):
  """Top-k choices carry no gradient, so forcing the recorded choices leaves the gradient
  unchanged, router included (the router keeps learning under routing replay)."""
  _, _, aux = recorded
  ct = jnp.asarray(np.where(VALID[..., None], np.random.default_rng(4).standard_normal(
      (2, T, SPEC.vocab_size)), 0.0), jnp.float32)
  free = grad_fn(PARAMS, ct, None)
  forced = grad_fn(PARAMS, ct, replay_from_aux(aux))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(free), jax.tree.leaves(forced)):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(np.max(np.abs(a)) + 1e-30), rtol=0,
                               err_msg=jax.tree_util.keystr(path))
  assert np.any(np.asarray(free["layer_1"]["moe"]["w_router_de"]) != 0.0)
  assert np.all(np.asarray(free["layer_1"]["moe"]["routing_bias_e"]) == 0.0)


def _set_moe(params, name, value_fn):
  out = dict(params)
  for layer in ("layer_1", "layer_2"):
    moe = dict(params[layer]["moe"])
    moe[name] = value_fn(moe[name])
    out[layer] = dict(params[layer], moe=moe)
  return out


def _experts(aux, i):
  return np.asarray(aux["layers"][i]["experts"])[VALID]


def test_routing_replay_survives_a_routing_bias_change(recorded):
  """The routing bias moves only the selection, never the gates: with the recorded experts
  forced, a very different bias must give back the recorded logits."""
  logits, _, aux = recorded
  biased = _set_moe(PARAMS, "routing_bias_e",
                    lambda b: jnp.asarray([5.0, 0.0, 0.0, -5.0], b.dtype))
  _, _, free_aux = fwd(biased, TOKENS, POS)
  assert np.all(_experts(free_aux, 1) != 3), "the bias should steer the free routing"
  replayed, _, forced_aux = fwd(biased, TOKENS, POS, replay=replay_from_aux(aux))
  for i in (1, 2):
    np.testing.assert_array_equal(_experts(forced_aux, i), _experts(aux, i))
  np.testing.assert_allclose(np.asarray(replayed)[VALID], logits[VALID], atol=1e-6, rtol=0)


def test_routing_replay_forces_recorded_experts_under_perturbed_router(recorded):
  logits, _, aux = recorded
  rng = np.random.default_rng(5)
  perturbed = _set_moe(PARAMS, "w_router_de", lambda w: w + jnp.asarray(
      0.5 * rng.standard_normal(w.shape) / np.sqrt(w.shape[0]), w.dtype))
  free_logits, _, free_aux = fwd(perturbed, TOKENS, POS)
  assert any(np.any(np.sort(_experts(free_aux, i), -1) != np.sort(_experts(aux, i), -1))
             for i in (1, 2)), "the perturbation should change the free routing"
  replayed, _, forced_aux = fwd(perturbed, TOKENS, POS, replay=replay_from_aux(aux))
  for i in (1, 2):
    np.testing.assert_array_equal(_experts(forced_aux, i), _experts(aux, i))
  replayed = np.asarray(replayed)[VALID]
  # Gates come from the perturbed router, so logits move, but less than when the routes
  # change as well.
  assert np.all(np.isfinite(replayed))
  moved_replayed = np.max(np.abs(replayed - logits[VALID]))
  moved_free = np.max(np.abs(np.asarray(free_logits)[VALID] - logits[VALID]))
  assert 0.0 < moved_replayed < moved_free, (moved_replayed, moved_free)


# --- jit vs eager -------------------------------------------------------------------

@pytest.mark.slow  # Eager op-by-op dispatch of the whole model: 20-60 s on 2 CPU cores.
def test_jit_equals_eager_for_forward_and_a_cached_decode_step(recorded):
  logits, _, _ = recorded
  eager_logits, _, _ = MODEL.forward(PARAMS, TOKENS, POS)
  np.testing.assert_allclose(np.asarray(eager_logits)[VALID], logits[VALID], atol=1e-5,
                             rtol=0)
  # A decode step from a cache holding a 12-token prefix (row 1 sits out).
  cache = MODEL.init_cache(2, SPEC.max_seq_len)
  _, cache, _ = fwd(PARAMS, TOKENS[:, :12], POS[:, :12], cache)
  tok = TOKENS[:, 12:13]
  pos = jnp.asarray([[12], [-1]], jnp.int32)
  jit_logits, jit_cache, _ = fwd(PARAMS, tok, pos, cache)
  eager_logits, eager_cache, _ = MODEL.forward(PARAMS, tok, pos, cache)
  np.testing.assert_allclose(eager_logits[0], jit_logits[0], atol=1e-5, rtol=0)
  np.testing.assert_allclose(jit_logits[0, 0], logits[0, 12], atol=1e-4, rtol=0)
  for a, b in zip(jax.tree.leaves(eager_cache), jax.tree.leaves(jit_cache)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
