"""A tiny hybrid MoE (S + G layers, both MoE) and two samplers whose log-probs do not come
from the learner's full-sequence pass: uncached, prefix by prefix, and through the KV cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model import config as model_config_lib
from agentic_rl.model import transformer
from agentic_rl.rl import config as rl_config_lib


def model_config(**changes):
  """One sparse (G) attention layer with an MoE FFN: routing and block selection, and the
  fastest compile on CPU (the default suite compiles it a handful of times)."""
  c = model_config_lib.default_model_config()
  c.vocab_size = 64
  c.d_model = 32
  c.num_layers = 1
  c.layer_pattern = "G"
  c.num_heads = 4
  c.num_kv_heads = 2
  c.head_dim = 8
  c.max_seq_len = 64
  c.sliding_window = 8
  c.block_size = 4
  c.topk_tokens = 8  # 2 of up to 16 blocks per query group
  c.num_dense_layers = 0
  c.moe.num_experts = 4
  c.moe.num_experts_per_token = 2
  c.moe.d_ff_expert = 16
  for k, v in changes.items():
    section = c
    *path, last = k.split(".")
    for p in path:
      section = section[p]
    section[last] = v
  return c


@functools.lru_cache(maxsize=None)
def make_model(seed=0, init=True, **changes):
  """(model, params); cached, so test modules share one model (and its compiled functions)."""
  spec = model_config_lib.validate(model_config(**changes))
  model = transformer.Model(spec)
  return model, (model.init(jax.random.key(seed)) if init else None)


def rl_spec(**changes):
  """The default learner spec with `section.field=value` changes; `group_size` and
  `max_turns` are config.rollout's knobs, joined as the run joins them."""
  rollout = {"group_size": changes.pop("group_size", 1), "max_turns": changes.pop("max_turns", 8)}
  c = rl_config_lib.default_rl_config()
  for k, v in changes.items():
    *section, name = k.split(".")
    (c[section[0]] if section else c)[name] = v
  # GAE needs the critic: the model's value_head is joined into the spec.
  return rl_config_lib.validate(c, {"value_head": c.advantage.estimator == "gae"}, rollout)


def random_sequences(vocab, b=4, t=40, prompt=12, seed=0):
  """tokens, positions and a loss mask on everything after the prompt."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
  mask = np.zeros((b, t), np.float32)
  mask[:, prompt:] = 1
  return tokens, positions, mask


@functools.lru_cache(maxsize=None)
def forward_fn(model):
  """jax.jit(model.forward), one per model."""
  return jax.jit(model.forward)


def cache_path_sampler(model, params, tokens, prompt_len):
  """The sampler's view: prefill the prompt into the cache, then decode one token at a time
  (teacher-forced on `tokens`). Returns target-aligned log-probs [B, T] of tokens
  prompt_len.. and the replay record (experts, blocks) of every position."""
  b, t = tokens.shape
  fwd = forward_fn(model)
  cache = model.init_cache(b)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  toks = jnp.asarray(tokens)
  logits, cache, aux = fwd(params, toks[:, :prompt_len], pos[:, :prompt_len], cache)
  step_logits = [logits[:, -1]]
  records = [aux["layers"]]
  for i in range(prompt_len, t - 1):
    logits, cache, aux = fwd(params, toks[:, i:i + 1], pos[:, i:i + 1], cache)
    step_logits.append(logits[:, 0])
    records.append(aux["layers"])
  # The last token is never fed back in a real sampler; record it with one more step.
  _, _, aux = fwd(params, toks[:, t - 1:], pos[:, t - 1:], cache)
  records.append(aux["layers"])
  logp = jax.nn.log_softmax(jnp.stack(step_logits, axis=1), axis=-1)  # scores tokens P..T-1
  tok_logp = jnp.take_along_axis(logp, toks[:, prompt_len:, None], axis=-1)[..., 0]
  sampler_logp = np.zeros((b, t), np.float32)
  sampler_logp[:, prompt_len:] = np.asarray(tok_logp)
  replay = []
  for layer in range(len(records[0])):
    entry = {}
    if "experts" in records[0][layer]:
      entry["experts"] = jnp.concatenate([r[layer]["experts"] for r in records], axis=1)
    if "blocks" in records[0][layer]:
      entry["blocks"] = jnp.concatenate([r[layer]["blocks"] for r in records], axis=2)
    replay.append(entry)
  return sampler_logp, tuple(replay)


@functools.partial(jax.jit, static_argnums=0)
def _prefix_step(model, params, tokens_bt, i, replay):
  """Logits at position i seeing only positions 0..i (later ones are padding, -1), and the
  selections made there: experts [B, k] and blocks [B, K, n] per layer."""
  arange_t = jnp.arange(tokens_bt.shape[1], dtype=jnp.int32)
  positions_bt = jnp.broadcast_to(jnp.where(arange_t <= i, arange_t, -1), tokens_bt.shape)
  logits_btv, _, aux = model.forward(params, tokens_bt, positions_bt, None, replay)
  take = lambda x, axis: jax.lax.dynamic_index_in_dim(x, i, axis=axis, keepdims=False)
  record = tuple({k: take(layer[k], 1 if k == "experts" else 2) for k in ("experts", "blocks")
                  if k in layer} for layer in aux["layers"])
  return take(logits_btv, 1), record


def uncached_sampler(model, params, tokens, prompt_len, temperature=1.0, keep_btv=None,
                     replay=None):
  """A naive sampler, teacher-forced on `tokens`: one uncached forward per position on the
  prefix up to it, then float64 numpy log-softmax of logits / temperature, truncated to the
  target-aligned support keep_btv[:, t] (an all-False row: no truncation). `replay` forces
  the sampler's own selections (e.g. a staler router's). Returns target-aligned float32
  log-probs [B, T] of tokens prompt_len.. (0 before) and the selections of every position."""
  tokens = np.asarray(tokens)
  b, t = tokens.shape
  temperature_b = np.broadcast_to(np.asarray(temperature, np.float64), (b,))
  logp_bt = np.zeros((b, t))
  records = []
  for i in range(t):
    logits_bv, record = _prefix_step(model, params, jnp.asarray(tokens), i, replay)
    records.append(record)
    if not prompt_len - 1 <= i < t - 1:
      continue
    z_bv = np.asarray(logits_bv, np.float64) / temperature_b[:, None]
    if keep_btv is not None:
      keep_bv = np.asarray(keep_btv[:, i + 1])
      z_bv = np.where(keep_bv | ~keep_bv.any(-1, keepdims=True), z_bv, -np.inf)
    z_bv = z_bv - z_bv.max(-1, keepdims=True)
    logp_bv = z_bv - np.log(np.exp(z_bv).sum(-1, keepdims=True))
    logp_bt[:, i + 1] = logp_bv[np.arange(b), tokens[:, i + 1]]
  replay_out = tuple(
      {k: jnp.stack([r[layer][k] for r in records], axis=1 if k == "experts" else 2)
       for k in records[0][layer]} for layer in range(len(records[0])))
  return logp_bt.astype(np.float32), replay_out
