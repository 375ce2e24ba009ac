"""Mismatch metrics on constructed arrays, against numpy loops and python sets."""

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.rl import mismatch

_STATIC = ("num_turns", "num_position_buckets", "max_position")
logprob_sums = jax.jit(mismatch.logprob_mismatch_sums, static_argnames=_STATIC)
selection_sums = jax.jit(mismatch.selection_agreement_sums, static_argnames=_STATIC)


def _random_case(seed=0, b=3, t=20):
  rng = np.random.default_rng(seed)
  sampler = np.log(rng.uniform(0.01, 1.0, (b, t)))
  learner = sampler + rng.normal(scale=0.6, size=(b, t))
  mask = (rng.random((b, t)) < 0.7).astype(np.float32)
  mask[:, 0] = 0
  turns = np.sort(rng.integers(0, 5, (b, t)), axis=1)
  positions = np.broadcast_to(np.arange(t), (b, t)).copy()
  positions[2, 15:] = -1
  mask[2, 15:] = 0
  return learner, sampler, mask, turns, positions


def test_logprob_mismatch_matches_numpy_per_bucket():
  learner, sampler, mask, turns, positions = _random_case()
  num_turns, num_buckets, max_pos = 3, 4, 20  # turns 3, 4 fold into bucket 2
  sums = logprob_sums(
      jnp.asarray(learner, jnp.float32), jnp.asarray(sampler, jnp.float32), jnp.asarray(mask),
      jnp.asarray(turns), jnp.asarray(positions), num_turns=num_turns,
      num_position_buckets=num_buckets, max_position=max_pos)
  out = {k: np.asarray(v) for k, v in mismatch.finalize(sums).items()}

  log_r = (learner - sampler)
  on = mask > 0

  def expect(sel):
    lr = log_r[sel]
    r = np.exp(lr)
    if lr.size == 0:
      return dict(n=0, k1=0, k3=0, mean=0, max=0, out=0)
    return dict(n=lr.size, k1=np.mean(-lr), k3=np.mean(r - 1 - lr), mean=np.mean(np.abs(lr)),
                max=np.max(np.abs(lr)), out=np.mean((r < 0.5) | (r > 2)))

  def check(prefix, e, idx=None):
    get = (lambda k: out[f"mismatch/{prefix}{k}"]) if idx is None else (
        lambda k: out[f"mismatch/{prefix}{k}"][idx])
    np.testing.assert_allclose(get("num_tokens"), e["n"])
    np.testing.assert_allclose(get("k1"), e["k1"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(get("k3"), e["k3"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(get("abs_logp_diff_mean"), e["mean"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(get("abs_logp_diff_max"), e["max"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(get("ratio_outside_frac"), e["out"], rtol=1e-5, atol=1e-6)

  check("", expect(on))
  for j in range(num_turns):
    check("by_turn/", expect(on & (np.minimum(turns, num_turns - 1) == j)), j)
  bucket = np.maximum(positions, 0) * num_buckets // max_pos
  for j in range(num_buckets):
    check("by_position/", expect(on & (bucket == j)), j)


def test_sums_from_halves_combine_to_whole():
  learner, sampler, mask, turns, positions = _random_case(seed=1, b=4)
  kw = dict(num_turns=5, num_position_buckets=4, max_position=20)
  f = lambda s: logprob_sums(
      jnp.asarray(learner[s], jnp.float32), jnp.asarray(sampler[s], jnp.float32),
      jnp.asarray(mask[s]), jnp.asarray(turns[s]), jnp.asarray(positions[s]), **kw)
  whole = mismatch.finalize(f(slice(None)))
  halves = mismatch.finalize(mismatch.combine_sums(f(slice(0, 2)), f(slice(2, 4))))
  for k in whole:
    np.testing.assert_allclose(np.asarray(halves[k]), np.asarray(whole[k]), rtol=1e-5, atol=1e-7)


def test_set_overlap_matches_python_sets():
  rng = np.random.default_rng(0)
  a = np.stack([rng.permutation(12)[:5] for _ in range(50)])
  b = np.stack([rng.permutation(12)[:5] for _ in range(50)])
  a[::3, -2:] = -1  # unused slots
  b[::4, -1] = -1
  got = np.asarray(mismatch.set_overlap(jnp.asarray(a), jnp.asarray(b)))
  want = [len((set(x) - {-1}) & (set(y) - {-1})) for x, y in zip(a, b)]
  np.testing.assert_array_equal(got, want)


def test_selection_agreement_matches_python():
  rng = np.random.default_rng(0)
  b, t, k, e, heads, n = 2, 10, 2, 6, 2, 3
  positions = np.broadcast_to(np.arange(t), (b, t)).copy()
  positions[1, 8:] = -1
  turns = np.zeros((b, t), np.int32)
  turns[:, 5:] = 1

  def experts():
    return np.stack([[rng.permutation(e)[:k] for _ in range(t)] for _ in range(b)])

  def blocks():
    out = np.full((b, heads, t, n), -1)
    for i in range(b):
      for h in range(heads):
        for j in range(t):
          used = min(n, j // 3 + 1)
          out[i, h, j, :used] = rng.permutation(4)[:used]
    return out

  mine = ({}, {"experts": experts()}, {"experts": experts(), "blocks": blocks()})
  theirs = ({}, {"experts": experts()}, {"experts": experts(), "blocks": blocks()})
  sums = selection_sums(
      jax_tree(mine), jax_tree(theirs), jnp.asarray(positions), jnp.asarray(turns),
      num_turns=2, num_position_buckets=2, max_position=t)
  out = mismatch.finalize(sums)
  valid = positions >= 0

  def route(sel_layers, sel_tok):
    num = den = exact = toks = 0
    for layer in sel_layers:
      for i in range(b):
        for j in range(t):
          if valid[i, j] and sel_tok(i, j):
            ov = len(set(mine[layer]["experts"][i, j]) & set(theirs[layer]["experts"][i, j]))
            num, den, exact, toks = num + ov, den + k, exact + (ov == k), toks + 1
    return num / den, exact / toks

  def block(sel_tok):
    num = den = 0
    for i in range(b):
      for h in range(heads):
        for j in range(t):
          if valid[i, j] and sel_tok(i, j):
            s = set(theirs[2]["blocks"][i, h, j]) - {-1}
            num += len((set(mine[2]["blocks"][i, h, j]) - {-1}) & s)
            den += len(s)
    return num / den

  every = lambda i, j: True
  agree, exact = route([1, 2], every)
  np.testing.assert_allclose(out["mismatch/routing_agreement"], agree, rtol=1e-6)
  np.testing.assert_allclose(out["mismatch/routing_exact_match"], exact, rtol=1e-6)
  np.testing.assert_allclose(out["mismatch/by_layer/routing_agreement"],
                             [0, route([1], every)[0], route([2], every)[0]], rtol=1e-6)
  np.testing.assert_allclose(out["mismatch/by_turn/routing_agreement"],
                             [route([1, 2], lambda i, j: turns[i, j] == u)[0] for u in (0, 1)],
                             rtol=1e-6)
  np.testing.assert_allclose(out["mismatch/block_agreement"], block(every), rtol=1e-6)
  np.testing.assert_allclose(out["mismatch/by_position/block_agreement"],
                             [block(lambda i, j: j < 5), block(lambda i, j: j >= 5)], rtol=1e-6)
  # Identical selections agree fully.
  same = mismatch.finalize(selection_sums(
      jax_tree(theirs), jax_tree(theirs), jnp.asarray(positions), jnp.asarray(turns),
      num_turns=2, num_position_buckets=2, max_position=t))
  assert float(same["mismatch/routing_agreement"]) == 1.0
  assert float(same["mismatch/routing_exact_match"]) == 1.0
  assert float(same["mismatch/block_agreement"]) == 1.0


def jax_tree(layers):
  return tuple({k: jnp.asarray(v, jnp.int32) for k, v in layer.items()} for layer in layers)
