"""rollout/prefill_shapes.py and device_batch.prefill_batch: the smallest shape, by hand."""

import types

import numpy as np

from agentic_rl.rollout import device_batch
from agentic_rl.rollout import prefill_shapes as ps
from agentic_rl.rollout.config import RolloutSpec


def test_halvings():
  assert ps.halvings(64, 16) == (16, 32, 64)
  assert ps.halvings(256, 16) == (16, 32, 64, 128, 256)
  assert ps.halvings(96, 16) == (24, 48, 96)  # Not a power of two: halves rounded up.
  assert ps.halvings(8, 16) == (8,)  # Below the minimum: the one size.
  assert ps.halvings(4, 1) == (1, 2, 4) and ps.halvings(3, 1) == (1, 2, 3)
  assert ps.halvings(1, 1) == (1,)


def test_smallest_holding():
  sizes = (16, 32, 64)
  assert [ps.smallest_holding(sizes, n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, 64]


SPEC = RolloutSpec(num_slots=8, prefill_chunk=64, prefill_rows=4, prompt_store_rows=4,
                   prefill_chunk_min=16)


def test_spec_shapes():
  assert ps.chunk_sizes(SPEC) == (16, 32, 64) and ps.row_counts(SPEC) == (1, 2, 4)
  one_chunk = RolloutSpec(prefill_chunk=64, prefill_chunk_min=64, prefill_rows=2)
  assert ps.chunk_sizes(one_chunk) == (64,) and ps.row_counts(one_chunk) == (1, 2)
  off = RolloutSpec(prefill_chunk=64, prefill_rows=4)  # prefill_chunk_min 0: one shape.
  assert ps.chunk_sizes(off) == (64,) and ps.row_counts(off) == (4,)


def _owner(slot: int, length: int, cache_len: int):
  builder = types.SimpleNamespace(tokens=list(range(length)), length=length)
  return types.SimpleNamespace(slot=slot, builder=builder, cache_len=cache_len,
                               member=types.SimpleNamespace(seed=slot), forced=[])


def test_prefill_batch_takes_the_smallest_shape_that_holds_its_owners():
  spec = SPEC
  # One owner with 10 tokens left: 1 row of 16.
  batch = device_batch.prefill_batch([_owner(5, 30, 20)], spec)
  assert batch.tokens_pc.shape == (1, 16) and batch.counts == [10]
  np.testing.assert_array_equal(batch.positions_pc[0], list(range(20, 30)) + [-1] * 6)
  assert batch.rows_p.tolist() == [5]
  # Three owners, the longest with 40 left: 4 rows (one idle, a distinct slot) of 64.
  batch = device_batch.prefill_batch(
      [_owner(2, 12, 0), _owner(0, 40, 0), _owner(1, 5, 3)], spec)
  assert batch.tokens_pc.shape == (4, 64) and batch.counts == [12, 40, 2]
  assert batch.rows_p.tolist() == [2, 0, 1, 3] and (batch.positions_pc[3] == -1).all()
  # Two owners, one with 300 left: 2 rows of the largest chunk, 64 tokens each.
  batch = device_batch.prefill_batch([_owner(3, 300, 0), _owner(4, 17, 0)], spec)
  assert batch.tokens_pc.shape == (2, 64) and batch.counts == [64, 17]


def test_off_is_one_shape():
  spec = RolloutSpec(num_slots=8, prefill_chunk=64, prefill_rows=4, prompt_store_rows=4)
  batch = device_batch.prefill_batch([_owner(5, 30, 20)], spec)
  assert batch.tokens_pc.shape == (4, 64) and batch.counts == [10]
