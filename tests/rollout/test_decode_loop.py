"""DeviceSteps.decode's on-device loop against one forward-and-draw per call: the same
draws, stopped where the budgets and stop ids say, on a cache cut to a length bucket."""

import jax
import jax.numpy as jnp
import numpy as np

from agentic_rl.model import cache as cache_lib


def _fill(model, params, steps, rows: int, lengths):
  """A cache whose row r holds `lengths[r]` prompt tokens (prefilled one call per row)."""
  cache = model.init_cache(rows, 64)
  host = np.zeros(rows, np.int64)
  rng = np.random.default_rng(0)
  for r, n in enumerate(lengths):
    tokens = np.zeros((1, steps.chunk), np.int32)
    positions = np.full((1, steps.chunk), -1, np.int32)
    tokens[0, :n] = rng.integers(1, 200, n)
    positions[0, :n] = np.arange(n)
    cache, _ = steps.prefill(params, cache, np.array([r], np.int32), tokens, positions,
                             np.zeros(1, np.uint32), np.full(1, -1, np.int32), host[[r]])
    host[r] = n
  return cache, host


def test_the_loop_equals_single_steps_and_stops_each_row_on_its_budget_or_a_stop_id(
    tiny_model, sampled_steps):
  model, params = tiny_model
  steps = sampled_steps
  lengths = [5, 9, 3, 7]
  tokens = np.array([11, 12, 13, 14], np.int32)
  seeds = np.array([1, 2, 3, 4], np.uint32)
  budget = np.array([0, 2, 6, 6], np.int32)  # Row 0 flushes; row 1 stops after 2 draws.
  forced = np.full((4, 6), -1, np.int32)
  forced[3, :3] = [40, 41, 42]  # Teacher ids, then draws.
  # Reference: one step per call, each row fed its own last draw while it runs.
  cache, host = _fill(model, params, steps, 4, lengths)
  positions = np.array(lengths, np.int32)
  feed, active = tokens.copy(), np.ones(4, bool)
  want = {r: [] for r in range(4)}
  stop_id = None
  for i in range(6):
    pos = np.where(active, positions, -1).astype(np.int32)
    cache, out = steps.decode(params, cache, feed, pos, seeds, forced[:, i].copy(), host)
    out = jax.device_get(out)
    host += active
    for r in np.nonzero(active)[0]:
      want[r].append((int(out.tokens_nb[0, r]), float(out.logp_nb[0, r])))
      if len(want[r]) >= budget[r] or out.tokens_nb[0, r] == stop_id:
        active[r] = False
    if i == 2 and stop_id is None:
      stop_id = int(out.tokens_nb[0, 2])  # Row 2's third draw: a stop id for the loop run.
      active[2] = False
    feed = np.where(active, out.tokens_nb[0], feed).astype(np.int32)
    positions += active
  want_cache = cache
  # The loop, once.
  cache, host = _fill(model, params, steps, 4, lengths)
  is_stop = np.zeros(model.spec.vocab_size, bool)
  is_stop[stop_id] = True
  cache, out = steps.decode(params, cache, tokens, np.array(lengths, np.int32), seeds, forced,
                            host, budget_b=budget, is_stop_v=is_stop)
  out = jax.device_get(out)
  for r in range(4):
    got = [(int(out.tokens_nb[i, r]), float(out.logp_nb[i, r]))
           for i in range(out.drawn_b[r])]
    # Row 0's one fed token draws too (ignored by the engine: a flush).
    assert [t for t, _ in got] == [t for t, _ in want[r]], r
    np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want[r]], atol=1e-5)
  assert list(out.drawn_b) == [1, 2, 3, 6] and int(out.steps) == 6
  assert [t for t, _ in want[3][:3]] == [40, 41, 42]
  for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_a_loop_whose_rows_all_stop_ends_early_and_a_capped_one_after_max_steps(
    tiny_model, sampled_steps):
  model, params = tiny_model
  cache, host = _fill(model, params, sampled_steps, 2, [4, 6])
  args = (np.array([5, 6], np.int32), np.array([4, 6], np.int32), np.array([1, 2], np.uint32),
          np.full((2, 8), -1, np.int32), host)
  cache, out = sampled_steps.decode(params, cache, *args, budget_b=np.array([3, 2], np.int32))
  assert int(out.steps) == 3 and list(np.asarray(out.drawn_b)) == [3, 2]
  cache, host = _fill(model, params, sampled_steps, 2, [4, 6])
  cache, out = sampled_steps.decode(params, cache, *args[:4], host,
                                    budget_b=np.array([8, 8], np.int32), max_steps=2)
  assert int(out.steps) == 2 and list(np.asarray(out.drawn_b)) == [2, 2]


def test_a_head_cuts_full_buffers_and_scatters_back_into_its_rows(tiny_model):
  """Prefill's path: rows gathered from a head, written, scattered back: only the head's
  positions of those rows change, every layer kind."""
  model, _ = tiny_model
  rng = np.random.default_rng(3)
  cache = jax.tree.map(lambda x: np.asarray(rng.integers(-1, 9, x.shape), x.dtype),
                       model.init_cache(2, 64))
  part = cache_lib.head(cache, 16)
  assert cache_lib.capacity(part) == 16
  for full, cut in zip(cache["layers"], part["layers"]):
    for key in full:
      want = full[key] if "pos" in full else full[key][:, :full[key].shape[1] * 16 // 64]
      np.testing.assert_array_equal(cut[key], want)
  rows = np.array([1])
  changed = jax.tree.map(lambda x: x + 1, cache_lib.gather_sequences(part, rows))
  back = jax.device_get(cache_lib.scatter_sequences(jax.tree.map(jnp.asarray, cache), rows,
                                                    changed))
  for full, new, old in zip(back["layers"], changed["layers"], cache["layers"]):
    for key in full:
      n = new[key].shape[1]
      np.testing.assert_array_equal(full[key][1, :n], new[key][0])
      np.testing.assert_array_equal(full[key][1, n:], old[key][1, n:])
      np.testing.assert_array_equal(full[key][0], old[key][0])
