"""Every loss option composed through the learner's loss, each value against a float64
numpy restatement of the formulas; two of them also checked by hand."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model import transformer
from agentic_rl.rl import advantages as adv_lib
from agentic_rl.records import batch as batch_lib
from agentic_rl.rl import config as rl_config_lib
from agentic_rl.rl import learner
from agentic_rl.rl import objectives
from tests.rl import tiny_model

B, T, PROMPT = 4, 12, 4
REWARDS = np.array([1.0, 0.0, 0.5, 0.5], np.float32)  # groups [0, 0, 1, 1]: the second is flat


@pytest.fixture(scope="module")
def env():
  model, params = tiny_model.make_model(value_head=True)
  tokens, positions, mask = tiny_model.random_sequences(model.spec.vocab_size, B, T, PROMPT)
  _, _, aux = tiny_model.forward_fn(model)(params, jnp.asarray(tokens), jnp.asarray(positions))
  batch = batch_lib.make_batch(tokens, positions, mask, np.zeros((B, T)), REWARDS,
                               [0, 0, 1, 1], replay=transformer.replay_from_aux(aux),
                               sampling_mask_btw=jnp.zeros((B, T, 8), jnp.uint8))
  spec = tiny_model.rl_spec()
  logp = jax.jit(lambda p, b: learner.policy_outputs(model, p, b, spec)["logp_bt"])(params, batch)
  return dict(model=model, params=params, batch=batch, learner_logp=np.asarray(logp) * mask)


_batch_advantages = jax.jit(adv_lib.batch_advantages, static_argnums=0)


def _loss(env, spec, batch):
  norms = objectives.loss_normalizers(batch.loss_mask_bt, spec.loss.constant_normalizer)
  adv = (jnp.zeros_like(batch.loss_mask_bt) if spec.uses_values else
         _batch_advantages(spec, batch.rewards_b, batch.group_id_b, batch.loss_mask_bt,
                           batch.process_reward_bt, batch.turn_index_bt))
  return functools.partial(learner.microbatch_loss, model=env["model"], spec=spec,
                           num_micro_batches=1), norms, adv


# Six compiles that between them take every choice of every option. Correction bounds
# sit inside the spread of the composed batch's ratios, so each rejects some tokens.
VARIATIONS = [
    {"advantage.estimator": "grpo", "objective.type": "ppo_clip", "loss.aggregation": "token",
     "correction.type": "none", "loss.moe_aux_loss": True},
    {"advantage.estimator": "grpo_no_std", "objective.type": "gspo",
     "loss.aggregation": "sequence", "correction.type": "tis", "correction.tis_cap": 1.2,
     "loss.kl_coef": 0.1, "loss.kl_estimator": "k1", "loss.entropy_coef": 0.01},
    {"advantage.estimator": "dr_grpo", "loss.aggregation": "constant",
     "loss.constant_normalizer": 16, "correction.type": "mis_token", "correction.mis_low": 0.8,
     "correction.mis_high": 1.25, "loss.kl_coef": 0.1, "loss.kl_estimator": "k2",
     "objective.old_logp_source": "sampler"},
    {"advantage.estimator": "rloo", "correction.type": "mis_sequence",
     "correction.mis_sequence_ratio": "product", "loss.kl_coef": 0.1, "loss.kl_estimator": "k3",
     "replay.routing": False},
    {"advantage.estimator": "turn_level", "correction.type": "mis_sequence",
     "correction.mis_sequence_ratio": "geometric_mean", "correction.mis_low": 0.95,
     "correction.mis_high": 1.05, "replay.blocks": False},
    {"advantage.estimator": "gae", "loss.value_clip": 0.2, "correction.type": "icepop",
     "correction.icepop_low": 0.8, "correction.icepop_high": 1.5, "objective.type": "gspo",
     "replay.sampling_mask": False},
]


def test_variations_cover_every_choice():
  covered = {}
  for changes in VARIATIONS:
    for k, v in changes.items():
      covered.setdefault(k, set()).add(v)
  for field, choices in [("advantage.estimator", rl_config_lib.ADVANTAGE_ESTIMATORS),
                         ("objective.type", rl_config_lib.OBJECTIVES),
                         ("objective.old_logp_source", ("sampler",)),
                         ("loss.moe_aux_loss", (True,)),
                         ("loss.aggregation", rl_config_lib.AGGREGATIONS),
                         ("loss.kl_estimator", rl_config_lib.KL_ESTIMATORS),
                         ("correction.type", rl_config_lib.CORRECTIONS),
                         ("correction.mis_sequence_ratio", rl_config_lib.SEQUENCE_RATIOS)]:
    assert set(choices) <= covered[field], field


# ---- The composed loss against a float64 numpy restatement of every formula. ----
# Nothing below calls the package's advantage, objective, correction or log-prob code:
# each function restates the rule from the WORKSPACE table / module docstrings.

B2, T2, PROMPT2 = 6, 12, 4
GROUPS2 = np.array([0, 0, 0, 1, 1, 2])  # group 1 is flat, group 2 a single sequence
REWARDS2 = np.array([1.0, 0.0, 0.25, 0.3, 0.3, 0.9])
TOP_K2 = 8  # the recorded sampling mask: the top 8 logits and the drawn token


def _np_log_softmax(z_v):
  top = np.max(z_v, axis=-1, keepdims=True)
  return z_v - top - np.log(np.sum(np.exp(z_v - top), axis=-1, keepdims=True))


def _np_token_scores(logits_btv, tokens_bt, keep_btv=None):
  """float64 target-aligned (logp, entropy) at temperature 1; keep_btv None = no mask, an
  all-False row = no truncation there."""
  z_btv = logits_btv[:, :-1]
  if keep_btv is not None:
    keep = keep_btv[:, 1:]
    keep = keep | ~keep.any(-1, keepdims=True)
    z_btv = np.where(keep, z_btv, -np.inf)
  logp_btv = _np_log_softmax(z_btv)
  target_bt = np.take_along_axis(logp_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]
  p_btv = np.exp(logp_btv)
  # Masked-out tokens (log p = -inf) hold no mass: keep 0 * -inf out of the sum.
  entropy_bt = -np.sum(p_btv * np.where(p_btv > 0, logp_btv, 0.0), -1)
  pad = np.zeros((tokens_bt.shape[0], 1))
  return np.concatenate([pad, target_bt], 1), np.concatenate([pad, entropy_bt], 1)


def _np_group_norm(x_b, group_b, valid_b, normalize_std, eps):
  """(x - group mean) [/ (unbiased group std + eps)] over valid rows; 0 for flat groups."""
  out = np.zeros(len(x_b))
  for g in np.unique(group_b):
    rows = (group_b == g) & valid_b
    x = x_b[rows]
    if x.size == 0 or np.all(x == x[0]):
      continue
    a = x - x.mean()
    out[rows] = a / (x.std(ddof=1) + eps) if normalize_std else a
  return out


def _np_advantages(spec, d):
  """[B, T] advantages of every group estimator (not gae) on generated tokens."""
  mask, valid = d["mask"], d["mask"].sum(1) > 0
  r, g = REWARDS2, GROUPS2
  if spec.advantage.estimator in ("grpo", "grpo_no_std", "dr_grpo"):
    adv_b = _np_group_norm(r, g, valid, spec.advantage.estimator == "grpo", spec.advantage.eps)
  elif spec.advantage.estimator == "rloo":  # R_i - mean of the others in its group
    adv_b = np.zeros(len(r))
    for i in range(len(r)):
      others = (g == g[i]) & (np.arange(len(r)) != i)
      same = r[g == g[i]]
      if others.any() and not np.all(same == same[0]):
        adv_b[i] = r[i] - r[others].mean()
  else:
    assert spec.advantage.estimator == "turn_level"
    outcome_b = _np_group_norm(r, g, valid, spec.advantage.turn_normalize_std, spec.advantage.eps)
    turn_bt = np.minimum(d["turn"], spec.max_turns - 1)
    num_turns = turn_bt.max() + 1
    signal_bj = np.stack([(d["process"] * (turn_bt == j)).sum(1) for j in range(num_turns)], 1)
    present_bj = np.stack([(mask * (turn_bt == j)).sum(1) > 0 for j in range(num_turns)], 1)
    return_bj = np.stack([sum(spec.advantage.turn_gamma ** (k - j) * signal_bj[:, k]
                              for k in range(j, num_turns)) for j in range(num_turns)], 1)
    turn_adv_bj = np.stack([_np_group_norm(return_bj[:, j], g, present_bj[:, j],
                                           spec.advantage.turn_normalize_std, spec.advantage.eps)
                            for j in range(num_turns)], 1)
    turn_adv_bt = np.take_along_axis(turn_adv_bj, turn_bt, axis=1)
    return (outcome_b[:, None] + spec.advantage.turn_weight * turn_adv_bt) * mask
  return adv_b[:, None] * mask


def _np_gae(spec, d, values_bt):
  """(advantages, returns) by GAE over generated tokens: a reward on a tool-output token
  joins the action before it; the outcome follows the last action; V after it is 0."""
  b, t = d["mask"].shape
  adv_bt = np.zeros((b, t))
  for i in range(b):
    next_v = next_a = 0.0
    pending = REWARDS2[i]
    for j in reversed(range(t)):
      if d["mask"][i, j] > 0:
        delta = d["process"][i, j] + pending + spec.advantage.gamma * next_v - values_bt[i, j]
        adv_bt[i, j] = delta + spec.advantage.gamma * spec.advantage.gae_lambda * next_a
        next_v, next_a, pending = values_bt[i, j], adv_bt[i, j], 0.0
      else:
        pending += d["process"][i, j]
  return adv_bt, (adv_bt + values_bt) * d["mask"]


def _np_aggregate(x_bt, spec, mask):
  x_bt = np.where(mask > 0, x_bt, 0.0)
  if spec.loss.aggregation == "token":
    return x_bt.sum() / mask.sum()
  if spec.loss.aggregation == "sequence":
    has = mask.sum(1) > 0
    return np.sum(x_bt.sum(1)[has] / mask.sum(1)[has]) / has.sum()
  length = spec.loss.constant_normalizer or mask.shape[1]
  return x_bt.sum() / (mask.shape[0] * length)


def _np_correction(spec, log_ratio_bt, mask):
  """(weights, rejected) of r = pi_old / pi_sampler per token (rejected: truncated/masked)."""
  r = np.exp(log_ratio_bt)
  if spec.correction.type == "none":
    return np.ones_like(r), np.zeros(r.shape, bool)
  if spec.correction.type == "tis":
    return np.minimum(r, spec.correction.tis_cap), r > spec.correction.tis_cap
  if spec.correction.type in ("mis_token", "icepop"):
    lo, hi = ((spec.correction.mis_low, spec.correction.mis_high) if spec.correction.type == "mis_token"
              else (spec.correction.icepop_low, spec.correction.icepop_high))
    keep = (r >= lo) & (r <= hi)
    return np.where(keep, r, 0.0), ~keep
  total_b = (log_ratio_bt * mask).sum(1)
  if spec.correction.mis_sequence_ratio == "product":
    rho_b = np.exp(total_b)
  else:
    rho_b = np.exp(total_b / mask.sum(1))
  keep_b = (rho_b >= spec.correction.mis_low) & (rho_b <= spec.correction.mis_high)
  return (np.repeat(np.where(keep_b, rho_b, 0.0)[:, None], r.shape[1], 1),
          np.repeat(~keep_b[:, None], r.shape[1], 1))


def _np_kl(log_ratio_bt, estimator):  # log_ratio = log pi - log pi_ref
  if estimator == "k1":
    return log_ratio_bt
  if estimator == "k2":
    return 0.5 * log_ratio_bt ** 2
  return np.exp(-log_ratio_bt) - 1.0 + log_ratio_bt


def _np_loss(spec, d) -> dict:
  """The learner's loss sums on the composed batch, all in float64."""
  mask = d["mask"]
  on = mask > 0
  logp = d["logp_masked"] if spec.replay.sampling_mask else d["logp_free"]
  entropy = d["entropy_masked"] if spec.replay.sampling_mask else d["entropy_free"]
  logp = np.where(on, logp, 0.0)
  old = np.where(on, d["old"], 0.0)
  sampler = np.where(on, d["sampler"], 0.0)
  ppo_old = sampler if spec.objective.old_logp_source == "sampler" else old
  out = {}
  value_loss = 0.0
  if spec.uses_values:
    values = np.where(on, d["values"], 0.0)
    old_values = np.where(on, d["old_values"], 0.0)
    adv, returns = _np_gae(spec, d, old_values)
    v_bt = 0.5 * (values - returns) ** 2
    if spec.loss.value_clip > 0:
      clipped = old_values + np.clip(values - old_values, -spec.loss.value_clip, spec.loss.value_clip)
      v_bt = np.maximum(v_bt, 0.5 * (clipped - returns) ** 2)
    value_loss = out["value_loss"] = _np_aggregate(v_bt, spec, mask)
  else:
    adv = _np_advantages(spec, d)
  weights, rejected = _np_correction(spec, (old - sampler) * mask, mask)
  low, high = spec.clip_range
  if spec.objective.type == "ppo_clip":
    ratio = np.exp(logp - ppo_old)
  else:  # GSPO: every token carries its sequence's length-normalised ratio
    ratio = np.repeat(np.exp(((logp - ppo_old) * mask).sum(1) / mask.sum(1))[:, None],
                      mask.shape[1], 1)
  unclipped, clipped = ratio * adv, np.clip(ratio, 1 - low, 1 + high) * adv
  pg = _np_aggregate(-np.minimum(unclipped, clipped) * weights * mask, spec, mask)
  ent = _np_aggregate(entropy, spec, mask)
  loss = pg - spec.loss.entropy_coef * ent + spec.loss.value_coef * value_loss
  if spec.loss.kl_coef > 0:
    out["kl_to_ref"] = _np_aggregate(_np_kl(logp - np.where(on, d["ref"], 0.0),
                                            spec.loss.kl_estimator), spec, mask)
    loss += spec.loss.kl_coef * out["kl_to_ref"]
  out.update(loss=loss + d["moe_aux_loss"] * spec.loss.moe_aux_loss, pg_loss=pg, entropy=ent,
             clipped_count=np.sum((clipped < unclipped) & on),
             advantage_sum=np.sum(np.where(on, adv, 0.0)),
             corr_weight_sum=np.sum(weights * mask),
             corr_rejected_count=np.sum(rejected & on))
  if spec.correction.type == "mis_sequence":
    out["corr_rejected_sequences"] = np.sum(rejected[:, 0] & (mask.sum(1) > 0))
  return out


@pytest.fixture(scope="module")
def composed():
  """Ragged sequences (a short one, tool-output tokens inside one), two turns with
  process signals, a recorded top-8 sampling mask, and old / sampler / reference log-probs
  and old values each off the current policy by noise, so every ratio, clip, correction
  and KL term is active."""
  model, params = tiny_model.make_model(value_head=True)
  tokens, positions, mask = tiny_model.random_sequences(model.spec.vocab_size, B2, T2,
                                                        PROMPT2, seed=3)
  mask[1, 9:] = 0  # a shorter sequence: token, sequence and constant means differ
  mask[4, 6:8] = 0  # tool output inside a sequence: GAE hands its reward to the action before
  turn = np.zeros((B2, T2), np.int32)
  turn[:, 8:] = 1
  rng = np.random.default_rng(11)
  process = np.zeros((B2, T2))
  process[:, 7] = rng.choice([0.0, 0.5, 1.0], B2)
  process[:, T2 - 1] = rng.choice([0.0, 1.0], B2)
  process[4, 6] = 0.5  # on a tool-output token
  logits, _, aux = tiny_model.forward_fn(model)(params, jnp.asarray(tokens),
                                                jnp.asarray(positions))
  logits = np.asarray(logits, np.float64)
  keep = np.zeros(logits.shape, bool)  # target aligned: keep[:, t] scored token t
  top = np.argsort(-logits[:, :-1], axis=-1, kind="stable")[..., :TOP_K2]
  np.put_along_axis(keep[:, 1:], top, True, axis=-1)
  np.put_along_axis(keep, tokens[..., None], True, axis=-1)
  keep[mask == 0] = False
  d = dict(mask=mask.astype(np.float64), turn=turn, process=process,
           moe_aux_loss=float(aux["moe_aux_loss"]))
  d["logp_masked"], d["entropy_masked"] = _np_token_scores(logits, tokens, keep)
  d["logp_free"], d["entropy_free"] = _np_token_scores(logits, tokens)
  noise = lambda scale: scale * rng.standard_normal((B2, T2))
  d["old"] = (d["logp_masked"] + noise(0.3)) * mask
  d["sampler"] = (d["old"] + noise(0.25)) * mask
  d["ref"] = (d["logp_masked"] + noise(0.3)) * mask
  values = np.asarray(aux["values"], np.float64)
  d["values"] = np.concatenate([np.zeros((B2, 1)), values[:, :-1]], 1)  # V before token t
  d["old_values"] = d["values"] + noise(0.3)
  batch = batch_lib.make_batch(
      tokens, positions, mask, d["sampler"], REWARDS2, GROUPS2, turn_index_bt=turn,
      process_reward_bt=process, replay=transformer.replay_from_aux(aux),
      sampling_mask_btw=np.packbits(keep, axis=-1, bitorder="little"), old_logp_bt=d["old"],
      ref_logp_bt=d["ref"], old_values_bt=d["old_values"])
  return dict(model=model, params=params, batch=batch, numpy=d)


@pytest.mark.parametrize("changes", VARIATIONS,
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_every_option_matches_a_float64_reference(composed, changes):
  spec = tiny_model.rl_spec(**changes)
  batch = composed["batch"]
  loss_fn, norms, adv = _loss(composed, spec, batch)
  loss, (sums, _) = jax.jit(loss_fn)(composed["params"], None, batch, adv, norms)
  want = _np_loss(spec, composed["numpy"])
  assert set(want) - {"loss"} <= set(sums)
  assert ("value_loss" in sums) == spec.uses_values
  assert ("kl_to_ref" in sums) == (spec.loss.kl_coef > 0)
  assert ("corr_rejected_sequences" in sums) == (spec.correction.type == "mis_sequence")
  np.testing.assert_allclose(float(loss), want["loss"], rtol=1e-5, atol=1e-6)
  for k, v in want.items():
    np.testing.assert_allclose(float(sums[k]), v, rtol=1e-5, atol=1e-5, err_msg=k)


def test_sampler_as_old_policy_and_tis_by_hand(env):
  """Sampler log-probs 0.1 below the learner's: with old_logp_source='sampler' the ratio is
  e^0.1 on every token; TIS with C = 1.05 then weights every token by 1.05."""
  mask = np.asarray(env["batch"].loss_mask_bt)
  batch = env["batch"].replace(sampler_logp_bt=jnp.asarray(env["learner_logp"] - 0.1 * mask))
  r = np.asarray(REWARDS).reshape(2, 2)
  a = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
  a[1] = 0.0  # the flat group
  mean_adv = a.repeat(1, axis=1).mean()  # every sequence has T - PROMPT tokens
  for changes, want_pg, want_rejected in [
      ({"objective.old_logp_source": "sampler"}, -np.exp(0.1) * mean_adv, 0.0),
      ({"correction.type": "tis", "correction.tis_cap": 1.05}, -1.05 * mean_adv, 1.0)]:
    spec = tiny_model.rl_spec(**changes)
    loss_fn, norms, adv = _loss(env, spec, batch)
    _, (sums, _) = jax.jit(loss_fn)(env["params"], None, batch, adv, norms)
    assert float(sums["pg_loss"]) == pytest.approx(want_pg, abs=1e-5), changes
    n = mask.sum()
    assert float(sums["corr_rejected_count"]) / n == pytest.approx(want_rejected), changes
    # The mismatch metric sees the constructed shift: log r = 0.1 on every token, so
    # k1 = -log r = -0.1 and k3 = r - 1 - log r.
    assert float(sums["mm/k1"]) / n == pytest.approx(-0.1, abs=1e-5)
    assert float(sums["mm/k3"]) / n == pytest.approx(np.exp(0.1) - 1.1, rel=1e-3)
