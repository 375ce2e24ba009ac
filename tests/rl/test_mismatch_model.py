"""Mismatch metrics and replay on the real (tiny) model.

The sampler is never the learner's own code: `tiny_model.uncached_sampler` scores each
token from a forward over its prefix alone, in float64 numpy at the sampler's temperature
and top-k mask, and records its routing and blocks; `cache_path_sampler` decodes through
the KV cache. The mismatch is ~0 against a learner that replays that record; clearly
positive when the sampler is perturbed: a bf16 KV cache, dropped replay, a changed
temperature, a dropped sampling mask. Replay pins routing and block selection even after
the weights moved.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model import transformer
from agentic_rl.records import batch as batch_lib
from agentic_rl.rl import config as rl_config_lib
from agentic_rl.rl import learner
from agentic_rl.records import sampling_mask as sm
from tests.rl import tiny_model

B, T, PROMPT = 4, 40, 12
FULL_REPLAY = tiny_model.rl_spec()  # routing + blocks + sampling mask
NO_MASK = tiny_model.rl_spec(**{"replay.sampling_mask": False})
NO_REPLAY = tiny_model.rl_spec(**{"replay.routing": False, "replay.blocks": False})
LOGP_ULPS = 2e-6


@functools.lru_cache(maxsize=None)
def _metrics_fn(model, spec):
  return jax.jit(lambda p, b: learner.mismatch_metrics(model, p, b, spec))


@functools.lru_cache(maxsize=None)
def _outputs_fn(model, spec):
  return jax.jit(lambda p, b: learner.policy_outputs(model, p, b, spec))


def _scalars(metrics):
  return {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}


def _perturbed(params, scale, seed=1):
  """Params whose router and sparse-attention query/key weights moved by `scale` * N(0, 1)."""
  keys = iter(jax.random.split(jax.random.key(seed), 8))
  layer = dict(params["layer_0"])
  moe = dict(layer["moe"])
  moe["w_router_de"] = moe["w_router_de"] + scale * jax.random.normal(
      next(keys), moe["w_router_de"].shape)
  attn = dict(layer["attn"])
  for name in ("w_q_dnh", "w_k_dkh"):
    attn[name] = attn[name] + scale * jax.random.normal(next(keys), attn[name].shape)
  return dict(params, layer_0=dict(layer, moe=moe, attn=attn))


@pytest.fixture(scope="module")
def env():
  model, params = tiny_model.make_model()
  tokens, positions, mask = tiny_model.random_sequences(model.spec.vocab_size, B, T, PROMPT)
  forward = tiny_model.forward_fn(model)
  logits, _, aux = forward(params, jnp.asarray(tokens), jnp.asarray(positions))
  # The sampler's support: its top-4 plus the drawn token, on generated tokens only.
  keep = np.asarray(sm.sampling_mask_from_logits(logits, top_k=4))
  keep = np.concatenate([np.zeros_like(keep[:, :1]), keep[:, :-1]], axis=1)  # target aligned
  keep[np.arange(B)[:, None], np.arange(T)[None], tokens] = True
  keep[mask == 0] = False
  base = batch_lib.make_batch(tokens, positions, mask, np.zeros((B, T)), np.zeros(B),
                              np.zeros(B), replay=transformer.replay_from_aux(aux),
                              sampling_mask_btw=sm.pack_mask(jnp.asarray(keep)))
  return dict(model=model, params=params, forward=forward, base=base, keep=keep)


def _sampled(env, batch, replay=None):
  """The batch with the uncached sampler's log-probs (at the batch's temperature, under the
  recorded top-4 mask) and its routing and block record; `replay` forces its selections."""
  temperature = np.asarray(batch.temperature_b)
  logp, record = tiny_model.uncached_sampler(env["model"], env["params"], batch.tokens_bt,
                                             PROMPT, temperature, env["keep"], replay)
  return batch.replace(sampler_logp_bt=jnp.asarray(logp) * batch.loss_mask_bt, replay=record)


def test_uncached_sampler_with_replay_is_zero(env):
  batch = _sampled(env, env["base"])
  m = _scalars(_metrics_fn(env["model"], FULL_REPLAY)(env["params"], batch))
  for k in ("mismatch/k1", "mismatch/k3", "mismatch/abs_logp_diff_mean"):
    assert abs(m[k]) < 1e-6, (k, m[k])
  # A few float32 ulps of |log p| <= 8: the learner's float32 log-softmax against float64.
  assert m["mismatch/abs_logp_diff_max"] < LOGP_ULPS, m
  assert m["mismatch/ratio_outside_frac"] == 0.0
  assert m["mismatch/routing_agreement"] == 1.0 and m["mismatch/routing_exact_match"] == 1.0
  assert m["mismatch/block_agreement"] == 1.0
  assert m["mismatch/num_tokens"] == B * (T - PROMPT)


def test_dropped_sampling_mask_is_positive(env):
  batch = _sampled(env, env["base"])
  m = _scalars(_metrics_fn(env["model"], NO_MASK)(env["params"], batch))
  # The learner spreads mass over tokens the sampler could not draw: log r <= 0 on every
  # token, so k1 equals the mean |log r|.
  assert m["mismatch/k1"] > 1e-3 and m["mismatch/k3"] > 1e-6, m
  assert m["mismatch/k1"] == pytest.approx(m["mismatch/abs_logp_diff_mean"], rel=1e-5)


def test_changed_temperature_is_positive(env):
  hot = env["base"].replace(temperature_b=jnp.full((B,), 0.7, jnp.float32))
  sampled_hot = _sampled(env, hot)
  fn = _metrics_fn(env["model"], FULL_REPLAY)
  same = _scalars(fn(env["params"], sampled_hot))
  assert same["mismatch/abs_logp_diff_max"] < LOGP_ULPS  # scored at the sampler's temperature
  cold = sampled_hot.replace(temperature_b=jnp.ones((B,), jnp.float32))
  wrong = _scalars(fn(env["params"], cold))
  assert wrong["mismatch/k3"] > 1e-3 and wrong["mismatch/abs_logp_diff_mean"] > 1e-2, wrong


def test_dropped_replay_is_positive(env):
  # The sampler took other experts and blocks than the learner's weights would pick
  # (here: those of a moved router and attention, as a cheaper or staler sampler would).
  _, _, aux_s = env["forward"](_perturbed(env["params"], 0.5), env["base"].tokens_bt,
                               env["base"].positions_bt)
  batch = _sampled(env, env["base"], replay=transformer.replay_from_aux(aux_s))
  with_replay = _scalars(_metrics_fn(env["model"], FULL_REPLAY)(env["params"], batch))
  assert with_replay["mismatch/abs_logp_diff_max"] < LOGP_ULPS
  dropped = _scalars(_metrics_fn(env["model"], NO_REPLAY)(env["params"], batch))
  assert dropped["mismatch/routing_agreement"] < 0.9, dropped
  assert dropped["mismatch/block_agreement"] < 0.9, dropped
  assert dropped["mismatch/k3"] > 1e-4 and dropped["mismatch/abs_logp_diff_mean"] > 1e-2, dropped


def test_bf16_cache_is_positive_and_fp32_cache_is_not(env):
  results = {}
  for dtype in ("float32", "bfloat16"):
    cache_model, _ = tiny_model.make_model(init=False, cache_dtype=dtype)
    sampler_logp, replay = tiny_model.cache_path_sampler(cache_model, env["params"],
                                                         np.asarray(env["base"].tokens_bt),
                                                         PROMPT)
    # No truncation: all-zero mask rows. The learner replays the sampler's selections.
    batch = env["base"].replace(sampler_logp_bt=jnp.asarray(sampler_logp), replay=replay,
                                sampling_mask_btw=jnp.zeros_like(env["base"].sampling_mask_btw))
    metrics = _metrics_fn(env["model"], FULL_REPLAY)(env["params"], batch)
    results[dtype] = _scalars(metrics)
    by_pos = np.asarray(metrics["mismatch/by_position/num_tokens"])
    assert by_pos.sum() == B * (T - PROMPT) and by_pos[0] == 0  # positions 0-7: prompt
  f32, bf16 = results["float32"], results["bfloat16"]
  assert f32["mismatch/abs_logp_diff_mean"] < 2e-5 and f32["mismatch/k3"] < 1e-8, f32
  assert bf16["mismatch/abs_logp_diff_mean"] > 1e-3, bf16
  assert bf16["mismatch/abs_logp_diff_mean"] > 100 * f32["mismatch/abs_logp_diff_mean"]
  assert bf16["mismatch/k3"] > 1e-6, bf16


def test_replay_pins_routing_and_blocks_after_weights_moved(env):
  batch = env["base"]
  recorded = batch.replay[0]
  moved = _perturbed(env["params"], 1.0, seed=3)
  forced = _outputs_fn(env["model"], FULL_REPLAY)(moved, batch)["aux"]["layers"][0]
  np.testing.assert_array_equal(np.asarray(forced["experts"]), np.asarray(recorded["experts"]))
  np.testing.assert_array_equal(np.asarray(forced["blocks"]), np.asarray(recorded["blocks"]))
  free = _outputs_fn(env["model"], NO_REPLAY)(moved, batch)["aux"]["layers"][0]
  assert (np.asarray(free["experts"]) != np.asarray(recorded["experts"])).any(-1).mean() > 0.2
  assert (np.asarray(free["blocks"]) != np.asarray(recorded["blocks"])).any(-1).mean() > 0.2


def test_replay_flags_select_what_is_forced(env):
  batch = env["base"]
  only_routing = tiny_model.rl_spec(**{"replay.blocks": False})
  assert list(learner.learner_replay(batch, only_routing)[0]) == ["experts"]
  assert sorted(learner.learner_replay(batch, FULL_REPLAY)[0]) == ["blocks", "experts"]
  assert learner.learner_replay(batch, NO_REPLAY) is None


@pytest.mark.parametrize("top_k,top_p,temperature,truncated", [
    (0, 1.0, 1.0, False), (64, 1.0, 1.0, False), (100, 1.0, 1.0, False), (4, 1.0, 1.0, True),
    (0, 0.9, 1.0, True), (0, 1.0, 0.0, True)])
def test_the_learner_knows_when_the_sampler_truncates(top_k, top_p, temperature, truncated):
  from agentic_rl.rollout import config as rollout_config_lib
  r = rollout_config_lib.default_rollout_config()
  r.top_k, r.top_p, r.temperature = top_k, top_p, temperature
  spec = rl_config_lib.validate(rl_config_lib.default_rl_config(), tiny_model.model_config(),
                                r)
  assert spec.sampling_truncated is truncated


def test_a_full_vocabulary_sampler_skips_the_mask_replay_with_the_same_log_probs(env):
  """All-True recorded masks (full-vocabulary sampling): skipping their replay, as the
  learner does when config.rollout does not truncate, gives bit-identical log-probs and
  entropies, and drops the [B, T, V] unpack from the forward."""
  all_true = np.ones_like(env["keep"])
  all_true[env["base"].loss_mask_bt == 0] = False
  batch = env["base"].replace(sampling_mask_btw=sm.pack_mask(jnp.asarray(all_true)))
  replayed = FULL_REPLAY.replace(sampling_truncated=True)
  skipped = FULL_REPLAY.replace(sampling_truncated=False)
  a = _outputs_fn(env["model"], replayed)(env["params"], batch)
  b = _outputs_fn(env["model"], skipped)(env["params"], batch)
  np.testing.assert_array_equal(np.asarray(a["logp_bt"]), np.asarray(b["logp_bt"]))
  np.testing.assert_array_equal(np.asarray(a["entropy_bt"]), np.asarray(b["entropy_bt"]))
  hlo = lambda spec: jax.jit(lambda p, x: learner.policy_outputs(  # noqa: E731
      env["model"], p, x, spec)).lower(env["params"], batch).as_text()
  # The packed uint8 mask is read only by the replay: skipped, only its argument is left.
  assert hlo(skipped).count("ui8>") < hlo(replayed).count("ui8>")
