"""Run in a subprocess with 8 emulated CPU devices: the trainer's route on a mesh against the
same route on one device, through the trainer's own pieces.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.parallel.sharded_trainer_check \
        data=2,fsdp=2,expert=2 fsdp=2,tensor=2,expert=2

For each mesh, one JSON line: the train state born sharded against one device's; rollouts of
the engine on the mesh (caches sharded) against one device's, same seeds; one RL train step
(PPO epochs of minibatches, expert-parallel MoE at a capacity nothing overflows) on those
trajectories; and how the state and caches are sharded.
"""

import dataclasses
import json
import sys
import tempfile

import jax
import numpy as np

from agentic_rl.parallel import mesh as mesh_lib
from agentic_rl.parallel import placement
from agentic_rl.parallel import rules
from agentic_rl.parallel import check
from agentic_rl.parallel.mesh_config import MeshSpec, parse_flag
from agentic_rl.records.trajectory import to_batch
from agentic_rl.train import sft as sft_lib
from agentic_rl.train.routes import Routes
from agentic_rl.train.trainer import Trainer
from configs import countdown

GROUPS = 4


def tiny_moe_config(mesh_flag: str):
  """configs/countdown.py shrunk to seconds, with an S,S,S,G MoE model and the mesh."""
  config = countdown.get_config()
  m = config.model
  m.num_layers, m.layer_pattern, m.num_heads, m.num_kv_heads, m.head_dim = 4, "SSSG", 4, 2, 8
  m.d_model, m.d_ff, m.num_dense_layers, m.max_seq_len = 32, 64, 1, 256
  m.moe.num_experts, m.moe.num_experts_per_token, m.moe.d_ff_expert = 4, 2, 16
  m.moe.num_shared_experts = 1
  m.moe.dispatch, m.moe.capacity_factor = "all_to_all", 8.0  # Expert parallel, no overflow.
  r = config.rollout
  r.num_slots, r.max_len, r.group_size, r.max_turns, r.max_new_tokens_per_turn = 8, 256, 2, 2, 8
  config.rl.ppo_epochs, config.rl.minibatches = 2, 2
  config.rl.optim.warmup_steps = 0  # The first update moves the params (warmup starts at 0).
  config.train.groups_per_step = GROUPS
  sizes = parse_flag(mesh_flag)
  for axis in ("data", "fsdp", "tensor", "expert"):
    setattr(config.mesh, axis, getattr(sizes, axis))
  return config


def max_diff(a, b) -> float:
  return check.max_diff(jax.device_get(a), jax.device_get(b))


def sharded_leaves(tree) -> int:
  return sum(not all(s is None for s in x.sharding.spec) for x in jax.tree.leaves(tree))


def off_rules(tree, mesh) -> int:
  """Leaves whose sharding is not the rules' (each would be resharded after a step)."""
  want = jax.tree.leaves(placement.state_shardings(tree, mesh))
  return sum(not x.sharding.is_equivalent_to(s, x.ndim)
             for x, s in zip(jax.tree.leaves(tree), want))


def with_informative_rewards(trajs):
  """The first of each group solved, the rest not: a random tiny model solves nothing, and
  with every advantage 0 only weight decay would move the params."""
  seen = set()
  out = []
  for t in trajs:
    out.append(dataclasses.replace(t, reward=float(t.group_id not in seen)))
    seen.add(t.group_id)
  return out


def rollouts_and_step(route, tasks):
  state = route.init_state(0)
  route.engine.set_params(route.sampler_params(state.params), 0)
  trajs = with_informative_rewards(route.engine.run(tasks, task_seeds=list(range(len(tasks)))))
  longest = max(t.length for t in trajs)
  batch = to_batch(trajs, length=sft_lib.padded_length(longest, route.rollout_spec.max_len))
  rows = placement.place_rows(route.mesh, batch)
  with jax.set_mesh(route.mesh):
    # The route's step donates its state: step a copy, keep this one to compare.
    stepped, metrics = route.train_step(jax.tree.map(lambda x: x.copy(), state), rows)
  return state, trajs, stepped, jax.device_get(metrics), rows


def compare(mesh_flag: str) -> dict:
  config = tiny_moe_config(mesh_flag)
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer(config, workdir)  # Builds the mesh from config.mesh, every device.
    try:
      tier = trainer.env_spec.default_tier
      tasks = [trainer.tasks.task(trainer.tasks.next_task(tier)) for _ in range(GROUPS)]
      one_mesh = mesh_lib.build_mesh(MeshSpec(data=1), None, jax.devices()[:1])
      one_routes = Routes(config, trainer.train_spec, trainer.tokenizer,
                          trainer.env_factory, one_mesh)
      try:
        one = rollouts_and_step(one_routes.for_step(0), tasks)
      finally:
        one_routes.close()
      route = trainer.routes.for_step(0)
      state, trajs, stepped, metrics, rows = rollouts_and_step(route, tasks)
      mesh = trainer.mesh
      cache = route.engine.cache
      return {
          "mesh": rules.mesh_sizes(mesh),
          "init_max_abs_diff": max_diff(one[0], state),
          "state_leaves_sharded": sharded_leaves(state),
          "state_leaves": len(jax.tree.leaves(state)),
          "moments_sharded": sharded_leaves(state.opt_state),
          "cache_leaves_sharded": sharded_leaves(cache),
          "cache_devices": len(jax.tree.leaves(cache)[0].sharding.device_set),
          "batch_rows_sharded": sharded_leaves(rows),
          "tokens_equal": all(np.array_equal(a.tokens, b.tokens) for a, b in zip(one[1], trajs)),
          "trajectories": len(trajs),
          "sampler_logp_max_abs_diff": max(float(np.max(np.abs(a.sampler_logp - b.sampler_logp)))
                                           for a, b in zip(one[1], trajs)),
          "step_params_max_abs_diff": max_diff(one[2].params, stepped.params),
          "step_params_change": max_diff(state.params, stepped.params),
          "step_loss_abs_diff": abs(float(one[3]["loss"]) - float(metrics["loss"])),
          "overflow_frac": float(metrics["moe/overflow_frac"]),
          # Sampler = learner on the mesh: the learner's first scoring of the batch against
          # the engine's log-probs, both sharded (the step's mismatch metrics).
          "mismatch_k3": float(metrics["mismatch/k3"]),
          "one_device_mismatch_k3": float(one[3]["mismatch/k3"]),
          "sampler_overflow": [route.engine.stats.dropped_assignments,
                               route.engine.stats.routed_assignments],
          "stepped_off_rules": off_rules(stepped, mesh),
      }
    finally:
      trainer.close()


if __name__ == "__main__":
  for flag in sys.argv[1:]:
    print(json.dumps({"flag": flag, **compare(flag)}), flush=True)
