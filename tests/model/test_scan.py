"""config.model.scan_layers: one nn.scan over the repeating layer group computes what the
unrolled stack computes, and its traced program does not grow with num_layers.

The reference is always the unrolled model (scan_layers=False) on the same weights:
params drawn for it and moved into the scanned layout by `layer_stack.stack_layers`.
fp32, tiny shapes (model_fixtures.make_spec: V=64, d_model=32, 4 experts top-2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.config_schema import ConfigError
from agentic_rl.model import cache as cache_lib
from agentic_rl.model import layer_stack
from agentic_rl.model.config import LayerScan, default_model_config, validate
from agentic_rl.model.transformer import Model, replay_from_aux, update_routing_biases
from agentic_rl.parallel import memory_plan, rules
from tests.model.model_fixtures import draw_params, make_spec

B, T = 2, 12
SPECS = {
    # Two SSSG groups, every layer MoE: the issue's 3:1 hybrid.
    "sssg_moe": make_spec("SSSG", 8, value_head=True),
    # Dense F layers, no MoE: a group of one layer.
    "dense_f": make_spec("F", 4, **{"moe.num_experts": 0}),
    # Qwen-MoE's decoder_sparse_step: dense and MoE layers alternate, a group of two.
    "moe_step_2": make_spec("SG", 8, moe_layer_step=2),
    # Two dense leading layers break the period: the first group stays unrolled.
    "dense_head": make_spec("SSSG", 12, num_dense_layers=2),
}
PLANS = {"sssg_moe": LayerScan(0, 4, 2), "dense_f": LayerScan(0, 1, 4),
         "moe_step_2": LayerScan(0, 2, 4), "dense_head": LayerScan(4, 4, 2)}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (B, T)), jnp.int32)
POSITIONS = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))


def scanned(spec):
  return spec.replace(scan_layers=True)


@functools.lru_cache(maxsize=None)
def unrolled_params(name: str, seed: int = 1):
  return draw_params(Model(SPECS[name]), seed)


def _value_and_grad(spec, params, replay):
  def loss(p):
    logits, _, aux = Model(spec).forward(p, TOKENS, POSITIONS, replay=replay)
    total = jnp.mean(jax.nn.log_softmax(logits)[..., 3]) + aux["moe_aux_loss"]
    if spec.value_head:
      total = total + jnp.mean(aux["values"] ** 2)
    return total, (logits, aux)
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def assert_trees_close(got, want, atol):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5,
                               err_msg=jax.tree_util.keystr(path))


# --- The layout ------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_plan_is_the_smallest_repeating_group(name):
  assert scanned(SPECS[name]).layer_scan == PLANS[name]
  assert SPECS[name].layer_scan is None


def test_the_64_layer_config_scans_all_but_its_dense_start():
  from configs import full_scale
  spec = scanned(validate(full_scale.get_config().model))
  assert spec.num_dense_layers == 2
  assert spec.layer_scan == LayerScan(unrolled=4, period=4, repeats=15)


def test_an_irregular_stack_names_scan_layers():
  c = default_model_config()
  c.num_layers, c.num_dense_layers, c.dense_layers, c.scan_layers = 8, 0, (5,), True
  with pytest.raises(ConfigError, match=r"config\.model\.scan_layers=True: .*repeat.*"
                                        r"S/moe, S, S/moe"):
    validate(c)
  c.num_layers, c.dense_layers = 4, ()  # SSSG once: no group repeats.
  with pytest.raises(ConfigError, match=r"config\.model\.scan_layers"):
    validate(c)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_stacking_round_trips_exactly_into_the_scanned_tree(name):
  spec = scanned(SPECS[name])
  params = unrolled_params(name)
  stacked = layer_stack.stack_layers(params, spec)
  shapes = Model(spec).param_shapes()
  assert jax.tree.structure(stacked) == jax.tree.structure(shapes)
  for a, s in zip(jax.tree.leaves(stacked), jax.tree.leaves(shapes)):
    assert a.shape == s.shape and a.dtype == s.dtype
  plan = spec.layer_scan
  assert all(x.shape[0] == plan.repeats for x in jax.tree.leaves(stacked["layers"]))
  i = plan.layer(1 % plan.period, plan.repeats - 1)  # slot 1 (or 0), last repeat
  np.testing.assert_array_equal(
      stacked["layers"][f"slot_{1 % plan.period}"]["attn"]["w_q_dnh"][plan.repeats - 1],
      params[f"layer_{i}"]["attn"]["w_q_dnh"])
  back = layer_stack.unstack_layers(stacked, spec)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  assert layer_stack.scan_of(stacked) == plan and layer_stack.scan_of(params) is None
  with pytest.raises(ValueError, match="already in the scanned layout"):
    layer_stack.stack_layers(stacked, spec)


def test_optimiser_moments_stack_with_their_params():
  import optax
  spec = scanned(SPECS["sssg_moe"])
  params = unrolled_params("sssg_moe")
  state = optax.adamw(1e-3).init(params)
  state = jax.tree.map(lambda x: x + 1.0 if x.ndim else x, state)  # Moments not all zero.
  stacked = layer_stack.stack_layers_in(state, spec)
  assert jax.tree.structure(stacked) == jax.tree.structure(
      optax.adamw(1e-3).init(layer_stack.stack_layers(params, spec)))
  back = layer_stack.unstack_layers_in(stacked, spec)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)


# --- Scan equals unrolled --------------------------------------------------------------

@pytest.mark.parametrize("name,remat", [
    ("sssg_moe", "none"), ("dense_f", "none"),
    # Each compiles two models' gradients for 10-30 s: the slow suite holds the rest.
    pytest.param("sssg_moe", "full", marks=pytest.mark.slow),
    pytest.param("moe_step_2", "none", marks=pytest.mark.slow),
    pytest.param("dense_head", "none", marks=pytest.mark.slow)])
def test_scan_equals_unrolled_in_values_replay_and_gradients(name, remat):
  spec = SPECS[name]
  params = unrolled_params(name)
  # Forced routing and blocks from other weights, so replay changes what the layers pick.
  _, _, other_aux = jax.jit(Model(spec).forward)(unrolled_params(name, seed=2), TOKENS,
                                                   POSITIONS)
  replay = replay_from_aux(other_aux)
  (loss, (logits, aux)), grads = _value_and_grad(spec, params, replay)
  scan_spec = scanned(spec).replace(remat=remat)
  (loss_s, (logits_s, aux_s)), grads_s = _value_and_grad(
      scan_spec, layer_stack.stack_layers(params, scan_spec), replay)

  np.testing.assert_allclose(logits_s, logits, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(loss_s, loss, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(aux_s["moe_aux_loss"], aux["moe_aux_loss"], rtol=1e-5,
                             atol=1e-7)
  if spec.value_head:
    np.testing.assert_allclose(aux_s["values"], aux["values"], atol=1e-6)
  # The same per-layer records, the forced ones among them.
  assert len(aux_s["layers"]) == spec.num_layers
  assert_trees_close(aux_s["layers"], aux["layers"], atol=1e-6)
  for i, forced in enumerate(replay):
    for key, want in forced.items():
      np.testing.assert_array_equal(aux_s["layers"][i][key], want)
  assert_trees_close(grads_s, layer_stack.stack_layers(grads, scan_spec), atol=1e-6)
  if any(replay):  # The replay mattered: the free forward picks otherwise.
    _, _, free_aux = jax.jit(Model(spec).forward)(params, TOKENS, POSITIONS)
    assert any(not np.array_equal(free_aux["layers"][i][k], v)
               for i, forced in enumerate(replay) for k, v in forced.items())


def test_a_replay_must_give_a_slots_layers_the_same_entries():
  spec = SPECS["sssg_moe"]
  _, _, aux = jax.jit(Model(spec).forward)(unrolled_params("sssg_moe"), TOKENS, POSITIONS)
  replay = list(replay_from_aux(aux))
  replay[4] = {}  # slot 0 of repeat 1 loses its experts; repeat 0 keeps them
  stacked = layer_stack.stack_layers(unrolled_params("sssg_moe"), scanned(spec))
  with pytest.raises(ValueError, match=r"layer 0 \['experts'\] but layer 4 \[\].*scan_layers"):
    Model(scanned(spec)).forward(stacked, TOKENS, POSITIONS, replay=tuple(replay))


@pytest.mark.parametrize("name", ["sssg_moe", "dense_head"])
def test_cached_prefill_and_decode_with_scanned_params_equal_unrolled(name):
  spec = SPECS[name]
  params = unrolled_params(name)
  tokens = np.asarray(np.random.default_rng(3).integers(0, 64, (B, 16)), np.int32)

  def generate(spec, params):
    model = Model(spec)
    fwd = jax.jit(model.forward)
    cache = model.init_cache(B, 32)
    pos = np.broadcast_to(np.arange(12, dtype=np.int32), (B, 12))
    logits, cache, aux = fwd(params, jnp.asarray(tokens[:, :12]), jnp.asarray(pos), cache)
    out, layers = [logits], [aux["layers"]]
    for p in range(12, 16):
      logits, cache, aux = fwd(params, jnp.asarray(tokens[:, p:p + 1]),
                               jnp.full((B, 1), p, jnp.int32), cache)
      out.append(logits)
      layers.append(aux["layers"])
    return np.concatenate(out, axis=1), layers, cache

  want, want_layers, want_cache = generate(spec, params)
  got, got_layers, got_cache = generate(scanned(spec),
                                        layer_stack.stack_layers(params, scanned(spec)))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert_trees_close(got_layers, want_layers, atol=1e-6)
  assert set(got_cache) == {"lengths", "layers", "stack"}  # Stacked per slot, not per layer.
  assert_trees_close(cache_lib.unstack_layers(got_cache, scanned(spec).layer_scan),
                     want_cache, atol=1e-6)
  # And the cached path agrees with the scanned full forward.
  full, _, _ = jax.jit(Model(scanned(spec)).forward)(
      layer_stack.stack_layers(params, scanned(spec)), jnp.asarray(tokens),
      jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (B, 16)))
  np.testing.assert_allclose(got, full, atol=1e-4)


@pytest.mark.parametrize("name", ["sssg_moe", "dense_head"])
def test_the_stacked_cache_layout_round_trips_and_its_row_ops_match(name):
  """init, reset, gather and scatter on the stacked layout equal the same ops on the
  per-layer layout, moved over by stack_layers."""
  spec = scanned(SPECS[name])
  scan = spec.layer_scan
  per_layer = Model(SPECS[name]).init_cache(3, 32)
  stacked = Model(spec).init_cache(3, 32)
  assert_trees_close(stacked, cache_lib.stack_layers(per_layer, scan), atol=0)
  rng = np.random.default_rng(7)
  full = jax.tree.map(lambda x: jnp.asarray(rng.integers(-1, 9, x.shape), x.dtype), per_layer)
  stacked = cache_lib.stack_layers(full, scan)
  assert_trees_close(cache_lib.unstack_layers(stacked, scan), full, atol=0)
  assert cache_lib.capacity(stacked) == cache_lib.capacity(full) == 32
  reset = jnp.asarray([False, True, False])
  rows = jnp.asarray([2, 2, 0])
  for got, want in [
      (cache_lib.reset_sequences(stacked, reset), cache_lib.reset_sequences(full, reset)),
      (cache_lib.gather_sequences(stacked, rows), cache_lib.gather_sequences(full, rows)),
      (cache_lib.scatter_sequences(stacked, rows[:1], cache_lib.gather_sequences(stacked, rows[1:2])),
       cache_lib.scatter_sequences(full, rows[:1], cache_lib.gather_sequences(full, rows[1:2])))]:
    assert_trees_close(cache_lib.unstack_layers(got, scan), want, atol=0)


def test_a_stacked_cache_shards_its_rows_and_heads_never_its_repeats():
  spec = scanned(SPECS["sssg_moe"])
  sizes = {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}
  specs = rules.cache_specs(jax.eval_shape(lambda: Model(spec).init_cache(4, 32)), sizes)
  assert specs["stack"][0]["k"] == rules.P(None, "data", None, "tensor", None)
  assert specs["stack"][0]["pos"] == rules.P(None, "data", None)
  assert specs["stack"][3]["block_keys"] == rules.P(None, "data", None, "tensor", None)


def test_routing_bias_update_under_scan_equals_unrolled():
  spec = make_spec("SSSG", 12, num_dense_layers=2, **{"moe.use_routing_bias": True})
  params = draw_params(Model(spec), 4)
  rng = np.random.default_rng(5)
  aux = {"layers": tuple({"expert_load": jnp.asarray(rng.dirichlet(np.ones(4)), jnp.float32)}
                         if spec.is_moe_layer(i) else {} for i in range(spec.num_layers))}
  want = update_routing_biases(params, aux, 0.1)
  got = update_routing_biases(layer_stack.stack_layers(params, scanned(spec)), aux, 0.1)
  assert_trees_close(got, layer_stack.stack_layers(want, scanned(spec)), atol=0)
  moved = [i for i in range(spec.num_layers)
           if np.any(want[f"layer_{i}"].get("moe", {}).get("routing_bias_e", 0) != 0)]
  assert moved == [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
  assert moved[0] < 4 < moved[-1]  # Both an unrolled and the scanned layers moved.


# --- Sharding, memory, compile time ----------------------------------------------------

def test_the_repeat_axis_is_never_sharded():
  sizes = {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1}
  spec = scanned(SPECS["dense_head"])
  shapes = Model(spec).param_shapes()
  specs = rules.param_specs(shapes, sizes)
  unrolled = rules.param_specs(layer_stack.unstacked(shapes), sizes)
  checked = 0
  for path, got in jax.tree_util.tree_leaves_with_path(
      specs, is_leaf=lambda x: isinstance(x, rules.P)):
    keys = [k.key for k in path]
    if keys[0] != "layers":
      continue
    # Each repeat of the slot is sharded as its first layer is, unscanned, behind r.
    want = unrolled[f"layer_{spec.layer_scan.layer(int(keys[1][len('slot_'):]), 0)}"]
    for k in keys[2:]:
      want = want[k]
    assert got == rules.P(None, *want), keys
    checked += any(axis is not None for axis in want)
  assert checked > 10  # Not a comparison of replicated specs only.
  assert rules.param_letters(("layers", "slot_0", "attn", "w_q_dnh"), 4) == "rdnh"
  # Adam's moments too (their paths end in the param's), and bytes per device unchanged.
  assert rules.param_letters((0, "mu", "layers", "slot_1", "moe", "w_up_edf"), 4) == "redf"
  assert (memory_plan.tree_bytes_per_device(shapes, sizes)
          == memory_plan.tree_bytes_per_device(layer_stack.unstacked(shapes), sizes))


def _lowered(spec) -> str:
  """The forward and backward program, lowered from shapes: nothing compiled."""
  shapes = Model(spec).param_shapes()

  def loss(p):
    logits, _, aux = Model(spec).forward(p, TOKENS, POSITIONS)
    return jnp.mean(logits) + aux["moe_aux_loss"]
  return jax.jit(jax.grad(loss)).lower(shapes).as_text()


def _lowered_size(spec) -> int:
  return len(_lowered(spec))


def test_remat_recomputes_inside_the_scanned_body():
  spec = scanned(SPECS["sssg_moe"])
  assert (_lowered(spec.replace(remat="full")).count("dot_general")
          > _lowered(spec).count("dot_general"))


def test_the_scanned_program_does_not_grow_with_depth():
  """Lowered (not compiled) forward and backward: 4x the layers is ~4x the unrolled
  program, but the same scanned one (give or take the stacked shapes' text)."""
  small, large = make_spec("SSSG", 8), make_spec("SSSG", 32)
  scan_ratio = _lowered_size(scanned(large)) / _lowered_size(scanned(small))
  unrolled_ratio = _lowered_size(large) / _lowered_size(small)
  assert scan_ratio < 1.1, scan_ratio
  assert unrolled_ratio > 3.0, unrolled_ratio


def _lowered_decode_size(spec) -> int:
  """One cached decode step, lowered from shapes."""
  model = Model(spec)
  cache = jax.eval_shape(lambda: model.init_cache(B, 32))
  return len(jax.jit(model.forward).lower(
      model.param_shapes(), jnp.zeros((B, 1), jnp.int32), jnp.zeros((B, 1), jnp.int32),
      cache).as_text())


def test_the_scanned_decode_program_does_not_grow_with_depth():
  small, large = make_spec("SSSG", 8), make_spec("SSSG", 32)
  scan_ratio = _lowered_decode_size(scanned(large)) / _lowered_decode_size(scanned(small))
  unrolled_ratio = _lowered_decode_size(large) / _lowered_decode_size(small)
  assert scan_ratio < 1.1, scan_ratio
  assert unrolled_ratio > 3.0, unrolled_ratio


def test_a_64_layer_config_traces_its_shapes():
  from configs import full_scale
  from agentic_rl.model import sizing
  spec = scanned(validate(full_scale.get_config().model))
  model = Model(spec)
  shapes = model.param_shapes()
  assert shapes["layers"]["slot_3"]["attn"]["w_q_dnh"].shape == (
      15, spec.d_model, spec.num_heads, spec.head_dim)
  logits, _, aux = jax.eval_shape(
      lambda p: model.forward(p, jnp.zeros((1, 64), jnp.int32),
                              jnp.arange(64, dtype=jnp.int32)[None]), shapes)
  assert logits.shape == (1, 64, spec.vocab_size) and len(aux["layers"]) == 64
  assert aux["layers"][63]["blocks"].shape[0] == 1
  assert sizing.param_counts(spec) == sizing.param_counts(spec.replace(scan_layers=False))
