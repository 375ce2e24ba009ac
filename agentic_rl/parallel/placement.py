"""Trees placed on a mesh by the rules: the train state, host trees, batches and the
sampler's copy of the params.

    shardings = state_shardings(state_layout, mesh)   # params, moments, ref: rules.py
    state = place(state, shardings)                   # a no-op where a leaf already is
    batch = place_rows(mesh, local_batch)             # rows over the batch axes
    sampler = sampler_mesh(mesh)                      # rollout's devices: this process's

One process: rollout runs on the learner's mesh and takes its params as they are (the
same shardings, no copy). Several processes: each samples its own tasks alone, so its
engine runs on a mesh of its own devices (as much of the tensor, expert and fsdp axes as
they hold), and gets the params gathered once per step.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from agentic_rl.parallel import rules
from agentic_rl.parallel.mesh_config import AXES


def state_shardings(tree, mesh: Mesh):
  """NamedShardings of params, optimiser moments, a KL reference or a whole TrainState
  (any tree whose array leaves sit under param names; scalars are replicated)."""
  return rules.named(mesh, rules.param_specs(tree, rules.mesh_sizes(mesh)))


def _is_placed(x, sharding) -> bool:
  return isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim)


def place(tree, shardings):
  """`tree` with each leaf on its sharding. Leaves already there are kept as they are;
  device arrays move device to device; host values (identical on every process) are cut
  into their shards without ever being whole on one device."""
  def one(x, sharding):
    if _is_placed(x, sharding):
      return x
    if jax.process_count() == 1:
      return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # Global: reshard on device.
      return jax.jit(lambda y: y, out_shardings=sharding)(x)
    # A host value, or a process-local array (the same on every process): cut into shards.
    # (device_put of a local array onto a sharding that spans processes builds an array
    # whose per-device buffers are not single shards, which orbax cannot save.)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  return jax.tree.map(one, tree, shardings)


def row_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """Rows (axis 0) over the mesh's batch axes that divide them; other axes whole."""
  return NamedSharding(mesh, rules.batch_spec("b" + "_" * (len(shape) - 1), shape,
                                              rules.mesh_sizes(mesh)))


def place_rows(mesh: Mesh, local_tree, process_count: int = 1):
  """A batch with rows over the mesh's batch axes (data x fsdp x expert). With several
  processes each gives its own rows and the leaves become global arrays, so the rows
  must divide over the batch axes; one process's rows that do not divide stay whole."""
  def one(x):
    x = np.asarray(x)
    if process_count == 1:
      return jax.device_put(x, row_sharding(mesh, x.shape))
    global_shape = (x.shape[0] * process_count,) + x.shape[1:]
    sharding = row_sharding(mesh, global_shape)
    shards = rules.batch_shards(rules.mesh_sizes(mesh))
    if sharding.spec[0] is None and shards > 1:
      raise ValueError(
          f"a batch of {global_shape[0]} rows ({x.shape[0]} per process) does not divide "
          f"over the mesh's batch axes ({shards} shards: config.mesh data x "
          "fsdp x expert): make config.train.groups_per_step x config.rollout.group_size "
          "(RL) or config.train.sft_batch_size (SFT) a multiple of it.")
    return jax.make_array_from_process_local_data(sharding, x, global_shape)
  return jax.tree.map(one, local_tree)


def sampler_mesh(mesh: Mesh) -> Mesh:
  """The mesh this process's rollout engine runs on.

  One process: `mesh` itself. Several: each process samples its own tasks alone, on its own
  devices: as much of the tensor axis as they hold, then of the expert axis, then of fsdp,
  the rest on data. Each local axis divides the learner's, so the model divides over it."""
  if jax.process_count() == 1:
    return mesh
  local = jax.local_devices()
  sizes = rules.mesh_sizes(mesh)
  left = len(local)
  local_sizes = {}
  for axis in ("tensor", "expert", "fsdp"):
    local_sizes[axis] = math.gcd(sizes[axis], left)
    left //= local_sizes[axis]
  local_sizes["data"] = left
  return jax.make_mesh(tuple(local_sizes[a] for a in AXES), AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(AXES), devices=local)


def to_sampler(params, mesh: Mesh):
  """The params as the engine on `mesh` (sampler_mesh) takes them: as they are when they
  already sit there; else gathered to the host once and placed on it by the rules."""
  shardings = state_shardings(params, mesh)
  if all(_is_placed(x, s) for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings))):
    return params
  return jax.tree.map(jax.device_put, to_host(params), shardings)


def to_host(tree):
  """`tree` as host numpy arrays, whole, on every process (gathered where sharded across
  processes)."""
  if jax.process_count() > 1 and any(isinstance(x, jax.Array) and not x.is_fully_addressable
                                     for x in jax.tree.leaves(tree)):
    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_get(tree)
