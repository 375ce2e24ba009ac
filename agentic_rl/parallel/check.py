"""A model sharded over a mesh against the same model on one device: launch.check_sharding.

`compare` runs the learner's path (forward logits, the loss, every gradient) and the
sampler's (chunked prefill and one-token decode through a KV cache sharded by the rules) on
one device with the dropless MoE, then over the mesh with params born sharded, the batch and
caches sharded by the rules, and the MoE dispatch asked for ('all_to_all', 'ragged_all_to_all': expert parallel).
Capacity overflow of the expert-parallel path is reported, not hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentic_rl.model import transformer
from agentic_rl.model.config import ModelSpec
from agentic_rl.model.transformer import Model
from agentic_rl.parallel import mesh as mesh_lib
from agentic_rl.parallel import rules
from agentic_rl.parallel.mesh_config import MeshSpec


def loss_fn(model, params, tokens, positions):
  """Next-token NLL plus the MoE load-balancing loss; (loss, (logits, aux))."""
  logits, _, aux = model.forward(params, tokens[:, :-1], positions[:, :-1])
  logp = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
  return nll + aux["moe_aux_loss"], (logits, aux)


def sampler_logp(model, params, tokens, positions, place_cache=lambda c: c):
  """Log-probs through the sampler's path: a prefill of half, then one-token decodes."""
  b, t = tokens.shape
  spec = model.spec
  capacity = -(-t // spec.block_size) * spec.block_size
  cache = place_cache(model.init_cache(b, capacity))
  step = jax.jit(model.forward)
  half = t // 2
  out = []
  for start, stop in [(0, half)] + [(i, i + 1) for i in range(half, t)]:
    logits, cache, _ = step(params, tokens[:, start:stop], positions[:, start:stop], cache)
    out.append(jax.nn.log_softmax(logits))
  return jnp.concatenate(out, axis=1)


def max_diff(a, b) -> float:
  return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compare(spec: ModelSpec, mesh_spec: MeshSpec, *, batch: int, length: int, seed: int = 0,
            dispatch: str = "all_to_all") -> dict:
  devices = jax.devices()
  sizes = mesh_spec.resolve(len(devices))
  if sizes["expert"] == 1 or not spec.moe.num_experts:
    dispatch = "dropless"
  one_model = Model(spec.replace(moe=spec.moe.replace(dispatch="dropless")))
  model = Model(spec.replace(moe=spec.moe.replace(dispatch=dispatch)))
  tokens = jax.random.randint(jax.random.key(seed + 1), (batch, length), 0, spec.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  grad = lambda m: jax.jit(jax.value_and_grad(  # noqa: E731
      lambda p, x, q: loss_fn(m, p, x, q), has_aux=True))
  with jax.default_device(devices[0]):
    params = one_model.init(jax.random.key(seed))
    (loss, (logits, _)), grads = grad(one_model)(params, tokens, positions)
    logp = sampler_logp(one_model, params, tokens, positions)
    one = jax.device_get({"loss": loss, "logits": logits, "grads": grads, "logp": logp})
  mesh = mesh_lib.build_mesh(mesh_spec, spec, devices)
  with jax.set_mesh(mesh):
    sharded = mesh_lib.init_sharded(model, jax.random.key(seed), mesh)
    rows = jax.sharding.NamedSharding(mesh, rules.batch_spec("bt", tokens.shape, sizes))
    x, q = jax.device_put(tokens, rows), jax.device_put(positions, rows)
    (loss, (logits, aux)), grads = grad(model)(sharded, x, q)
    place = lambda c: jax.device_put(c, rules.named(mesh, rules.cache_specs(c, sizes)))  # noqa: E731
    logp = sampler_logp(model, sharded, x, q, place)
  dropped, routed = (int(c) for c in transformer.expert_overflow(aux["layers"]) or (0, 0))
  return {
      "forward_max_abs_diff": max_diff(one["logits"], logits),
      "loss_abs_diff": max_diff(one["loss"], loss),
      "grad_max_abs_diff": max_diff(one["grads"], grads),
      "sampler_logp_max_abs_diff": max_diff(one["logp"], logp),
      "ep_path": dispatch, "capacity_factor": spec.moe.capacity_factor,
      "devices": len(devices), "mesh": sizes,
      "overflow_frac": dropped / routed if routed else 0.0,
      "params_sharded": sum(not all(s is None for s in leaf.sharding.spec)
                            for leaf in jax.tree.leaves(sharded)),
  }
