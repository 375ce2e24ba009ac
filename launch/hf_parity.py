"""Logit parity with transformers on a Hugging Face checkpoint folder, and the retrofit's cost.

    python -m launch.hf_parity --hf_dir DIR --json [--tokens T.npy --logits_out L.npy]
    python -m launch.hf_parity --hf_dir DIR --json --layer_pattern SSSG \
        --sliding_window 16 --block_size 4 --topk_tokens 8

Runs transformers' model (float32, eager attention) and ours on the same tokens (int32
[B, T] from --tokens, or random): the full forward, and chunked prefill (the first half)
plus one-token decode steps through our cache. Prints {"model_type",
"max_abs_logit_diff", "decode_max_abs_logit_diff", "params"}. --logits_out saves our
float32 logits [B, T, V].

With --layer_pattern (e.g. SSSG, the 3:1 hybrid) our model is the retrofit of the same
weights: S layers attend a sliding window with their gate at pass-through, G layers the
top-k blocks by pooled keys. It adds "kl_to_dense" (mean over tokens of KL(dense ||
retrofit), nats) and "kl_to_dense_max": what route B's attention costs this model.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags
from absl import logging
import numpy as np

_HF_DIR = flags.DEFINE_string("hf_dir", None, "A Hugging Face model folder.", required=True)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON line.")
_TOKENS = flags.DEFINE_string("tokens", None, "int32 [B, T] .npy of token ids.")
_LOGITS_OUT = flags.DEFINE_string("logits_out", None, "Where to save our logits [B, T, V].")
_BATCH = flags.DEFINE_integer("batch", 2, "Random tokens: rows.")
_LENGTH = flags.DEFINE_integer("length", 32, "Random tokens: length.")
_SEED = flags.DEFINE_integer("seed", 0, "Random tokens: seed.")
_PATTERN = flags.DEFINE_string("layer_pattern", None, "Retrofit to this layer pattern.")
_WINDOW = flags.DEFINE_integer("sliding_window", 32, "Retrofit: S layers' window W.")
_BLOCK = flags.DEFINE_integer("block_size", 8, "Retrofit: G layers' block size B.")
_TOPK = flags.DEFINE_integer("topk_tokens", 32, "Retrofit: G layers' token budget k.")


def retrofit_overrides(pattern: str | None, window: int, block: int, topk: int) -> dict:
  """The ModelSpec fields of the hybrid retrofit over a dense import: S gates start as a
  pass-through (2 sigmoid(0) = 1), G layers select blocks by their pooled keys."""
  if not pattern:
    return {}
  return {"layer_pattern": pattern, "s_gate": "unit_sigmoid", "sliding_window": window,
          "block_size": block, "topk_tokens": topk}


def run(hf_dir: str, tokens_bt: np.ndarray, overrides: dict) -> tuple[dict, np.ndarray]:
  import jax
  import torch
  import transformers

  from agentic_rl.interop import hf_import, hf_params
  from agentic_rl.interop.hf_source import TensorSource
  from agentic_rl.model import families
  from agentic_rl.model.transformer import Model

  hf_cfg = hf_import.read_hf_config(hf_dir)
  b, t = tokens_bt.shape
  spec = families.spec_from_hf(hf_cfg, max_seq_len=max(t, 8), **overrides)
  capacity = -(-t // spec.block_size) * spec.block_size  # Caches hold whole blocks.
  spec = spec.replace(max_seq_len=max(spec.max_seq_len, capacity))
  source = TensorSource.from_dir(hf_dir)
  params = hf_params.load(spec, source)
  model = Model(spec)
  positions_bt = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  ours = np.asarray(model.forward(params, tokens_bt, positions_bt)[0], np.float32)
  split = max(1, t // 2)
  cache = model.init_cache(b, capacity)
  chunks = []
  for start, stop in [(0, split)] + [(i, i + 1) for i in range(split, t)]:
    logits, cache, _ = model.forward(params, tokens_bt[:, start:stop],
                                     positions_bt[:, start:stop], cache)
    chunks.append(np.asarray(logits, np.float32))
  decoded = np.concatenate(chunks, axis=1)
  transformers.utils.logging.disable_progress_bar()
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
  with torch.no_grad():
    theirs = hf_model(torch.as_tensor(tokens_bt, dtype=torch.long)).logits.float().numpy()
  report = {"model_type": hf_cfg["model_type"],
            "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
      "layer_pattern": "".join(spec.layer_types), "tokens": [b, t],
      "max_abs_logit_diff": float(np.abs(ours - theirs).max()),
      "decode_max_abs_logit_diff": float(np.abs(decoded - theirs).max())}
  if overrides:
    kl_bt = _kl(theirs, ours)
    report.update(kl_to_dense=float(kl_bt.mean()), kl_to_dense_max=float(kl_bt.max()))
  return report, ours


def _kl(p_logits, q_logits):
  """KL(p || q) per position, in float64."""
  lp = _log_softmax(p_logits.astype(np.float64))
  lq = _log_softmax(q_logits.astype(np.float64))
  return (np.exp(lp) * (lp - lq)).sum(-1)


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from agentic_rl.interop import hf_import
  if _TOKENS.value:
    tokens = np.load(_TOKENS.value)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
      raise app.UsageError(f"--tokens {_TOKENS.value}: expected int32 [B, T], got "
                           f"{tokens.dtype} {tokens.shape}.")
    tokens = tokens.astype(np.int32)
  else:
    vocab = int(hf_import.read_hf_config(_HF_DIR.value)["vocab_size"])
    tokens = np.random.default_rng(_SEED.value).integers(
        0, vocab, (_BATCH.value, _LENGTH.value), dtype=np.int32)
  overrides = retrofit_overrides(_PATTERN.value, _WINDOW.value, _BLOCK.value, _TOPK.value)
  report, logits = run(_HF_DIR.value, tokens, overrides)
  if _LOGITS_OUT.value:
    np.save(_LOGITS_OUT.value, logits)
  print(json.dumps(report) if _JSON.value else json.dumps(report, indent=1))


if __name__ == "__main__":
  app.run(main)
