"""Expert parallelism with jax.shard_map: tokens go to their experts' shard and come back.

Two paths, chosen by config.model.moe.dispatch, over the context mesh's `expert` axis.

The fixed-capacity path (`all_to_all_moe`, 'all_to_all'), which XLA:CPU runs, the oracle:

  1. On each shard, each of its B*T*P token-expert assignments gets a slot in its expert's
     buffer of C = ceil(capacity_factor * assignments / E) rows, in token order. An
     assignment past C is dropped and counted (`dropped`), never silently.
  2. The [E, C, D] buffer splits by owning shard ([EP, E/EP, C, D]) and one all_to_all
     over the `expert` axis brings each shard the rows for its experts from every shard.
  3. Each shard runs its E/EP experts' SwiGLU on their EP*C rows.
  4. A second all_to_all returns the rows; each assignment reads its row back and the P
     outputs combine by gate, in float32.

The dropless path (`ragged_all_to_all_moe`, 'ragged_all_to_all') for TPU and GPU:

  1. Each shard sorts its valid assignments by expert; the rows for each owner shard are
     then one contiguous chunk.
  2. One all_to_all of the per-expert counts tells every owner how many rows each source
     sends for each of its experts; `jax.lax.ragged_all_to_all` sends exactly those rows.
  3. The owner sorts what it received by local expert and runs the SwiGLU with ragged_dot.
  4. A second ragged_all_to_all returns each chunk to its source, which unsorts and
     combines by gate in float32. Nothing is dropped; the receive buffer holds the worst
     case (every source's rows at one owner).

XLA:CPU has no ragged_all_to_all, so there the same algorithm runs on
`emulated_ragged_all_to_all` (the primitive's documented semantics, from all_to_all and
scatters): the CPU tests hold the whole dropless path against the single-device MoE and
the capacity path, and a lowering test holds that the real primitive is what TPU/GPU get.

With no assignment dropped either path is the dropless forward (moe.py), and so are its
gradients: every op is a gather, a scatter, a matmul or a collective.

Axis letters: moe.py's, plus r a buffer row, o the EP source or owner shard.
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
  return _shard_mapped(functools.partial(_local, capacity_factor=capacity_factor),
                       x_btd, experts_btp, gates_btp, valid_bt, w_gate_edf, w_up_edf,
                       w_down_efd, mesh=mesh)


def _shard_mapped(local, x_btd, experts_btp, gates_btp, valid_bt, w_gate_edf, w_up_edf,
                  w_down_efd, *, mesh):
  """`local(...)` per shard: tokens over the batch axes, experts over `expert`; a batch the
  shards do not divide gets idle rows."""
  sizes = rules.mesh_sizes(mesh)
  if "expert" not in sizes:
    raise ValueError(f"expert parallelism needs a mesh with an 'expert' axis; got {sizes}.")
  ep = sizes["expert"]
  if w_gate_edf.shape[0] % ep:
    raise ValueError(f"config.mesh.expert={ep} does not divide config.model.moe.num_experts="
                     f"{w_gate_edf.shape[0]}.")
  batch = tuple(a for a in rules.BATCH_AXES if a in sizes)
  rows = rules.batch_shards(sizes)
  b = x_btd.shape[0]
  pad = -b % rows
  if pad:  # A batch the shards do not divide (one prefill row, say): idle rows, not routed.
    grow = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    x_btd, experts_btp, gates_btp, valid_bt = map(grow, (x_btd, experts_btp, gates_btp,
                                                         valid_bt))
  fn = jax.shard_map(
      functools.partial(local, ep=ep, axes=batch), mesh=mesh,
      in_specs=(P(batch), P(batch), P(batch), P(batch), P("expert"), P("expert"),
                P("expert")),
      out_specs=(P(batch), P()))
  y_btd, counts = fn(x_btd, experts_btp, gates_btp, valid_bt, w_gate_edf, w_up_edf,
                     w_down_efd)
  return y_btd[:b], {"dropped": counts[0], "assignments": counts[1]}

def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all's semantics (one slice per peer) from all_to_all and
  scatters, for backends without the primitive (XLA:CPU). Each chunk travels padded to
  the operand's rows, so it moves more bytes than the primitive: an oracle, not a fast path."""
  n, rest = operand.shape[0], operand.shape[1:]
  rows_r = jnp.arange(n)
  take_or = input_offsets[:, None] + rows_r[None]
  sent_or = rows_r[None] < send_sizes[:, None]
  chunks = jnp.where(sent_or.reshape(sent_or.shape + (1,) * len(rest)),
                     operand[jnp.clip(take_or, 0, n - 1)], 0)
  received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)
  at_o = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
  dest_or = jnp.where(rows_r[None] < recv_sizes[:, None], at_o[:, None] + rows_r[None],
                      output.shape[0])  # Past the end: not written.
  return output.at[dest_or.reshape(-1)].set(received.reshape((-1,) + rest), mode="drop")


def _exclusive_cumsum(x):
  return jnp.cumsum(x) - x


def _local_ragged(x_btd, experts_btp, gates_btp, valid_bt, w_gate_edf, w_up_edf, w_down_efd,
                  *, ep: int, axes: tuple[str, ...], exchange, expert_fn):
  b, t, p = experts_btp.shape
  d = x_btd.shape[-1]
  e_local = w_gate_edf.shape[0]
  num_experts = e_local * ep
  a = b * t * p
  valid_a = jnp.repeat(valid_bt.reshape(b * t), p)
  key_a = jnp.where(valid_a, experts_btp.reshape(a), num_experts)  # Padding sorts last.
  order_a = jnp.argsort(key_a, stable=True)
  x_sorted_ad = x_btd.reshape(b * t, d)[order_a // p]
  sizes_oe = jnp.bincount(key_a, length=num_experts + 1)[:num_experts].astype(
      jnp.int32).reshape(ep, e_local)
  send_o = sizes_oe.sum(axis=1)
  send_offsets_o = _exclusive_cumsum(send_o)
  # Rows each source sends me per local expert, and where my chunk lands at each owner:
  # after the chunks of the sources before me.
  recv_oe = jax.lax.all_to_all(sizes_oe, "expert", 0, 0, tiled=True)
  recv_o = recv_oe.sum(axis=1)
  sends_oo = jax.lax.all_gather(send_o, "expert")  # [source, owner]
  before_o = jnp.arange(ep) < jax.lax.axis_index("expert")
  land_offsets_o = jnp.sum(jnp.where(before_o[:, None], sends_oo, 0), axis=0)
  cap = ep * a  # Dropless: every source's rows could come to one owner.
  recv_rd = exchange(x_sorted_ad, jnp.zeros((cap, d), x_btd.dtype), send_offsets_o, send_o,
                     land_offsets_o, recv_o, axis_name="expert")
  # Received rows run source-major, each source's sorted by expert: regroup by expert.
  ends = jnp.cumsum(recv_oe.reshape(-1))
  segment_r = jnp.searchsorted(ends, jnp.arange(cap), side="right")
  local_r = jnp.where(segment_r < ep * e_local, segment_r % e_local, e_local)
  order_r = jnp.argsort(local_r, stable=True)
  y_sorted_rd = expert_fn(recv_rd[order_r], w_gate_edf, w_up_edf, w_down_efd,
                          recv_oe.sum(axis=0))
  y_rd = y_sorted_rd[jnp.argsort(order_r)]
  # Each chunk goes back to where its source sent it from.
  their_offsets_o = jax.lax.all_to_all(send_offsets_o, "expert", 0, 0, tiled=True)
  back_ad = exchange(y_rd, jnp.zeros((a, d), x_btd.dtype), _exclusive_cumsum(recv_o), recv_o,
                     their_offsets_o, send_o, axis_name="expert")
  y_ad = jnp.where(valid_a[:, None], back_ad[jnp.argsort(order_a)], 0)
  y_btd = jnp.einsum("btpd,btp->btd", y_ad.reshape(b, t, p, d).astype(jnp.float32),
                     gates_btp, precision=jax.lax.Precision.HIGHEST).astype(x_btd.dtype)
  counts = jnp.stack([jnp.int32(0), jnp.sum(valid_a).astype(jnp.int32)])
  return y_btd, jax.lax.psum(counts, axes)


def default_exchange():
  """The primitive where the backend has it; its emulation on XLA:CPU."""
  if jax.default_backend() == "cpu":
    return emulated_ragged_all_to_all
  return jax.lax.ragged_all_to_all


def ragged_all_to_all_moe(x_btd, experts_btp, gates_btp, valid_bt, w_gate_edf, w_up_edf,
                          w_down_efd, *, mesh, expert_fn, exchange=None):
  """(y_btd, {"dropped": 0, "assignments"}): the dropless expert-parallel MoE over `mesh`.
  expert_fn(x_rd, w_gate, w_up, w_down, group_sizes_e): the experts on rows sorted by
  expert, rows past the groups giving 0 (moe.py's ragged_dot SwiGLU); exchange: the ragged
  all_to_all (default_exchange())."""
  return _shard_mapped(
      functools.partial(_local_ragged, exchange=exchange or default_exchange(),
                        expert_fn=expert_fn),
      x_btd, experts_btp, gates_btp, valid_bt, w_gate_edf, w_up_edf, w_down_efd, mesh=mesh)
