"""Expert parallelism with jax.shard_map: tokens go to their experts' shard and come back.

The fixed-capacity path (`all_to_all_moe`), which XLA:CPU runs, so it is the oracle for any
dropless ragged path on TPU/GPU (jax.lax.ragged_all_to_all has no CPU lowering):

  1. On each shard, each of its B*T*P token-expert assignments gets a slot in its expert's
     buffer of C = ceil(capacity_factor * assignments / E) rows, in token order. An
     assignment past C is dropped and counted (`dropped`), never silently.
  2. The [E, C, D] buffer splits by owning shard ([EP, E/EP, C, D]) and one all_to_all
     over the `expert` axis brings each shard the rows for its experts from every shard.
  3. Each shard runs its E/EP experts' SwiGLU on their EP*C rows.
  4. A second all_to_all returns the rows; each assignment reads its row back and the P
     outputs combine by gate, in float32.

With no assignment dropped this is the dropless forward (moe.py), and so are its
gradients: every op is a gather, a scatter, a matmul or an all_to_all.

Axis letters: moe.py's, plus r a buffer row (C of them per expert and source shard), o the
EP source or owner shard.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from agentic_rl.parallel import rules


def capacity(assignments: int, num_experts: int, capacity_factor: float) -> int:
  """Rows per expert per source shard: capacity_factor times an even share, at least 1."""
  if capacity_factor <= 0:
    raise ValueError(f"config.model.moe.capacity_factor={capacity_factor}: expected > 0.")
  return max(1, math.ceil(capacity_factor * assignments / num_experts))


def _slots(experts_a, valid_a, num_experts: int, cap: int):
  """Each assignment's row in its expert's buffer (token order) and whether it fits."""
  onehot_ae = (experts_a[:, None] == jnp.arange(num_experts)) & valid_a[:, None]
  rank_a = jnp.sum(jnp.cumsum(onehot_ae, axis=0) * onehot_ae, axis=-1) - 1
  keep_a = valid_a & (rank_a < cap)
  return jnp.where(keep_a, rank_a, cap), keep_a  # Row `cap` is out of range: dropped.


def _local(x_btd, experts_btp, gates_btp, valid_bt, w_gate_edf, w_up_edf, w_down_efd, *,
           ep: int, capacity_factor: float, axes: tuple[str, ...]):
  b, t, p = experts_btp.shape
  d = x_btd.shape[-1]
  e_local = w_gate_edf.shape[0]
  num_experts = e_local * ep
  a = b * t * p
  cap = capacity(a, num_experts, capacity_factor)
  experts_a = experts_btp.reshape(a)
  valid_a = jnp.repeat(valid_bt.reshape(b * t), p)
  rows_a, keep_a = _slots(experts_a, valid_a, num_experts, cap)
  x_ad = jnp.repeat(x_btd.reshape(b * t, d), p, axis=0)
  send_erd = jnp.zeros((num_experts, cap, d), x_btd.dtype).at[experts_a, rows_a].set(
      x_ad, mode="drop")
  recv_oerd = jax.lax.all_to_all(send_erd.reshape(ep, e_local, cap, d), "expert", 0, 0,
                                 tiled=True)
  h_erd = recv_oerd.transpose(1, 0, 2, 3).reshape(e_local, ep * cap, d)
  gate_erf = jnp.einsum("erd,edf->erf", h_erd, w_gate_edf)
  up_erf = jnp.einsum("erd,edf->erf", h_erd, w_up_edf)
  y_erd = jnp.einsum("erf,efd->erd", jax.nn.silu(gate_erf) * up_erf, w_down_efd)
  y_oerd = y_erd.reshape(e_local, ep, cap, d).transpose(1, 0, 2, 3)
  back_erd = jax.lax.all_to_all(y_oerd, "expert", 0, 0, tiled=True).reshape(
      num_experts, cap, d)
  y_ad = back_erd.at[experts_a, rows_a].get(mode="fill", fill_value=0)
  y_btpd = jnp.where(keep_a[:, None], y_ad, 0).reshape(b, t, p, d)
  y_btd = jnp.einsum("btpd,btp->btd", y_btpd.astype(jnp.float32), gates_btp,
                     precision=jax.lax.Precision.HIGHEST).astype(x_btd.dtype)
  counts = jnp.stack([jnp.sum(valid_a & ~keep_a), jnp.sum(valid_a)]).astype(jnp.int32)
  return y_btd, jax.lax.psum(counts, axes)


def all_to_all_moe(x_btd, experts_btp, gates_btp, valid_bt, w_gate_edf, w_up_edf,
                   w_down_efd, *, mesh, capacity_factor: float):
  """(y_btd, {"dropped", "assignments"}): the routed experts' output over `mesh`, tokens
  sharded over the batch axes, experts over `expert`. Dropped assignments contribute 0."""
  sizes = rules.mesh_sizes(mesh)
  if "expert" not in sizes:
    raise ValueError(f"expert parallelism needs a mesh with an 'expert' axis; got {sizes}.")
  ep = sizes["expert"]
  if w_gate_edf.shape[0] % ep:
    raise ValueError(f"config.mesh.expert={ep} does not divide config.model.moe.num_experts="
                     f"{w_gate_edf.shape[0]}.")
  batch = tuple(a for a in rules.BATCH_AXES if a in sizes)
  rows = math.prod(sizes[a] for a in batch)
  b = x_btd.shape[0]
  pad = -b % rows
  if pad:  # A batch the shards do not divide (one prefill row, say): idle rows, not routed.
    grow = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    x_btd, experts_btp, gates_btp, valid_bt = map(grow, (x_btd, experts_btp, gates_btp,
                                                         valid_bt))
  fn = jax.shard_map(
      functools.partial(_local, ep=ep, capacity_factor=capacity_factor,
                        axes=batch),
      mesh=mesh,
      in_specs=(P(batch), P(batch), P(batch), P(batch), P("expert"), P("expert"),
                P("expert")),
      out_specs=(P(batch), P()))
  y_btd, counts = fn(x_btd, experts_btp, gates_btp, valid_bt, w_gate_edf, w_up_edf,
                     w_down_efd)
  return y_btd[:b], {"dropped": counts[0], "assignments": counts[1]}
