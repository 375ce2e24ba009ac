"""Run in a subprocess with 8 emulated CPU devices: a sharded model against one device.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.parallel.sharded_equivalence \
        data=8 data=2,fsdp=2,expert=2 fsdp=2,tensor=2,expert=2

Prints one JSON line per mesh: the max |difference| to the one-device result of the forward logits,
the loss, every gradient, the params after one Adam step, and the cached (sampler) path's
log-probs; and how each param is sharded.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from agentic_rl.model.config import ModelSpec, MoESpec
from agentic_rl.model.transformer import Model
from agentic_rl.parallel import mesh as mesh_lib
from agentic_rl.parallel import rules
from agentic_rl.parallel.check import loss_fn, max_diff, sampler_logp
from agentic_rl.parallel.mesh_config import parse_flag

SPEC = ModelSpec(vocab_size=128, d_model=32, num_layers=4, layer_pattern="SSSG", num_heads=4,
                 num_kv_heads=2, head_dim=8, max_seq_len=64, sliding_window=8, block_size=4,
                 topk_tokens=8, num_dense_layers=1, d_ff=64, tie_embeddings=False,
                 moe=MoESpec(num_experts=4, num_experts_per_token=2, d_ff_expert=16,
                             num_shared_experts=1))
B, T = 8, 24
LR, EPS = 1e-2, 1e-8  # Adam's.
# Where |g| > GRAD_FLOOR, d(step)/dg <= lr * eps / floor^2 = 1e-2: a 1e-5 grad diff moves 1e-7.
GRAD_FLOOR = 1e-4


def run(params, tokens, positions, model, place_cache=lambda c: c):
  (loss, (logits, _)), grads = jax.jit(jax.value_and_grad(
      lambda p: loss_fn(model, p, tokens, positions), has_aux=True))(params)
  opt = optax.adam(LR, eps=EPS)
  updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  stepped = jax.jit(optax.apply_updates)(params, updates)
  return {"logits": logits, "loss": loss, "grads": grads, "stepped": stepped,
          "sampler_logp": sampler_logp(model, params, tokens, positions, place_cache)}


def adam_first_step_f64(params, grads):
  """Adam's first step in float64 numpy: bias correction makes it p - lr * g / (|g| + eps)."""
  return jax.tree.map(lambda p, g: np.asarray(p, np.float64) - LR * np.asarray(g, np.float64)
                      / (np.abs(np.asarray(g, np.float64)) + EPS), params, grads)


def step_diffs(one, params, sharded, floor: float) -> tuple[float, float]:
  """(sharded step against float64 Adam on its own grads, sharded step against the one-device
  step where |g| > floor). Below the floor g / (|g| + eps) turns on reduction-order noise."""
  own = max_diff(adam_first_step_f64(jax.device_get(params), jax.device_get(sharded["grads"])),
                 jax.device_get(sharded["stepped"]))
  conditioned = 0.0
  for g, a, b in zip(jax.tree.leaves(one["grads"]), jax.tree.leaves(one["stepped"]),
                     jax.tree.leaves(jax.device_get(sharded["stepped"]))):
    keep = np.abs(np.asarray(g)) > floor
    if keep.any():
      conditioned = max(conditioned, float(np.max(np.abs(np.asarray(a) - np.asarray(b))[keep])))
  return own, conditioned


def main(mesh_flags: list[str]):
  model = Model(SPEC)
  devices = jax.devices()
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, SPEC.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  with jax.default_device(devices[0]):
    one_params = model.init(jax.random.key(0))
    one = jax.device_get(run(one_params, tokens, positions, model))
  for flag in mesh_flags:
    compare(model, devices, tokens, positions, one_params, one, flag)


def compare(model, devices, tokens, positions, one_params, one, mesh_flag):
  mesh = mesh_lib.build_mesh(parse_flag(mesh_flag), SPEC, devices)
  sizes = rules.mesh_sizes(mesh)
  params = mesh_lib.init_sharded(model, jax.random.key(0), mesh)
  batch = jax.sharding.NamedSharding(mesh, rules.batch_spec("bt", (B, T), sizes))
  place_cache = lambda c: jax.device_put(c, rules.named(mesh, rules.cache_specs(c, sizes)))  # noqa: E731
  sharded = run(params, jax.device_put(tokens, batch), jax.device_put(positions, batch), model,
                place_cache)
  step_own, step_conditioned = step_diffs(one, params, sharded, GRAD_FLOOR)
  specs = {"/".join(str(getattr(k, "key", k)) for k in path): str(leaf.sharding.spec)
           for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  print(json.dumps({
      "mesh": sizes, "devices": len(devices),
      "init_max_abs_diff": max_diff(one_params, params),
      "forward_max_abs_diff": max_diff(one["logits"], sharded["logits"]),
      "loss_abs_diff": max_diff(one["loss"], sharded["loss"]),
      "grad_max_abs_diff": max_diff(one["grads"], sharded["grads"]),
      "step_max_abs_diff": max_diff(one["stepped"], sharded["stepped"]),
      "step_vs_f64_adam_max_abs_diff": step_own,
      "step_where_grad_above_floor_max_abs_diff": step_conditioned,
      "grad_floor": GRAD_FLOOR,
      "sampler_logp_max_abs_diff": max_diff(one["sampler_logp"], sharded["sampler_logp"]),
      "param_specs": specs,
      "params_sharded": sum(not all(s is None for s in leaf.sharding.spec)
                            for leaf in jax.tree.leaves(params)),
  }))


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main(sys.argv[1:])
