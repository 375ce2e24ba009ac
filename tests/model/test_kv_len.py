"""A cached call given kv_len reads only the cache's first kv_len positions: the same
logits, cache and block choices as a call over the whole capacity, for S, G and F layers,
scanned or not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model.transformer import Model
from tests.model.model_fixtures import draw_params, make_spec

B = 2


def _generate(model, params, tokens, kv_len):
  fwd = jax.jit(model.forward, static_argnames="kv_len")
  cache = model.init_cache(B, 64)
  pos = np.broadcast_to(np.arange(12, dtype=np.int32), (B, 12))
  logits, cache, aux = fwd(params, jnp.asarray(tokens[:, :12]), jnp.asarray(pos), cache,
                           kv_len=kv_len)
  out, layers = [logits], [aux["layers"]]
  for p in range(12, 16):
    logits, cache, aux = fwd(params, jnp.asarray(tokens[:, p:p + 1]),
                             jnp.full((B, 1), p, jnp.int32), cache, kv_len=kv_len)
    out.append(logits)
    layers.append(aux["layers"])
  return np.concatenate(out, axis=1), layers, cache


@pytest.mark.parametrize("pattern,scan", [("SGF", False), ("SSSG", True)])
def test_kv_len_reads_less_and_computes_the_same(pattern, scan):
  spec = make_spec(pattern, 8 if scan else 3).replace(scan_layers=scan)
  model = Model(spec)
  params = draw_params(model, 2)
  tokens = np.asarray(np.random.default_rng(1).integers(0, 64, (B, 16)), np.int32)
  want, want_layers, want_cache = _generate(model, params, tokens, None)
  got, got_layers, got_cache = _generate(model, params, tokens, 16)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_layers), jax.tree.leaves(want_layers)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_a_position_at_or_past_kv_len_is_refused_or_nan():
  spec = make_spec("SGF", 3)
  model = Model(spec)
  params = draw_params(model, 2)
  cache = model.init_cache(B, 64)
  tokens = jnp.zeros((B, 8), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (B, 8))
  with pytest.raises(ValueError, match="cache capacity 4"):
    model.forward(params, tokens, pos, cache, kv_len=4)
  with pytest.raises(ValueError, match="kv_len=6: a cached call's multiple of block_size=4"):
    model.forward(params, tokens, pos, cache, kv_len=6)
  logits, _, _ = jax.jit(model.forward, static_argnames="kv_len")(params, tokens, pos, cache,
                                                                  kv_len=4)
  assert np.isnan(np.asarray(logits)[:, 4:]).all() and np.isfinite(logits[:, :4]).all()
