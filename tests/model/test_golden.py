"""Golden-value regression: a fixed config, params and tokens must keep giving the same
logits, expert routes and block selections, so numeric drift in attention, the kernels,
MoE dispatch or the cache-free forward fails loudly.

Model: the 3:1 hybrid "SSSG" with MoE (layer 0 dense, layers 1-3 MoE, top-2 of 4
experts plus a shared expert), W=8, B=4, k=8, on 2 ragged rows of 32 and 21 tokens.
Params are drawn in numpy (tests/model/model_fixtures.py, seed 0), so the golden values
do not depend on jax's PRNG or flax's initialisers, only on the forward's arithmetic.
Matmuls run at "highest" precision, so accelerators compute in fp32 as the CPU does.

Stored in tests/model/golden/hybrid_sssg_moe.json. Checked, over the real (non-padding)
positions: sum, sum of squares and sum of |.| of the logits, the L2 norm of every token's
logits, and 64 sampled logits, each to a relative tolerance of 1e-5 (the sum and the
samples relative to the logits' scale, since either may sit near zero); the chosen experts
and blocks exactly (checksums). Cross-machine fp32 round-off stays well below 1e-5;
a drift smaller than that (e.g. shifting every RoPE angle by 1e-4 rad moves logits by
5e-7) is below what any cross-platform golden value can see.

After an intended change of the forward's numerics (never to silence a failure you do
not understand), regenerate and commit the file:

    REGENERATE_GOLDEN=1 python -m pytest tests/model/test_golden.py

The regenerating run writes the file and reports the test as skipped.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model.transformer import Model
from tests.model.model_fixtures import draw_params, make_spec, padded_positions

GOLDEN_PATH = pathlib.Path(__file__).parent / "golden" / "hybrid_sssg_moe.json"
RTOL = 1e-5
LENGTHS, T = [32, 21], 32
NUM_SAMPLES = 64


def compute_golden() -> dict:
  spec = make_spec("SSSG", 4, num_dense_layers=1)
  model = Model(spec)
  params = draw_params(model, seed=0)
  positions = padded_positions(LENGTHS, T)
  tokens = np.random.default_rng(1).integers(0, spec.vocab_size, (2, T)).astype(np.int32)
  tokens[positions < 0] = 0
  with jax.default_matmul_precision("highest"):
    logits, _, aux = jax.jit(model.forward)(params, jnp.asarray(tokens),
                                            jnp.asarray(positions))
  valid = positions >= 0
  real = np.asarray(logits, np.float64)[valid]  # [num_tokens, V]
  flat = real.reshape(-1)
  sample_idx = np.random.default_rng(2).choice(flat.size, NUM_SAMPLES, replace=False)
  choices = {}
  for i, layer_aux in enumerate(aux["layers"]):
    for key in ("experts", "blocks"):
      if key not in layer_aux:
        continue
      ids = np.asarray(layer_aux[key])
      live = ids[valid] if key == "experts" else np.moveaxis(ids, 1, 2)[valid]
      weights = np.arange(1, live.size + 1).reshape(live.shape)
      # Plain sum plus a position-weighted sum: a swap between tokens changes the latter.
      choices[f"layer_{i}.{key}"] = [int(live.sum()), int((live * weights).sum())]
  return {
      "model": {"layer_types": "".join(spec.layer_types), "num_dense_layers": 1,
                "d_model": spec.d_model, "vocab_size": spec.vocab_size,
                "num_experts": spec.moe.num_experts, "sliding_window": spec.sliding_window,
                "block_size": spec.block_size, "topk_tokens": spec.topk_tokens,
                "param_seed": 0, "token_seed": 1, "lengths": LENGTHS},
      "logits": {"sum": float(flat.sum()), "sum_sq": float(np.sum(flat ** 2)),
                 "sum_abs": float(np.sum(np.abs(flat))), "count": int(flat.size),
                 "token_norm": [float(x) for x in np.linalg.norm(real, axis=-1)],
                 "sample_index": [int(i) for i in sample_idx],
                 "sample_value": [float(flat[i]) for i in sample_idx]},
      "choices": choices,
      "generated_with": {"jax": jax.__version__, "backend": jax.default_backend()},
  }


def test_logits_and_choices_match_the_stored_golden_values():
  got = compute_golden()
  if os.environ.get("REGENERATE_GOLDEN") == "1":
    GOLDEN_PATH.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN_PATH.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    pytest.skip(f"REGENERATE_GOLDEN=1: wrote {GOLDEN_PATH}; nothing was checked")
  assert GOLDEN_PATH.exists(), (
      f"{GOLDEN_PATH} is missing; create it with REGENERATE_GOLDEN=1 (see the docstring)")
  want = json.loads(GOLDEN_PATH.read_text())
  assert got["model"] == want["model"], "the golden config changed; regenerate on purpose"
  g, w = got["logits"], want["logits"]
  assert g["count"] == w["count"] and g["sample_index"] == w["sample_index"]
  rms = np.sqrt(w["sum_sq"] / w["count"])
  drift = {
      "sum": abs(g["sum"] - w["sum"]) / w["sum_abs"],
      "sum_sq": abs(g["sum_sq"] - w["sum_sq"]) / w["sum_sq"],
      "sum_abs": abs(g["sum_abs"] - w["sum_abs"]) / w["sum_abs"],
      "samples": max(abs(a - b) / max(abs(b), rms)
                     for a, b in zip(g["sample_value"], w["sample_value"])),
      "token_norm": max(abs(a - b) / b for a, b in zip(g["token_norm"], w["token_norm"])),
  }
  bad = {k: v for k, v in drift.items() if not v <= RTOL}
  assert not bad, f"logits drifted from the golden values (relative): {bad}"
  assert got["choices"] == want["choices"], (
      "expert routing or block selection changed: "
      f"{ {k: (got['choices'].get(k), v) for k, v in want['choices'].items()} }")
