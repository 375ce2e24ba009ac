"""Run with 8 emulated CPU devices: the all_to_all expert-parallel path against the dropless
single-device MoE (forward and gradients), its overflow count against a naive loop, and its
compiled HLO; the dropless ragged path (on the emulated ragged_all_to_all) against the same,
and its lowering with the real primitive.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.parallel.expert_parallel_check
"""

import json

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model import moe
from agentic_rl.parallel import mesh as mesh_lib
from agentic_rl.parallel.expert_parallel import (all_to_all_moe, capacity,
                                                 ragged_all_to_all_moe)
from agentic_rl.parallel.mesh_config import parse_flag

B, T, D, F, E, P = 8, 6, 16, 12, 8, 2


def inputs(seed=0):
  k = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(k[0], (B, T, D))
  scores = jax.nn.softmax(jax.random.normal(k[1], (B, T, E)) * 2, -1)
  gates, experts = jax.lax.top_k(scores, P)
  valid = jax.random.uniform(k[2], (B, T)) > 0.15  # Some padding.
  w = [jax.random.normal(k[3 + i], shape) * 0.3 for i, shape in
       enumerate(((E, D, F), (E, D, F), (E, F, D)))]
  return x, experts.astype(jnp.int32), gates, valid, w


def reference(x, experts, gates, valid, w):
  """The dropless single-device dispatch of moe.py; padding rows give 0 like the EP path."""
  y = moe._dispatch(x, experts, gates, *w, E)
  return jnp.where(valid[..., None], y, 0)


def naive_dropped(experts, valid, shards, cap):
  """Assignments past `cap` per expert, per shard, in token-major order: a plain loop."""
  experts, valid = np.asarray(experts), np.asarray(valid)
  keep = np.zeros(experts.shape, bool)
  for rows in np.split(np.arange(B), shards):
    count = np.zeros(E, int)
    for b in rows:
      for t in range(T):
        for p in range(P):
          if valid[b, t]:
            e = experts[b, t, p]
            keep[b, t, p] = count[e] < cap
            count[e] += 1
  return keep, int((valid[..., None] & ~keep).sum())


def main():
  out = {}
  x, experts, gates, valid, w = inputs()
  for flag, factor in (("data=2,expert=4", 8.0), ("expert=8", 8.0),
                       ("data=2,fsdp=2,expert=2", 8.0), ("data=2,expert=4", 0.5)):
    mesh = mesh_lib.build_mesh(parse_flag(flag))
    shards = mesh.devices.size
    loss = lambda fn: lambda x, g, w: jnp.sum(jnp.sin(fn(x, g, w)))  # noqa: E731
    ep = lambda x, g, w: all_to_all_moe(x, experts, g, valid, *w, mesh=mesh,  # noqa: E731
                                        capacity_factor=factor)[0]
    y_ep, counts = jax.jit(lambda x, g, w: all_to_all_moe(
        x, experts, g, valid, *w, mesh=mesh, capacity_factor=factor))(x, gates, w)
    cap = capacity(B // shards * T * P, E, factor)
    keep, dropped = naive_dropped(experts, valid, shards, cap)
    # The reference drops what the naive loop drops: those gates are zeroed.
    y_ref = reference(x, experts, jnp.where(keep, gates, 0), valid, w)
    g_ep = jax.jit(jax.grad(loss(ep), argnums=(0, 1, 2)))(x, gates, w)
    g_ref = jax.jit(jax.grad(loss(lambda x, g, w: reference(x, experts, jnp.where(
        keep, g, 0), valid, w)), argnums=(0, 1, 2)))(x, gates, w)
    hlo = jax.jit(ep).lower(x, gates, w).compile().as_text()
    out[f"{flag}@{factor}"] = {
        "forward_max_abs_diff": float(jnp.abs(y_ep - y_ref).max()),
        "grad_max_abs_diff": max(float(jnp.abs(a - b).max()) for a, b in
                                 zip(jax.tree.leaves(g_ep), jax.tree.leaves(g_ref))),
        "dropped": int(counts["dropped"]), "naive_dropped": dropped,
        "assignments": int(counts["assignments"]), "valid_assignments": int(valid.sum()) * P,
        "hlo_all_to_all": hlo.count("all-to-all"), "hlo_all_gather": hlo.count("all-gather"),
    }
  out.update(ragged_check())
  out["model"] = model_check("all_to_all")
  out["model_ragged"] = model_check("ragged_all_to_all")
  print(json.dumps(out))


def ragged_check() -> dict:
  """The dropless ragged path against the single-device MoE, forward and gradients, on the
  emulated exchange; and what TPU/GPU would run: the lowering with the real primitive, whose
  all-gathers (if any) carry row counts, never expert weights."""
  out = {}
  x, experts, gates, valid, w = inputs()
  loss = lambda fn: lambda x, g, w: jnp.sum(jnp.sin(fn(x, g, w)))  # noqa: E731
  for flag in ("data=2,expert=4", "expert=8", "data=2,fsdp=2,expert=2"):
    mesh = mesh_lib.build_mesh(parse_flag(flag))

    def ep(x, g, w, exchange=None):
      return ragged_all_to_all_moe(x, experts, g, valid, *w, mesh=mesh,
                                   expert_fn=moe._routed_swiglu, exchange=exchange)

    y_ep, counts = jax.jit(ep)(x, gates, w)
    y_ref = reference(x, experts, gates, valid, w)
    g_ep = jax.jit(jax.grad(loss(lambda *a: ep(*a)[0]), argnums=(0, 1, 2)))(x, gates, w)
    g_ref = jax.jit(jax.grad(loss(lambda x, g, w: reference(x, experts, g, valid, w)),
                             argnums=(0, 1, 2)))(x, gates, w)
    real = lambda x, g, w: ep(x, g, w, jax.lax.ragged_all_to_all)[0]  # noqa: E731
    lowered = jax.jit(jax.value_and_grad(loss(real), argnums=(0, 1, 2))).lower(
        x, gates, w).as_text()
    gathers = [line for line in lowered.splitlines() if "all_gather" in line]
    out[f"ragged:{flag}"] = {
        "forward_max_abs_diff": float(jnp.abs(y_ep - y_ref).max()),
        "grad_max_abs_diff": max(float(jnp.abs(a - b).max()) for a, b in
                                 zip(jax.tree.leaves(g_ep), jax.tree.leaves(g_ref))),
        "dropped": int(counts["dropped"]), "assignments": int(counts["assignments"]),
        "valid_assignments": int(valid.sum()) * P,
        "lowered_ragged_all_to_all": lowered.count("ragged_all_to_all"),
        "lowered_float_all_gathers": sum("xf32>" in line or "xbf16>" in line
                                         for line in gathers),
    }
  return out


def model_check(dispatch: str):
  """The whole model with moe.dispatch=`dispatch` under a (data 2, expert 4) mesh against
  the dropless model on one device: logits, gradients, routing replay, overflow in aux."""
  from agentic_rl.model.config import ModelSpec, MoESpec
  from agentic_rl.model.transformer import Model, replay_from_aux
  from agentic_rl.parallel import rules
  spec = ModelSpec(vocab_size=64, d_model=16, num_layers=2, layer_pattern="F", num_heads=4,
                   num_kv_heads=4, head_dim=4, num_dense_layers=0, d_ff=16, max_seq_len=32,
                   moe=MoESpec(num_experts=8, num_experts_per_token=2, d_ff_expert=8,
                               num_shared_experts=0))
  dropless, ep_model = Model(spec), Model(spec.replace(moe=spec.moe.replace(
      dispatch=dispatch, capacity_factor=8.0)))
  tokens = jax.random.randint(jax.random.key(3), (8, 12), 0, 64)
  positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (8, 12))
  params = dropless.init(jax.random.key(0))

  def loss(model, p, replay=None):
    logits, _, aux = model.forward(p, tokens, positions, replay=replay)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0]), (logits, aux)

  (_, (ref_logits, ref_aux)), ref_grads = jax.jit(jax.value_and_grad(
      lambda p: loss(dropless, p), has_aux=True))(params)
  mesh = mesh_lib.build_mesh(parse_flag("data=2,expert=4"), spec)
  sizes = rules.mesh_sizes(mesh)
  with jax.set_mesh(mesh):
    sharded = jax.device_put(params, mesh_lib.param_shardings(ep_model, mesh))
    (_, (logits, aux)), grads = jax.jit(jax.value_and_grad(
        lambda p: loss(ep_model, p), has_aux=True))(sharded)
    replay = replay_from_aux(aux)
    replayed = jax.jit(lambda p: loss(ep_model, p, replay)[1][0])(sharded)
  del sizes
  return {
      "forward_max_abs_diff": float(jnp.abs(logits - ref_logits).max()),
      "grad_max_abs_diff": max(float(jnp.abs(a - b).max()) for a, b in
                               zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))),
      "grad_scale": max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads)),
      "replay_max_abs_diff": float(jnp.abs(replayed - logits).max()),
      "routing_equal": all(bool(jnp.all(a["experts"] == b["experts"]))
                           for a, b in zip(aux["layers"], ref_aux["layers"])),
      "dropped": [int(layer["dropped_assignments"]) for layer in aux["layers"]],
      "routed": [int(layer["routed_assignments"]) for layer in aux["layers"]],
  }


if __name__ == "__main__":
  main()
