"""Sparse MoE feed-forward: top-k routing, dropless ragged_dot dispatch, replay.

Routing (router in float32, at HIGHEST matmul precision so TPUs do not drop to bf16):
  logits_bte = x @ w_router_de
  scores     = softmax(logits) | sigmoid(logits)          (spec.moe.gate)
  experts    = top_k(scores + stop_gradient(routing_bias_e))  or the forced ones (replay)
  gates      = scores[experts], renormalised to sum 1 if spec.moe.renormalize
The routing bias only moves the selection, never the gate values, so it gets no gradient;
the learner updates it outside the gradient with `update_routing_bias`.

Routing replay (R3, "Keep Routing"): `forced_experts_btp` (recorded by the sampler in
aux['experts']) replaces the top-k, while the gates still come from the current router,
so the router keeps learning and the learner's forward takes the sampler's expert paths.

Dispatch is dropless by default: the B*T*P token-expert assignments are sorted by expert
(stable), and each expert's SwiGLU runs on its contiguous rows via `jax.lax.ragged_dot`, or
(moe.expert_matmul, the default on CPU) batched matmuls over each expert's rows padded to
a static bound, falling back to ragged_dot for a call where a group passes it. No
capacity, no dropped token; an expert with zero rows is just an empty group. With
moe.dispatch='all_to_all' the experts are spread over the mesh's `expert` axis
(agentic_rl/parallel/expert_parallel.py): equal to dropless while no expert overflows its
capacity; overflow is counted in aux.

Axis letters (those of attention.py where they meet): b batch, t time, d d_model,
e experts, f expert hidden, p the P = num_experts_per_token experts a token uses (its
top-k), a one token-expert assignment (B*T*P of them, token-major).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from agentic_rl.model.config import ModelSpec
from agentic_rl.model.feedforward import DenseFeedForward, fan_in_init
from agentic_rl.parallel import expert_parallel

# Stacked [E, in, out] expert weights: fan-in is the `in` axis, E is a batch axis.
expert_init = jax.nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,))


def router_scores(logits_bte: jax.Array, gate: str) -> jax.Array:
  """Per-expert scores from float32 router logits."""
  if gate == "softmax":
    return jax.nn.softmax(logits_bte, axis=-1)
  if gate == "sigmoid":
    return jax.nn.sigmoid(logits_bte)
  raise ValueError(f"gate={gate!r}: expected 'softmax' or 'sigmoid'.")


def update_routing_bias(bias_e: jax.Array, expert_load_e: jax.Array,
                        rate: float) -> jax.Array:
  """Aux-loss-free balancing step (DeepSeek-V3): bias += rate * sign(mean_load - load).

  Under-loaded experts get a higher bias (picked more often), over-loaded ones a lower.
  The learner applies this outside the gradient, once per step, to every MoE layer's
  'routing_bias_e' with that layer's aux['expert_load'] (averaged over the global
  batch, e.g. pmean across data-parallel devices, so every replica stays identical).
  An all-zero load (no valid token) leaves the bias unchanged.
  """
  load = expert_load_e.astype(jnp.float32)
  step = rate * jnp.sign(jnp.mean(load) - load)
  return (bias_e.astype(jnp.float32) + step).astype(bias_e.dtype)


def _ragged_swiglu(x_ad: jax.Array, w_gate_edf: jax.Array, w_up_edf: jax.Array,
                   w_down_efd: jax.Array, group_sizes_e: jax.Array) -> jax.Array:
  """SwiGLU of each row by its expert; rows sorted by expert, group_sizes_e rows each
  (rows past their sum give 0: ragged_dot's rule, which the ragged EP buffer relies on)."""
  gate_af = jax.lax.ragged_dot(x_ad, w_gate_edf, group_sizes_e)
  up_af = jax.lax.ragged_dot(x_ad, w_up_edf, group_sizes_e)
  return jax.lax.ragged_dot(jax.nn.silu(gate_af) * up_af, w_down_efd, group_sizes_e)


def group_bound(num_rows: int, num_experts: int) -> int:
  """Rows per expert the grouped path pads to: twice an even share, a multiple of 8, at
  most every row."""
  share = -(-2 * num_rows // num_experts)
  return min(num_rows, -(-share // 8) * 8)


def _grouped_swiglu(x_ad: jax.Array, w_gate_edf: jax.Array, w_up_edf: jax.Array,
                    w_down_efd: jax.Array, group_sizes_e: jax.Array) -> jax.Array:
  """`_ragged_swiglu` by batched matmuls over each expert's rows padded to `group_bound`
  (c: a row within an expert's padded block): only the rows an expert owns are computed.
  Exact only while no group passes the bound; `_routed_swiglu` checks that."""
  a = x_ad.shape[0]
  num_experts = group_sizes_e.shape[0]
  c = group_bound(a, num_experts)
  starts_e = jnp.cumsum(group_sizes_e) - group_sizes_e
  valid_ec = jnp.arange(c)[None, :] < group_sizes_e[:, None]
  rows_ec = jnp.where(valid_ec, starts_e[:, None] + jnp.arange(c)[None, :], a)
  x_ecd = jnp.take(x_ad, rows_ec, axis=0, mode="fill", fill_value=0)
  gate_ecf = jnp.einsum("ecd,edf->ecf", x_ecd, w_gate_edf)
  up_ecf = jnp.einsum("ecd,edf->ecf", x_ecd, w_up_edf)
  y_ecd = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate_ecf) * up_ecf, w_down_efd)
  return jnp.zeros_like(x_ad).at[rows_ec].set(y_ecd, mode="drop")


def _routed_swiglu(x_ad, w_gate_edf, w_up_edf, w_down_efd, group_sizes_e, *,
                   expert_matmul: str = "auto"):
  """The experts' SwiGLU on rows sorted by expert (config.model.moe.expert_matmul)."""
  if expert_matmul == "auto":
    expert_matmul = "grouped" if jax.default_backend() == "cpu" else "ragged_dot"
  args = (x_ad, w_gate_edf, w_up_edf, w_down_efd, group_sizes_e)
  bound = group_bound(x_ad.shape[0], group_sizes_e.shape[0])
  if expert_matmul == "ragged_dot" or bound >= x_ad.shape[0]:  # No rows to save.
    return _ragged_swiglu(*args)
  return jax.lax.cond(jnp.max(group_sizes_e) <= bound, _grouped_swiglu, _ragged_swiglu, *args)


class MoEFeedForward(nn.Module):
  """Routed experts (+ optional shared experts) for one MoE layer.

  Params: w_router_de [D, E]; routing_bias_e [E] (float32, only if use_routing_bias);
  w_gate_edf, w_up_edf [E, D, F]; w_down_efd [E, F, D]; shared_experts/ (a
  DenseFeedForward with d_ff = num_shared_experts * d_ff_expert) if num_shared_experts.
  """

  spec: ModelSpec

  @nn.compact
  def __call__(self, x_btd: jax.Array, valid_bt: jax.Array,
               forced_experts_btp: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Returns (y_btd, aux).

    valid_bt: bool [B, T], False on padding; padding is excluded from the load
      statistics and the aux loss (its output is finite but meaningless).
    forced_experts_btp: int [B, T, P] experts to use instead of the top-P (replay);
      on valid tokens values must lie in [0, num_experts) (an out-of-range id gives
      NaN gates); padding rows may hold anything.
    aux: 'experts' int32 [B,T,P] (used experts), 'gates' float32 [B,T,P],
      'expert_load' float32 [E] (fraction of valid assignments per expert),
      'aux_loss' float32 [] (coef * E * sum_e f_e * P_e over valid tokens).
    """
    s, m = self.spec, self.spec.moe
    _check_inputs(s, x_btd, valid_bt, forced_experts_btp)
    num_experts, d_ff = m.num_experts, m.d_ff_expert
    d = s.d_model
    dtype, param_dtype = jnp.dtype(s.dtype), jnp.dtype(s.param_dtype)
    w_router_de = self.param("w_router_de", fan_in_init, (d, num_experts), param_dtype)
    bias_e = None
    if m.use_routing_bias:
      # float32 always: rate-1e-3 steps would vanish in a bf16 bias. Created under
      # replay too, so both paths share one param tree.
      bias_e = self.param("routing_bias_e", nn.initializers.zeros, (num_experts,),
                          jnp.float32)
    w_gate_edf = self.param("w_gate_edf", expert_init, (num_experts, d, d_ff), param_dtype)
    w_up_edf = self.param("w_up_edf", expert_init, (num_experts, d, d_ff), param_dtype)
    w_down_efd = self.param("w_down_efd", expert_init, (num_experts, d_ff, d), param_dtype)

    # Router in float32.
    logits_bte = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32),
                            w_router_de.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
    scores_bte = router_scores(logits_bte, m.gate)
    experts_btp, gates_btp = select_experts(scores_bte, bias_e, forced_experts_btp, valid_bt,
                                            m)
    weights = (w_gate_edf.astype(dtype), w_up_edf.astype(dtype), w_down_efd.astype(dtype))
    overflow = {}
    if m.dispatch == "all_to_all":
      y_btd, overflow = expert_parallel.all_to_all_moe(
          x_btd.astype(dtype), experts_btp, gates_btp, valid_bt, *weights,
          mesh=_context_mesh(m.dispatch), capacity_factor=m.capacity_factor)
    elif m.dispatch == "ragged_all_to_all":
      y_btd, overflow = expert_parallel.ragged_all_to_all_moe(
          x_btd.astype(dtype), experts_btp, gates_btp, valid_bt, *weights,
          mesh=_context_mesh(m.dispatch),
          expert_fn=functools.partial(_routed_swiglu, expert_matmul=m.expert_matmul))
    else:
      y_btd = _dispatch(x_btd.astype(dtype), experts_btp, gates_btp, *weights, num_experts,
                        m.expert_matmul)
    if m.num_shared_experts > 0:
      shared = DenseFeedForward(d_ff=m.num_shared_experts * d_ff, dtype=dtype,
                                param_dtype=param_dtype, name="shared_experts")
      y_btd = y_btd + shared(x_btd)
    expert_load_e, aux_loss = _load_statistics(experts_btp, scores_bte, valid_bt, m)
    aux = {
        "experts": experts_btp,
        "gates": gates_btp.astype(jnp.float32),
        "expert_load": expert_load_e.astype(jnp.float32),
        "aux_loss": aux_loss.astype(jnp.float32),
    }
    if overflow:  # Expert parallel: assignments past capacity, and all valid ones.
      aux["dropped_assignments"] = overflow["dropped"]
      aux["routed_assignments"] = overflow["assignments"]
    return y_btd, aux


def _context_mesh(dispatch: str):
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or "expert" not in mesh.axis_names:
    raise ValueError(f"config.model.moe.dispatch={dispatch!r} runs over a device mesh with an "
                     "'expert' axis: call the model under jax.set_mesh(mesh) (mesh from "
                     "agentic_rl/parallel/mesh.build_mesh).")
  return mesh


def _check_inputs(spec, x_btd, valid_bt, forced_experts_btp) -> None:
  num_experts, p = spec.moe.num_experts, spec.moe.num_experts_per_token
  if num_experts <= 0:
    raise ValueError(f"MoEFeedForward needs spec.moe.num_experts > 0, got {num_experts}.")
  if x_btd.ndim != 3 or x_btd.shape[-1] != spec.d_model:
    raise ValueError(f"MoEFeedForward: x_btd has shape {x_btd.shape}; expected "
                     f"[B, T, d_model={spec.d_model}].")
  b, t, _ = x_btd.shape
  if valid_bt.shape != (b, t):
    raise ValueError(f"MoEFeedForward: valid_bt has shape {valid_bt.shape}; expected "
                     f"{(b, t)} to match x_btd.")
  if forced_experts_btp is not None:
    if forced_experts_btp.shape != (b, t, p):
      raise ValueError(f"MoEFeedForward: forced_experts_btp has shape "
                       f"{forced_experts_btp.shape}; expected {(b, t, p)} "
                       f"(P = num_experts_per_token).")
    if not jnp.issubdtype(forced_experts_btp.dtype, jnp.integer):
      raise ValueError(f"MoEFeedForward: forced_experts_btp has dtype "
                       f"{forced_experts_btp.dtype}; expected an integer dtype.")


def select_experts(scores_bte, bias_e, forced_experts_btp, valid_bt, moe):
  """(experts int32 [B, T, P], gates float32 [B, T, P]): the top-P by score (plus the
  routing bias, which only affects selection), or the forced ones under replay."""
  p, num_experts = moe.num_experts_per_token, moe.num_experts
  if forced_experts_btp is not None:
    # Padding rows of a replayed batch carry no recorded routing: give them valid
    # distinct ids so they stay finite (their output is masked anyway).
    experts_btp = jnp.where(valid_bt[..., None], forced_experts_btp.astype(jnp.int32),
                            jnp.arange(p, dtype=jnp.int32))
  else:
    selection_bte = scores_bte
    if bias_e is not None:
      selection_bte = scores_bte + jax.lax.stop_gradient(bias_e)
    _, experts_btp = jax.lax.top_k(jax.lax.stop_gradient(selection_bte), p)
    experts_btp = experts_btp.astype(jnp.int32)
  gates_btp = jnp.take_along_axis(scores_bte, experts_btp, axis=-1, mode="clip")
  # A forced id outside [0, E) would silently wrap or clip: make it NaN instead.
  in_range_btp = (experts_btp >= 0) & (experts_btp < num_experts)
  gates_btp = jnp.where(in_range_btp, gates_btp, jnp.nan)
  if moe.renormalize:
    gates_btp = gates_btp / jnp.maximum(gates_btp.sum(-1, keepdims=True),
                                        jnp.finfo(jnp.float32).tiny)
  return experts_btp, gates_btp


def _dispatch(x_btd, experts_btp, gates_btp, w_gate_edf, w_up_edf, w_down_efd,
              num_experts: int, expert_matmul: str = "auto"):
  """Dropless: sort assignments by expert, ragged_dot, unsort, combine by gate."""
  b, t, p = experts_btp.shape
  d = x_btd.shape[-1]
  experts_a = experts_btp.reshape(b * t * p)
  # Stable: within an expert, rows keep token order on every backend (deterministic).
  order_a = jnp.argsort(experts_a, stable=True)
  group_sizes_e = jnp.bincount(experts_a, length=num_experts).astype(jnp.int32)
  # Assignment a belongs to token a // P (tokens flattened over B, T).
  x_sorted_ad = x_btd.reshape(b * t, d)[order_a // p]
  y_sorted_ad = _routed_swiglu(x_sorted_ad, w_gate_edf, w_up_edf, w_down_efd, group_sizes_e,
                               expert_matmul=expert_matmul)
  inverse_a = jnp.argsort(order_a)  # sorted position of each assignment
  y_btpd = y_sorted_ad[inverse_a].reshape(b, t, p, d)
  # Combine the P expert outputs in float32, then return to the compute dtype.
  return jnp.einsum("btpd,btp->btd", y_btpd.astype(jnp.float32), gates_btp,
                    precision=jax.lax.Precision.HIGHEST).astype(x_btd.dtype)


def _load_statistics(experts_btp, scores_bte, valid_bt, moe):
  """(expert load [E]: the share of valid assignments per expert, the Switch
  load-balancing loss), over valid tokens only."""
  b, t, p = experts_btp.shape
  num_experts = moe.num_experts
  valid_bt = valid_bt.astype(jnp.float32)
  num_valid = valid_bt.sum()
  valid_a = jnp.repeat(valid_bt.reshape(b * t), p)  # token-major, like experts_a
  assign_counts_e = jnp.bincount(experts_btp.reshape(b * t * p), weights=valid_a,
                                 length=num_experts)
  expert_load_e = assign_counts_e / jnp.maximum(num_valid * p, 1.0)
  if moe.aux_loss_coef == 0.0:
    return expert_load_e, jnp.zeros((), jnp.float32)
  probs_bte = scores_bte
  if moe.gate == "sigmoid":
    probs_bte = probs_bte / probs_bte.sum(-1, keepdims=True)
  mean_prob_e = (probs_bte * valid_bt[..., None]).sum((0, 1)) / jnp.maximum(num_valid, 1.0)
  aux_loss = moe.aux_loss_coef * num_experts * jnp.sum(
      jax.lax.stop_gradient(expert_load_e) * mean_prob_e)
  return expert_load_e, aux_loss
