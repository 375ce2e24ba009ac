"""KV caches: decoding through the cache computes exactly what one full forward computes.

The reference is always the uncached full-sequence forward of the same params
(`cache=None`, positions 0..L-1, -1 past each row's length). Every cached path
(token-by-token decode with ragged rows, chunked prefill then decode, slot reset,
prompt fan-out with gather/scatter) must reproduce its logits to max abs 1e-4
(fp32; logits have rms ~6). Cache bytes are checked against hand arithmetic and
the arrays `init_cache` allocates.

Models: "SGF" (dense FFN then two MoE layers; all three attention types in one
stack) and single-layer "S", "G", "F" MoE models, with W=8, B=4, k=8 (2 of up to
10 blocks), so 40-token sequences wrap the ring 5 times and cross 10 blocks.
Each model compiles three shapes only (full [3, 40], chunk [3, 16], decode [3, 1]);
shorter chunks are padded with position -1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentic_rl.model import cache as cache_lib
from agentic_rl.model.transformer import Model
from tests.model.model_fixtures import (check_block_causality, draw_params, make_spec,
                                        padded_positions)

ATOL = 1e-4
BATCH, FULL_LEN, CACHE_LEN, CHUNK = 3, 40, 64, 16


SPECS = {
    "SGF": make_spec("SGF", 3, num_dense_layers=1),
    "S": make_spec("S", 1, num_dense_layers=0),
    "G": make_spec("G", 1, num_dense_layers=0),
    "F": make_spec("F", 1, num_dense_layers=0),
}


class Harness:
  """One model, its params, one jitted forward, and the full-forward reference."""

  def __init__(self, spec, seed):
    self.spec = spec
    self.model = Model(spec)
    self.params = draw_params(self.model, seed)
    self.fwd = jax.jit(self.model.forward)

  def full_logits(self, tokens_bl, lengths_b):
    """Uncached logits [B, FULL_LEN, V]; rows padded with position -1 past their length."""
    positions = padded_positions(lengths_b, FULL_LEN)
    tokens = np.zeros((BATCH, FULL_LEN), np.int32)
    for b, n in enumerate(lengths_b):
      tokens[b, :n] = tokens_bl[b][:n]
    logits, new_cache, _ = self.fwd(self.params, jnp.asarray(tokens), jnp.asarray(positions))
    assert new_cache is None
    return np.asarray(logits)

  def step(self, cache, rows: dict[int, tuple[np.ndarray, int]], width: int):
    """One cached call. rows: b -> (tokens, first position); other rows sit out (-1).

    Returns (new cache, {b: logits [n, V]}, aux)."""
    tokens = np.zeros((BATCH, width), np.int32)
    positions = np.full((BATCH, width), -1, np.int32)
    for b, (toks, start) in rows.items():
      tokens[b, :len(toks)] = toks
      positions[b, :len(toks)] = start + np.arange(len(toks))
    logits, cache, aux = self.fwd(self.params, jnp.asarray(tokens), jnp.asarray(positions),
                                  cache)
    logits = np.asarray(logits)
    check_block_causality(self.spec, aux, positions)
    return cache, {b: logits[b, :len(t)] for b, (t, _) in rows.items()}, aux


@functools.lru_cache(maxsize=None)
def harness(name: str) -> Harness:
  return Harness(SPECS[name], seed=1)


def random_tokens(seed, n=FULL_LEN):
  return np.random.default_rng(seed).integers(0, 64, (BATCH, n)).astype(np.int32)


def assert_matches_full(h, tokens_bl, got: dict[int, dict[int, np.ndarray]], lengths_b):
  """got[b][p] = cached logits of row b at position p; compared with one full forward."""
  want = h.full_logits(tokens_bl, lengths_b)
  for b, per_pos in got.items():
    assert sorted(per_pos) == list(range(lengths_b[b])), f"row {b} missed positions"
    cached = np.stack([per_pos[p] for p in range(lengths_b[b])])
    err = np.max(np.abs(cached - want[b, :lengths_b[b]]))
    assert err < ATOL, f"row {b}: cached vs uncached max abs diff {err:.3g}"


def run(h, cache, tokens_bl, starts_b, schedules_b, ends_b):
  """Feeds each row b its tokens from starts_b[b]: first the prefill chunk sizes in
  schedules_b[b] (one per call, all rows in the same calls), then one token per call
  until ends_b[b]. Rows with nothing left sit out. Returns (cache, got)."""
  got = {b: {} for b in range(BATCH)}
  written = list(starts_b)
  calls = max(len(s) for s in schedules_b)
  for c in range(calls):
    rows = {}
    for b in range(BATCH):
      if c < len(schedules_b[b]):
        n = schedules_b[b][c]
        rows[b] = (tokens_bl[b][written[b]:written[b] + n], written[b])
    cache, out, _ = h.step(cache, rows, CHUNK)
    for b, (toks, start) in rows.items():
      for i in range(len(toks)):
        got[b][start + i] = out[b][i]
      written[b] += len(toks)
  while any(written[b] < ends_b[b] for b in range(BATCH)):
    rows = {b: (tokens_bl[b][written[b]:written[b] + 1], written[b])
            for b in range(BATCH) if written[b] < ends_b[b]}
    cache, out, _ = h.step(cache, rows, 1)
    for b in rows:
      got[b][written[b]] = out[b][0]
      written[b] += 1
  return cache, got


PATTERNS = sorted(SPECS)


@pytest.mark.parametrize("name", PATTERNS)
def test_ragged_token_by_token_decode_matches_full_forward(name):
  """Rows start at different steps (sitting out with position -1 until then) and stop at
  different lengths, so every decode step mixes positions."""
  h = harness(name)
  tokens = random_tokens(10)
  lengths = [40, 29, 17]
  starts_at_step = [0, 5, 11]
  cache = h.model.init_cache(BATCH, CACHE_LEN)
  got = {b: {} for b in range(BATCH)}
  for step in range(max(s + n for s, n in zip(starts_at_step, lengths))):
    rows = {}
    for b in range(BATCH):
      p = step - starts_at_step[b]
      if 0 <= p < lengths[b]:
        rows[b] = (tokens[b, p:p + 1], p)
    before = [np.asarray(x) for x in jax.tree.leaves(cache)]
    cache, out, _ = h.step(cache, rows, 1)
    for b, logits in out.items():
      got[b][rows[b][1]] = logits[0]
    idle = sorted(set(range(BATCH)) - set(rows))
    for x, y in zip(before, jax.tree.leaves(cache)):  # rows sitting out keep their cache
      np.testing.assert_array_equal(x[idle], np.asarray(y)[idle])
  np.testing.assert_array_equal(cache["lengths"], lengths)
  assert_matches_full(h, tokens, got, lengths)


SCHEDULES = {
    # Two full-width chunks (each longer than W=8), then decode.
    "uniform": ([16, 16], [16, 16], [16, 16]),
    # Every row its own chunk sizes in the same calls: short, longer than W, ring-aligned.
    "ragged": ([12, 12, 6], [16, 5], [3, 3, 8]),
    "single_chunk": ([1], [8], [15]),
}


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_chunked_prefill_then_decode_matches_full_forward(name, schedule):
  h = harness(name)
  tokens = random_tokens(20)
  schedules = SCHEDULES[schedule]
  ends = [max(40 - 7 * b, sum(schedules[b])) for b in range(BATCH)]
  cache, got = run(h, h.model.init_cache(BATCH, CACHE_LEN), tokens, [0, 0, 0], schedules,
                   ends)
  np.testing.assert_array_equal(cache["lengths"], ends)
  assert_matches_full(h, tokens, got, ends)


@pytest.mark.parametrize("name", PATTERNS)
def test_reset_slot_runs_a_new_sequence_like_a_fresh_cache(name):
  """After a slot is reset, stale ring entries, full-cache rows and block summaries of
  its old (longer) sequence must not leak into its new sequence; other slots go on."""
  h = harness(name)
  old = random_tokens(30)
  cache, _ = run(h, h.model.init_cache(BATCH, CACHE_LEN), old, [0, 0, 0],
                 ([16, 16], [16, 14], [16, 4]), [40, 30, 20])
  reset = jnp.asarray([True, False, True])
  cache = cache_lib.reset_sequences(cache, reset)
  np.testing.assert_array_equal(cache["lengths"], [0, 30, 0])
  for layer_type, layer in zip(h.spec.layer_types, cache["layers"]):
    if layer_type == "S":
      assert np.all(np.asarray(layer["pos"])[[0, 2]] == -1)
      assert np.all(np.asarray(layer["pos"])[1] >= 0)
  new = random_tokens(31)
  mixed = np.stack([new[0], old[1], new[2]])
  cache, got = run(h, cache, mixed, [0, 30, 0], ([16, 8], [5], [3, 2]), [24, 38, 10])
  assert_matches_full(h, new, {0: got[0], 2: got[2]}, [24, 0, 10])
  old_row = {p: got[1][p] for p in range(30, 38)}
  want_old = h.full_logits(old, [40, 38, 20])[1, 30:38]
  assert np.max(np.abs(np.stack([old_row[p] for p in range(30, 38)]) - want_old)) < ATOL


@pytest.mark.parametrize("name", PATTERNS)
def test_gathered_prompt_cache_continues_identically(name):
  """One prompt prefilled once, copied into every row (gather), then three different
  continuations; and the same prompt scattered into a slot of a busy cache."""
  h = harness(name)
  tokens = random_tokens(40)
  prompt_len, total = 13, 33
  tokens[:, :prompt_len] = tokens[1, :prompt_len]  # every row shares row 1's prompt
  cache, _ = run(h, h.model.init_cache(BATCH, CACHE_LEN), tokens, [0, 0, 0],
                 ([], [13], []), [0, prompt_len, 0])
  fanned = cache_lib.gather_sequences(cache, jnp.asarray([1, 1, 1]))
  np.testing.assert_array_equal(fanned["lengths"], [prompt_len] * 3)
  _, got = run(h, fanned, tokens, [prompt_len] * 3, ([], [], []), [total] * 3)
  want = h.full_logits(tokens, [total] * 3)
  for b in range(BATCH):
    cached = np.stack([got[b][p] for p in range(prompt_len, total)])
    err = np.max(np.abs(cached - want[b, prompt_len:total]))
    assert err < ATOL, f"gathered row {b}: max abs diff {err:.3g}"

  # Scatter: row 0 of a busy cache runs another sequence; the prompt lands in row 2.
  other = random_tokens(41)
  busy, _ = run(h, h.model.init_cache(BATCH, CACHE_LEN), other, [0, 0, 0],
                ([16, 4], [], [16, 16]), [20, 0, 32])
  busy = cache_lib.scatter_sequences(busy, jnp.asarray([2]),
                                     cache_lib.gather_sequences(cache, jnp.asarray([1])))
  np.testing.assert_array_equal(busy["lengths"], [20, 0, prompt_len])
  both = np.stack([other[0], other[1], tokens[2]])
  _, got = run(h, busy, both, [20, 0, prompt_len], ([], [], []), [30, 0, total])
  want_other = h.full_logits(other, [30, 0, 0])[0]
  err0 = np.max(np.abs(np.stack([got[0][p] for p in range(20, 30)]) - want_other[20:30]))
  err2 = np.max(np.abs(np.stack([got[2][p] for p in range(prompt_len, total)])
                       - want[2, prompt_len:total]))
  assert err0 < ATOL and err2 < ATOL, (err0, err2)


def test_decode_records_a_replay_that_a_full_forward_reproduces():
  """Sampler/learner alignment: the blocks and experts chosen step by step through the
  cache equal those of the full forward, and forcing them (replay) on the full forward
  reproduces the decoded logits."""
  h = harness("SGF")
  tokens = random_tokens(50)
  lengths = [40, 29, 17]
  cache = h.model.init_cache(BATCH, CACHE_LEN)
  steps = []
  for p in range(max(lengths)):
    rows = {b: (tokens[b, p:p + 1], p) for b in range(BATCH) if p < lengths[b]}
    cache, out, aux = h.step(cache, rows, 1)
    steps.append((out, aux))
  positions = padded_positions(lengths, FULL_LEN)
  replay = []
  for i in range(h.spec.num_layers):
    entry = {}
    for key, axis in (("blocks", 2), ("experts", 1)):
      if key in steps[0][1]["layers"][i]:
        recorded = np.concatenate([np.asarray(a["layers"][i][key]) for _, a in steps], axis)
        pad = [(0, 0)] * recorded.ndim
        pad[axis] = (0, FULL_LEN - recorded.shape[axis])
        # Padding positions: no block (-1); any valid expert id (0).
        entry[key] = jnp.asarray(np.pad(recorded, pad, constant_values=-1 if key == "blocks"
                                        else 0))
    replay.append(entry)
  replay = tuple(replay)
  assert any("blocks" in e for e in replay) and any("experts" in e for e in replay)
  tokens_in = jnp.asarray(np.where(positions >= 0, tokens, 0))
  free_logits, _, free_aux = h.fwd(h.params, tokens_in, jnp.asarray(positions))
  logits, _, aux = h.fwd(h.params, tokens_in, jnp.asarray(positions), replay=replay)
  valid = positions >= 0
  for i, entry in enumerate(replay):
    for key, forced in entry.items():
      # Compared on real tokens only: padding carries no recorded choice.
      live = valid if key == "experts" else np.broadcast_to(valid[:, None],
                                                             forced.shape[:3])
      forced = np.asarray(forced)
      np.testing.assert_array_equal(np.asarray(aux["layers"][i][key])[live], forced[live])
      # The full forward's own choice is the decode's choice, as a set (top-n order is
      # not part of the contract).
      chosen = np.asarray(free_aux["layers"][i][key])
      np.testing.assert_array_equal(np.sort(chosen, -1)[live], np.sort(forced, -1)[live])
  decoded = np.zeros((BATCH, FULL_LEN, h.spec.vocab_size), np.float32)
  for p, (out, _) in enumerate(steps):
    for b, lg in out.items():
      decoded[b, p] = lg[0]
  for got in (logits, free_logits):
    err = np.max(np.abs(np.asarray(got)[valid] - decoded[valid]))
    assert err < ATOL, f"decode vs full forward max abs diff {err:.3g}"


# --- Cache bytes ---------------------------------------------------------------------

def test_cache_bytes_per_sequence_by_hand():
  spec = SPECS["SGF"]  # K=2 kv heads, D=8, W=8, B=4, float32
  kv_token = 2 * 8 * 4  # bytes of one token's key (or value) in one layer
  # 40 tokens: the S ring holds W=8 slots of k, v and an int32 position; G holds all 40
  # tokens' k and v plus ceil(40/4)=10 block means; F holds 40 tokens' k and v; plus the
  # int32 length counter.
  s_layer = 8 * (2 * kv_token + 4)
  g_layer = 40 * 2 * kv_token + 10 * kv_token
  f_layer = 40 * 2 * kv_token
  assert cache_lib.cache_bytes_per_sequence(spec, 40) == 4 + s_layer + g_layer + f_layer
  assert 4 + s_layer + g_layer + f_layer == 11940
  # Shorter than the window, with a partial block: the ring is only as full as the sequence.
  assert cache_lib.cache_bytes_per_sequence(spec, 6) == (
      4 + 6 * (2 * kv_token + 4) + (6 * 2 * kv_token + 2 * kv_token) + 6 * 2 * kv_token)
  # Ring buffers stop growing at W; full layers grow linearly.
  grow = cache_lib.cache_bytes_per_sequence(spec, 80) - cache_lib.cache_bytes_per_sequence(
      spec, 40)
  assert grow == 40 * 2 * kv_token * 2 + 10 * kv_token


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", PATTERNS)
def test_cache_bytes_equal_the_allocated_arrays(name, cache_dtype):
  spec = SPECS[name].replace(cache_dtype=cache_dtype)
  for length in (8, 40, 64):  # block multiples, at least W
    cache = cache_lib.init_cache(spec, 1, length)
    allocated = sum(x.nbytes for x in jax.tree.leaves(cache))
    assert cache_lib.cache_bytes_per_sequence(spec, length) == allocated, (name, length)


def test_init_cache_rejects_a_length_off_the_block_grid():
  with pytest.raises(ValueError, match=r"max_len=42 must be a multiple of block_size=4"):
    cache_lib.init_cache(SPECS["G"], 1, 42)
