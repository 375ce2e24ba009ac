"""MoE feed-forward against an independent numpy float64 loop over experts.

Tolerances (fp32 model vs float64 reference): outputs atol 1e-5, gates/aux atol 1e-6.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model.config import default_model_config, validate
from agentic_rl.model.feedforward import DenseFeedForward
from agentic_rl.model.moe import MoEFeedForward, update_routing_bias

B, T, D = 2, 5, 16
E, K, F = 8, 2, 12


def make_spec(**moe_overrides):
  c = default_model_config()
  c.d_model = D
  c.moe.num_experts = E
  c.moe.num_experts_per_token = K
  c.moe.d_ff_expert = F
  c.moe.num_shared_experts = 0
  for name, value in moe_overrides.items():
    if name in ("dtype", "param_dtype"):
      c[name] = value
    else:
      c.moe[name] = value
  return validate(c)


def init_moe(spec, seed=0, b=B, t=T):
  """Module, params, x, valid. Params are drawn in numpy from the module's own param
  shapes (std 1/sqrt(fan_in), zero bias): compiling flax's init costs seconds on CPU,
  and the init itself is checked once in test_param_tree_layout."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, t, spec.d_model)), jnp.float32)
  valid = jnp.ones((b, t), bool)
  module = MoEFeedForward(spec)
  shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), x, valid)

  def draw(path, leaf):
    if jax.tree_util.keystr(path).endswith("['routing_bias_e']"):
      return jnp.zeros(leaf.shape, leaf.dtype)
    w = rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[-2])
    return jnp.asarray(w, leaf.dtype)

  return module, jax.tree_util.tree_map_with_path(draw, shapes), x, valid


# ---------------------------------------------------------------- numpy reference


def np_silu(z):
  return z / (1.0 + np.exp(-z))


def np_swiglu(x_nd, w_gate_df, w_up_df, w_down_fd):
  return (np_silu(x_nd @ w_gate_df) * (x_nd @ w_up_df)) @ w_down_fd


def np_scores(x_btd, w_router_de, gate):
  logits = np.asarray(x_btd, np.float64) @ np.asarray(w_router_de, np.float64)
  if gate == "softmax":
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)
  return 1.0 / (1.0 + np.exp(-logits))


def np_topk(sel_bte, k):
  return np.argsort(-sel_bte, axis=-1, kind="stable")[..., :k]


def np_moe(p, x_btd, spec, forced=None, bias=None):
  """Naive MoE: per expert, run its SwiGLU on exactly the tokens routed to it."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(x_btd, np.float64)
  b, t, d = x.shape
  scores = np_scores(x, p["w_router_de"], spec.moe.gate)
  if forced is None:
    sel = scores if bias is None else scores + np.asarray(bias, np.float64)
    experts = np_topk(sel, spec.moe.num_experts_per_token)
  else:
    experts = np.asarray(forced)
  gates = np.take_along_axis(scores, experts, axis=-1)
  if spec.moe.renormalize:
    gates = gates / gates.sum(-1, keepdims=True)
  x_nd = x.reshape(-1, d)
  experts_nk = experts.reshape(b * t, -1)
  gates_nk = gates.reshape(b * t, -1)
  y = np.zeros_like(x_nd)
  for e in range(spec.moe.num_experts):
    tok, slot = np.nonzero(experts_nk == e)
    if tok.size == 0:
      continue
    out = np_swiglu(x_nd[tok], p["w_gate_edf"][e], p["w_up_edf"][e], p["w_down_efd"][e])
    np.add.at(y, tok, gates_nk[tok, slot][:, None] * out)
  if spec.moe.num_shared_experts:
    sp = p["shared_experts"]
    y = y + np_swiglu(x_nd, sp["w_gate_df"], sp["w_up_df"], sp["w_down_fd"])
  return y.reshape(b, t, d), experts, gates


def np_load_and_aux(scores_bte, experts_btp, valid_bt, gate, coef):
  num_e = scores_bte.shape[-1]
  v = np.asarray(valid_bt, bool)
  ex = np.asarray(experts_btp)[v]  # [n_valid, P]
  load = np.array([(ex == e).sum() for e in range(num_e)], np.float64) / ex.size
  probs = np.asarray(scores_bte, np.float64)[v]
  if gate == "sigmoid":
    probs = probs / probs.sum(-1, keepdims=True)
  return load, coef * num_e * np.sum(load * probs.mean(0))


# ---------------------------------------------------------------- dense FFN


def test_dense_feedforward_matches_numpy():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((2, 3, D)), jnp.float32)
  ffn = DenseFeedForward(d_ff=24)
  shapes = jax.eval_shape(ffn.init, jax.random.PRNGKey(0), x)["params"]
  assert {k: v.shape for k, v in shapes.items()} == {
      "w_gate_df": (D, 24), "w_up_df": (D, 24), "w_down_fd": (24, D)}
  p = {k: jnp.asarray(rng.standard_normal(v.shape) / np.sqrt(v.shape[0]), jnp.float32)
       for k, v in shapes.items()}
  params = {"params": p}
  want = np_swiglu(np.asarray(x, np.float64).reshape(-1, D),
                   *(np.asarray(p[n], np.float64) for n in ("w_gate_df", "w_up_df", "w_down_fd")))
  got = ffn.apply(params, x)
  np.testing.assert_allclose(np.asarray(got).reshape(-1, D), want, atol=1e-5)


# ---------------------------------------------------------------- dispatch


MATMULS = ["ragged_dot", "grouped"]  # moe.expert_matmul; A = 20 rows, bound 8 per expert.


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("gate,renormalize,shared", [
    ("softmax", True, 0), ("softmax", False, 1), ("sigmoid", True, 2), ("sigmoid", False, 0)])
def test_dispatch_matches_naive_loop(gate, renormalize, shared, matmul):
  spec = make_spec(gate=gate, renormalize=renormalize, num_shared_experts=shared,
                   expert_matmul=matmul)
  module, params, x, valid = init_moe(spec, seed=3)
  assert ("shared_experts" in params["params"]) == (shared > 0)
  y, aux = module.apply(params, x, valid)
  want_y, want_experts, want_gates = np_moe(params["params"], x, spec)
  np.testing.assert_array_equal(np.asarray(aux["experts"]), want_experts)
  np.testing.assert_allclose(np.asarray(aux["gates"]), want_gates, atol=1e-6)
  np.testing.assert_allclose(np.asarray(y), want_y, atol=1e-5)
  assert aux["experts"].dtype == jnp.int32 and aux["gates"].dtype == jnp.float32
  if renormalize:
    np.testing.assert_allclose(np.asarray(aux["gates"]).sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_dispatch_with_idle_experts(gate, matmul):
  """Experts 0, 2-4, 6, 7 get no tokens: leading, middle and trailing empty groups (10 rows
  each: past the grouped bound of 8, so the grouped path falls back to ragged_dot)."""
  spec = make_spec(gate=gate, num_shared_experts=1, expert_matmul=matmul)
  module, params, x, valid = init_moe(spec, seed=4)
  rng = np.random.default_rng(0)
  forced = np.stack([rng.permutation([1, 5]) for _ in range(B * T)]).reshape(B, T, K)
  y, aux = module.apply(params, x, valid, jnp.asarray(forced, jnp.int32))
  want_y, _, want_gates = np_moe(params["params"], x, spec, forced=forced)
  np.testing.assert_array_equal(np.asarray(aux["experts"]), forced)
  np.testing.assert_allclose(np.asarray(aux["gates"]), want_gates, atol=1e-6)
  np.testing.assert_allclose(np.asarray(y), want_y, atol=1e-5)
  load = np.asarray(aux["expert_load"])
  np.testing.assert_allclose(load, [0, .5, 0, 0, 0, .5, 0, 0], atol=1e-7)


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("only_expert", [0, 3, E - 1])
def test_dispatch_all_assignments_to_one_expert(only_expert, matmul):
  spec = make_spec(num_experts_per_token=1, renormalize=False, expert_matmul=matmul)
  module, params, x, valid = init_moe(spec, seed=5)
  forced = np.full((B, T, 1), only_expert, np.int32)
  y, aux = module.apply(params, x, valid, jnp.asarray(forced))
  want_y, _, want_gates = np_moe(params["params"], x, spec, forced=forced)
  np.testing.assert_allclose(np.asarray(aux["gates"]), want_gates, atol=1e-6)
  np.testing.assert_allclose(np.asarray(y), want_y, atol=1e-5)
  want_load = np.zeros(E)
  want_load[only_expert] = 1.0
  np.testing.assert_allclose(np.asarray(aux["expert_load"]), want_load, atol=1e-7)


def test_param_tree_layout():
  spec = make_spec(num_shared_experts=2, use_routing_bias=True)
  module, _, x, valid = init_moe(spec)
  # The one real init in this file (jitted: eager random ops compile shape by shape).
  params = jax.jit(module.init)(jax.random.PRNGKey(0), x, valid)
  shapes = jax.tree.map(lambda a: (a.shape, str(a.dtype)), params["params"])
  assert shapes == {
      "w_router_de": ((D, E), "float32"),
      "routing_bias_e": ((E,), "float32"),
      "w_gate_edf": ((E, D, F), "float32"),
      "w_up_edf": ((E, D, F), "float32"),
      "w_down_efd": ((E, F, D), "float32"),
      "shared_experts": {"w_gate_df": ((D, 2 * F), "float32"),
                         "w_up_df": ((D, 2 * F), "float32"),
                         "w_down_fd": ((2 * F, D), "float32")},
  }
  np.testing.assert_array_equal(np.asarray(params["params"]["routing_bias_e"]), 0.0)
  # Fan-in scaled (truncated normal keeps the std a bit under 1/sqrt(fan_in)).
  p = params["params"]
  for w, fan_in in ((p["w_router_de"], D), (p["shared_experts"]["w_gate_df"], D),
                    (p["shared_experts"]["w_down_fd"], 2 * F)):
    assert 0.6 / np.sqrt(fan_in) < float(jnp.std(w)) < 1.1 / np.sqrt(fan_in)
  for name, fan_in in (("w_gate_edf", D), ("w_up_edf", D), ("w_down_efd", F)):
    for e in range(E):  # per expert: E is a batch axis, not part of the fan-in
      assert 0.6 / np.sqrt(fan_in) < float(jnp.std(p[name][e])) < 1.1 / np.sqrt(fan_in)
  _, plain, _, _ = init_moe(make_spec())
  assert "routing_bias_e" not in plain["params"] and "shared_experts" not in plain["params"]


def test_bad_inputs_raise_clear_errors():
  spec = make_spec()
  module, params, x, valid = init_moe(spec)
  with pytest.raises(ValueError, match="valid_bt has shape"):
    module.apply(params, x, valid[:, :-1])
  with pytest.raises(ValueError, match="forced_experts_btp has shape"):
    module.apply(params, x, valid, jnp.zeros((B, T, K + 1), jnp.int32))
  with pytest.raises(ValueError, match="integer dtype"):
    module.apply(params, x, valid, jnp.zeros((B, T, K), jnp.float32))
  with pytest.raises(ValueError, match="d_model"):
    module.apply(params, x[..., :-1], valid)
  # An out-of-range forced expert must not pass silently.
  bad = jnp.zeros((B, T, K), jnp.int32).at[0, 0, 0].set(E).at[1, 0, 1].set(-1)
  y, aux = module.apply(params, x, valid, bad)
  assert np.isnan(np.asarray(aux["gates"])[0, 0, 0]) and np.isnan(np.asarray(aux["gates"])[1, 0, 1])
  assert np.isnan(np.asarray(y)).any()


# ---------------------------------------------------------------- routing replay


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_routing_replay_after_router_perturbation(gate):
  spec = make_spec(gate=gate, num_shared_experts=1)
  module, params, x, valid = init_moe(spec, seed=6)
  _, aux0 = module.apply(params, x, valid)
  recorded = np.asarray(aux0["experts"])

  noise = jnp.asarray(np.random.default_rng(7).standard_normal((D, E)), jnp.float32)
  perturbed = jax.tree.map(lambda a: a, params)
  perturbed["params"]["w_router_de"] = params["params"]["w_router_de"] + 0.5 * noise
  _, aux_free = module.apply(perturbed, x, valid)
  assert (np.asarray(aux_free["experts"]) != recorded).any(), "perturbation too small"

  y, aux = module.apply(perturbed, x, valid, jnp.asarray(recorded))
  np.testing.assert_array_equal(np.asarray(aux["experts"]), recorded)
  # Gates by hand: perturbed router scores at the recorded experts, renormalised.
  scores = np_scores(x, perturbed["params"]["w_router_de"], gate)
  want_gates = np.take_along_axis(scores, recorded, axis=-1)
  want_gates = want_gates / want_gates.sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(aux["gates"]), want_gates, atol=1e-6)
  want_y, _, _ = np_moe(perturbed["params"], x, spec, forced=recorded)
  np.testing.assert_allclose(np.asarray(y), want_y, atol=1e-5)

  # The router still learns under replay.
  r = jnp.asarray(np.random.default_rng(8).standard_normal(y.shape), jnp.float32)

  def loss(p):
    y, _ = module.apply(p, x, valid, jnp.asarray(recorded))
    return jnp.sum(y * r)

  g_router = jax.jit(jax.grad(loss))(perturbed)["params"]["w_router_de"]
  assert np.isfinite(np.asarray(g_router)).all()
  assert float(jnp.abs(g_router).max()) > 1e-3


# ---------------------------------------------------------------- load statistics


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_padding_excluded_from_load_and_aux_loss(gate):
  spec = make_spec(gate=gate, aux_loss_coef=0.1)
  module, params, x, _ = init_moe(spec, seed=9, t=7)
  valid = jnp.asarray(np.array([[1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0]], bool))
  y, aux = module.apply(params, x, valid)
  scores = np_scores(x, params["params"]["w_router_de"], gate)
  want_load, want_aux = np_load_and_aux(scores, aux["experts"], valid, gate, 0.1)
  np.testing.assert_allclose(np.asarray(aux["expert_load"]), want_load, atol=1e-6)
  np.testing.assert_allclose(float(aux["aux_loss"]), want_aux, rtol=1e-5)
  assert abs(float(aux["expert_load"].sum()) - 1.0) < 1e-6
  assert np.isfinite(np.asarray(y)).all()
  # Whatever the padding holds, the statistics are unchanged.
  junk = 100.0 * np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
  x_junk = jnp.where(valid[..., None], x, junk)
  _, aux_junk = module.apply(params, x_junk, valid)
  np.testing.assert_allclose(np.asarray(aux_junk["expert_load"]), want_load, atol=1e-6)
  np.testing.assert_allclose(float(aux_junk["aux_loss"]), want_aux, rtol=1e-5)
  # With no valid token: zero load, zero loss, no NaN.
  _, aux_none = module.apply(params, x, jnp.zeros_like(valid))
  np.testing.assert_array_equal(np.asarray(aux_none["expert_load"]), 0.0)
  assert float(aux_none["aux_loss"]) == 0.0


def test_aux_loss_hand_computed_example():
  """E=4, k=1, softmax, 3 tokens, router logits set by hand through x = identity rows."""
  c = default_model_config()
  c.d_model, c.moe.num_experts, c.moe.num_experts_per_token = 4, 4, 1
  c.moe.num_shared_experts, c.moe.aux_loss_coef = 0, 0.5
  spec = validate(c)
  module = MoEFeedForward(spec)
  x = jnp.eye(4)[None, :3]  # token i reads router row i
  valid = jnp.ones((1, 3), bool)
  params = {"params": {
      name: jnp.asarray(np.random.default_rng(0).standard_normal(v.shape), jnp.float32)
      for name, v in jax.eval_shape(module.init, jax.random.PRNGKey(0), x, valid)["params"].items()}}
  logits = np.array([[2.0, 0.0, 0.0, 0.0],
                     [0.0, 0.0, np.log(3.0), 0.0],
                     [0.0, np.log(2.0), 0.0, 0.0],
                     [0.0, 0.0, 0.0, 0.0]], np.float32)
  params["params"]["w_router_de"] = jnp.asarray(logits)
  _, aux = module.apply(params, x, valid)
  np.testing.assert_array_equal(np.asarray(aux["experts"])[0, :, 0], [0, 2, 1])
  # f = [1/3, 1/3, 1/3, 0]; softmax rows:
  #   t0: [e^2, 1, 1, 1] / (e^2 + 3); t1: [1, 1, 3, 1] / 6; t2: [1, 2, 1, 1] / 5.
  e2 = np.exp(2.0)
  p0 = np.array([e2, 1, 1, 1]) / (e2 + 3)
  p1 = np.array([1, 1, 3, 1]) / 6
  p2 = np.array([1, 2, 1, 1]) / 5
  mean_p = (p0 + p1 + p2) / 3
  want = 0.5 * 4 * (mean_p[0] + mean_p[1] + mean_p[2]) / 3
  np.testing.assert_allclose(float(aux["aux_loss"]), want, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(aux["expert_load"]), [1 / 3, 1 / 3, 1 / 3, 0], atol=1e-7)
  # Balanced routing with uniform probabilities gives exactly coef * 1.
  params["params"]["w_router_de"] = jnp.zeros((4, 4))
  _, aux_u = module.apply(params, x, valid)
  np.testing.assert_allclose(float(aux_u["aux_loss"]), 0.5, rtol=1e-6)
  # Coefficient 0 turns it off.
  spec0 = spec.replace(moe=spec.moe.replace(aux_loss_coef=0.0))
  _, aux0 = MoEFeedForward(spec0).apply(params, x, valid)
  assert float(aux0["aux_loss"]) == 0.0


def test_aux_loss_gradient_reaches_router_only_through_probabilities():
  spec = make_spec(aux_loss_coef=1.0)
  module, params, x, valid = init_moe(spec, seed=10)

  def aux_loss(p):
    return module.apply(p, x, valid)[1]["aux_loss"]

  g = jax.grad(aux_loss)(params)["params"]
  assert float(jnp.abs(g["w_router_de"]).max()) > 0
  for name in ("w_gate_edf", "w_up_edf", "w_down_efd"):
    np.testing.assert_array_equal(np.asarray(g[name]), 0.0)


# ---------------------------------------------------------------- routing bias


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_routing_bias_moves_selection_not_gates(gate):
  spec = make_spec(gate=gate, use_routing_bias=True, num_shared_experts=1)
  module, params, x, valid = init_moe(spec, seed=11)
  _, aux0 = module.apply(params, x, valid)
  scores = np_scores(x, params["params"]["w_router_de"], gate)
  np.testing.assert_array_equal(np.asarray(aux0["experts"]), np_topk(scores, K))

  # Pick an expert token (0, 0) did not choose and bias it enough to win everywhere.
  unchosen = int(np.setdiff1d(np.arange(E), np.asarray(aux0["experts"])[0, 0])[0])
  bias = np.zeros(E, np.float32)
  bias[unchosen] = 2.0  # scores lie in [0, 1]
  params["params"]["routing_bias_e"] = jnp.asarray(bias)
  y, aux = module.apply(params, x, valid)
  experts = np.asarray(aux["experts"])
  assert (experts == unchosen).any(-1).all()
  assert (experts != np.asarray(aux0["experts"])).any()
  np.testing.assert_array_equal(experts, np_topk(scores + bias, K))
  want_y, _, want_gates = np_moe(params["params"], x, spec, bias=bias)
  # Gates are the unbiased scores at the selected experts, renormalised.
  gates_by_hand = np.take_along_axis(scores, experts, axis=-1)
  gates_by_hand /= gates_by_hand.sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(aux["gates"]), gates_by_hand, atol=1e-6)
  np.testing.assert_allclose(np.asarray(aux["gates"]), want_gates, atol=1e-6)
  np.testing.assert_allclose(np.asarray(y), want_y, atol=1e-5)

  def loss(p):
    y, aux = module.apply(p, x, valid)
    return jnp.sum(y) + aux["aux_loss"]

  g = jax.grad(loss)(params)["params"]
  np.testing.assert_array_equal(np.asarray(g["routing_bias_e"]), 0.0)


def test_update_routing_bias_hand_example():
  bias = jnp.asarray([0.0, 0.5, -0.25, 0.0])
  load = jnp.asarray([0.5, 0.25, 0.25, 0.0])  # mean 0.25
  new = update_routing_bias(bias, load, 0.1)
  np.testing.assert_allclose(np.asarray(new), [-0.1, 0.5, -0.25, 0.1], atol=1e-7)
  assert new.dtype == bias.dtype
  # No valid token (all-zero load) leaves the bias alone.
  np.testing.assert_array_equal(np.asarray(update_routing_bias(bias, jnp.zeros(4), 0.1)),
                                np.asarray(bias))


def test_routing_bias_update_balances_load():
  """Repeated updates on a fixed batch push a skewed router towards balance."""
  spec = make_spec(use_routing_bias=True)
  module, params, x, valid = init_moe(spec, seed=12, b=4, t=16)
  params["params"]["w_router_de"] = params["params"]["w_router_de"].at[:, 0].add(1.0)
  apply = jax.jit(module.apply)
  load0 = np.asarray(apply(params, x, valid)[1]["expert_load"])
  for _ in range(40):
    load = apply(params, x, valid)[1]["expert_load"]
    params["params"]["routing_bias_e"] = update_routing_bias(
        params["params"]["routing_bias_e"], load, 0.01)
  load1 = np.asarray(apply(params, x, valid)[1]["expert_load"])
  assert load1.max() < load0.max()


# ---------------------------------------------------------------- jit, dtype, gradients


def test_jit_equals_no_jit():
  spec = make_spec(gate="sigmoid", num_shared_experts=1, use_routing_bias=True,
                   aux_loss_coef=0.01)
  module, params, x, _ = init_moe(spec, seed=13)
  valid = jnp.ones((B, T), bool).at[1, 3:].set(False)
  y0, aux0 = module.apply(params, x, valid)
  y1, aux1 = jax.jit(module.apply)(params, x, valid)
  np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(aux1["experts"]), np.asarray(aux0["experts"]))
  for name in ("gates", "expert_load", "aux_loss"):
    np.testing.assert_allclose(np.asarray(aux1[name]), np.asarray(aux0[name]), atol=1e-6)


def test_bfloat16_compute_stays_close_to_float32():
  spec = make_spec(num_shared_experts=1)
  module, params, x, valid = init_moe(spec, seed=14)
  y32, aux32 = module.apply(params, x, valid)
  y16, aux16 = MoEFeedForward(spec.replace(dtype="bfloat16")).apply(params, x, valid)
  assert y16.dtype == jnp.bfloat16 and aux16["gates"].dtype == jnp.float32
  # The router stays float32, so the routing is identical.
  np.testing.assert_array_equal(np.asarray(aux16["experts"]), np.asarray(aux32["experts"]))
  np.testing.assert_allclose(np.asarray(aux16["gates"]), np.asarray(aux32["gates"]), atol=1e-6)
  scale = float(jnp.abs(y32).max())
  np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(y32), atol=0.05 * scale)


def _directional_check(loss, params, seed, eps=1e-3, rtol=1e-2):
  """jax.grad against a central difference along a random direction, leaf by leaf.

  The direction is elementwise standard normal (perturbing each weight by ~eps), so
  the directional derivative stands well above float32 round-off in the loss."""
  grads = jax.grad(loss)(params)
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(seed)
  for i, (leaf, g) in enumerate(zip(leaves, jax.tree.leaves(grads))):
    v = jnp.asarray(rng.standard_normal(leaf.shape), leaf.dtype)

    def shifted(sign):
      new = list(leaves)
      new[i] = leaf + sign * eps * v
      return float(loss(jax.tree.unflatten(treedef, new)))

    fd = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
    analytic = float(jnp.vdot(g, v))
    assert abs(analytic) > 1e-2, (i, analytic)  # a real signal, not round-off
    assert abs(fd - analytic) <= rtol * abs(analytic), (i, fd, analytic)


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_numerical_gradients(gate):
  """Every param, expert weights and router included. Replay fixes the routing, so the
  loss is smooth: a central difference cannot flip an expert choice."""
  spec = make_spec(gate=gate, num_shared_experts=1, aux_loss_coef=0.1)
  module, params, x, valid = init_moe(spec, seed=15)
  forced = module.apply(params, x, valid)[1]["experts"]
  r = jnp.asarray(np.random.default_rng(16).standard_normal(x.shape), jnp.float32)

  @jax.jit
  def loss(p):
    y, aux = module.apply(p, x, valid, forced)
    return jnp.sum(y * r) + aux["aux_loss"]

  _directional_check(loss, params, seed=17)


@pytest.mark.parametrize("forced_experts", [None, (2, 6)])
def test_the_grouped_matmul_equals_ragged_dot_in_values_and_gradients(forced_experts):
  """Zero-size groups inside the bound (only experts 2 and 6 used, 5 rows each at B=1) and
  routed groups; values and every gradient agree with the ragged_dot path."""
  results = []
  for matmul in MATMULS:
    spec = make_spec(expert_matmul=matmul, num_shared_experts=0)
    module, params, x, valid = init_moe(spec, seed=6, b=1)
    forced = None
    if forced_experts is not None:
      forced = jnp.asarray(np.tile(forced_experts, (1, T, 1)), jnp.int32)

    def loss(p, x):
      y, aux = module.apply(p, x, valid, forced)
      return jnp.sum(y ** 2) + aux["aux_loss"], y
    (value, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        params, x)
    results.append((y, grads))
  (y_r, g_r), (y_g, g_g) = results
  np.testing.assert_allclose(np.asarray(y_g), np.asarray(y_r), atol=1e-6)
  for a, b in zip(jax.tree.leaves(g_g), jax.tree.leaves(g_r)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_the_grouped_matmul_computes_only_the_bound_rows():
  """On CPU, ragged_dot runs every expert on every row; the grouped path's matmuls have E
  blocks of the bound (here 8 of 40 rows), under a cond that keeps ragged_dot as the
  fallback."""
  from agentic_rl.model import moe
  assert moe.group_bound(40, 8) == 16 and moe.group_bound(128, 8) == 32
  assert moe.group_bound(20, 8) == 8 and moe.group_bound(4, 8) == 4
  a, d, f = 40, 16, 12
  args = (jnp.zeros((a, d)), jnp.zeros((E, d, f)), jnp.zeros((E, d, f)), jnp.zeros((E, f, d)),
          jnp.full((E,), a // E, jnp.int32))
  hlo = jax.jit(lambda *x: moe._routed_swiglu(*x, expert_matmul="grouped")).lower(
      *args).as_text()
  assert "tensor<8x16x12xf32>" in hlo and "stablehlo.case" in hlo
