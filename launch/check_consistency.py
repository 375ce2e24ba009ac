"""Compatibility check of a config's inference path against its training path.

Runs the full-sequence forward (what the learner computes) and chunked prefill
plus token-by-token decode through the KV cache (what the sampler computes) on
the same tokens, and prints how far they differ. Run it whenever an attention
or cache setting changes.

    python -m launch.check_consistency --config configs/quickstart.py --length 256
    python -m launch.check_consistency --config IMPORTED/config.py --length 64

The params are config.train.init_checkpoint's when it is set (a params folder such as an
import of launch.import_hf or a shipped base, or a run's checkpoint), else a random init
from config.seed.
"""

import json
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model import config as model_config
from agentic_rl.model import transformer
from launch import config_flag

_CONFIG = config_flag.define_config("configs/quickstart.py", "Config file.")
_LENGTH = flags.DEFINE_integer("length", 192, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch", 2, "Sequences.")
_PREFILL = flags.DEFINE_integer("prefill", 64, "Tokens prefilled before decoding starts.")
_CHUNK = flags.DEFINE_integer("chunk", 32, "Prefill chunk size.")


def selection_agreement(layers_a, layers_b, key):
  """Share of selections (`key`: "experts" or "blocks") the two paths agree on, or None.

  The last axis of each entry is a top-k selection: a set whose order means nothing, with
  -1 for an unused slot. Per row, agreement counts the ids both sets hold, over the larger
  set's size, so it is 1 exactly when the sets are equal. Rows where neither path selected
  anything (e.g. padding) do not count.
  """
  hits = total = 0
  for la, lb in zip(layers_a, layers_b):
    if key not in la or key not in lb:
      continue
    a_rk = np.asarray(la[key]).reshape(-1, np.shape(la[key])[-1])
    b_rk = np.asarray(lb[key]).reshape(-1, np.shape(lb[key])[-1])
    for a_k, b_k in zip(a_rk, b_rk):
      a_set, b_set = set(a_k[a_k >= 0].tolist()), set(b_k[b_k >= 0].tolist())
      hits += len(a_set & b_set)
      total += max(len(a_set), len(b_set))
  return hits / total if total else None


def start_params(config, model):
  """(params, where they came from): config.train.init_checkpoint's, or a random init."""
  params = model.init(jax.random.key(config.seed))
  path = config.train.init_checkpoint
  if not path:
    return params, f"random init (seed {config.seed})"
  from agentic_rl import resources
  from agentic_rl.train import params_file
  if params_file.params_path(resources.resolve(path)):
    return params_file.load_params(resources.resolve(path), params,
                                   "config.train.init_checkpoint",
                                   fresh_prefixes=model.spec.params_started_fresh()), path
  from agentic_rl.train.trainer import load_params_with
  return load_params_with(config, path, "config.train.init_checkpoint")[0], path


def main(argv):
  del argv
  config = _CONFIG.value
  spec = model_config.validate(config.model)
  length, batch = _LENGTH.value, _BATCH.value
  if length > spec.max_seq_len:
    raise app.UsageError(f"--length={length} exceeds config.model.max_seq_len={spec.max_seq_len}")
  model = transformer.Model(spec)
  params, source = start_params(config, model)
  tokens = jax.random.randint(jax.random.key(config.seed + 1), (batch, length), 0,
                              spec.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  forward = jax.jit(model.forward)
  full_logits, _, full_aux = forward(params, tokens, positions)

  max_len = -(-length // spec.block_size) * spec.block_size
  cache = model.init_cache(batch, max_len)
  step = jax.jit(model.forward, donate_argnums=(3,))
  pieces, auxes = [], []
  prefill, chunk = min(_PREFILL.value, length), _CHUNK.value
  for start in range(0, prefill, chunk):
    end = min(start + chunk, prefill)
    logits, cache, aux = step(params, tokens[:, start:end], positions[:, start:end], cache)
    pieces.append(logits)
    auxes.append(aux)
  t0 = time.perf_counter()
  for t in range(prefill, length):
    logits, cache, aux = step(params, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
    pieces.append(logits)
    auxes.append(aux)
  jax.block_until_ready(pieces[-1])
  decode_s = time.perf_counter() - t0
  cached_logits = jnp.concatenate(pieces, axis=1)
  cached_layers = transformer.concat_replay_over_time(
      [transformer.replay_from_aux(a) for a in auxes])
  full_layers = transformer.replay_from_aux(full_aux)
  logp_full = jax.nn.log_softmax(full_logits)
  logp_cached = jax.nn.log_softmax(cached_logits)
  report = {
      "params": source,
      "config_layer_types": "".join(spec.layer_types),
      "cache_dtype": spec.cache_dtype,
      "length": length,
      "max_abs_logit_diff": float(jnp.max(jnp.abs(full_logits - cached_logits))),
      "max_abs_logprob_diff": float(jnp.max(jnp.abs(logp_full - logp_cached))),
      "mean_kl_full_vs_cached": float(jnp.mean(jnp.sum(
          jnp.exp(logp_cached) * (logp_cached - logp_full), axis=-1))),
      "routing_agreement": selection_agreement(full_layers, cached_layers, "experts"),
      "block_selection_agreement": selection_agreement(full_layers, cached_layers, "blocks"),
      "decode_tokens_per_s": batch * (length - prefill) / max(decode_s, 1e-9),
  }
  print(json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
