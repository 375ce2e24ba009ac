"""Logit parity with transformers on tiny random Qwen3, Qwen3-MoE and Llama 3 models: the
full forward, and chunked prefill plus decode through our cache, to 1e-4 in float32."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from agentic_rl.interop.hf_source import TensorSource  # noqa: E402
from agentic_rl.model import families  # noqa: E402
from agentic_rl.model.families import layout  # noqa: E402
from agentic_rl.model.transformer import Model  # noqa: E402
from tests.hf import model_fixture  # noqa: E402

FAMILIES = ("qwen3", "qwen3_moe", "llama")


def _ours(hf_model):
  cfg = hf_model.config.to_dict()
  spec = families.spec_from_hf(cfg, max_seq_len=64)
  source = TensorSource.from_arrays(model_fixture.state_dict(hf_model))
  flat = {r.ours: r.to_ours([source.read(n) for n in r.hf]) for r in layout.rules(spec)}
  used = {n for r in layout.rules(spec) for n in r.hf}
  tied = {"lm_head.weight"} if spec.tie_embeddings else set()
  assert set(source.names) - used == tied  # Every Hugging Face tensor has a rule.
  model = Model(spec)
  shapes = {"/".join(p.key for p in path): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(model.param_shapes())}
  assert shapes == {k: v.shape for k, v in flat.items()}
  return model, jax.tree.map(jnp.asarray, layout.nest(flat))


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
  hf_model = model_fixture.build(request.param)
  return request.param, hf_model, *_ours(hf_model)


def _tokens(vocab, b=2, t=20, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (b, t), dtype=np.int32)


def test_full_forward_matches_transformers(pair):
  _, hf_model, model, params = pair
  tokens = _tokens(model.spec.vocab_size)
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  ours, _, _ = model.forward(params, tokens, positions)
  theirs = model_fixture.logits(hf_model, tokens)
  assert np.abs(np.asarray(ours) - theirs).max() < 1e-4
  assert np.abs(theirs).max() > 1.0  # Not a degenerate comparison of near-zero logits.


def test_chunked_prefill_and_decode_match_transformers(pair):
  _, hf_model, model, params = pair
  tokens = _tokens(model.spec.vocab_size, t=24, seed=1)
  theirs = model_fixture.logits(hf_model, tokens)
  cache = model.init_cache(tokens.shape[0], 32)
  got = []
  for start, stop in ((0, 7), (7, 16)) + tuple((t, t + 1) for t in range(16, 24)):
    chunk = tokens[:, start:stop]
    positions = np.broadcast_to(np.arange(start, stop, dtype=np.int32), chunk.shape)
    logits, cache, _ = model.forward(params, chunk, positions, cache)
    got.append(np.asarray(logits))
  assert np.abs(np.concatenate(got, axis=1) - theirs).max() < 1e-4


def test_the_moe_layers_follow_mlp_only_layers_and_sparse_step():
  spec = families.spec_from_hf({**model_fixture.FAMILY_CONFIGS["qwen3_moe"],
                                "model_type": "qwen3_moe", "decoder_sparse_step": 2,
                                "mlp_only_layers": [3]})
  # Layer i is MoE iff (i + 1) % 2 == 0 and i not in [3]: layer 1 only.
  assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
