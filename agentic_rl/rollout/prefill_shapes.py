"""The shapes a prefill call can take: (rows, chunk) pairs, each compiled before a run.

A call's cost follows its shape, padding included, and most of what the engine prefills
is short (observations of 10-150 tokens). With `prefill_chunk_min` > 0 a call takes the
smallest shape that holds its work: rows halve from `prefill_rows` down to 1 and chunks
halve from `prefill_chunk` while they keep at least `prefill_chunk_min` tokens. With 0,
the one shape `prefill_rows` x `prefill_chunk`. The choice depends only on what the call
holds, never on the time.
"""

from __future__ import annotations


def halvings(largest: int, smallest: int) -> tuple[int, ...]:
  """`largest`, then its halvings (rounded up) that stay >= `smallest`, ascending."""
  sizes = [largest]
  while -(-sizes[-1] // 2) >= smallest and sizes[-1] > 1:
    sizes.append(-(-sizes[-1] // 2))
  return tuple(sorted(set(sizes)))


def chunk_sizes(spec) -> tuple[int, ...]:
  """Tokens per row a prefill call can take (`spec`: a RolloutSpec)."""
  if spec.prefill_chunk_min <= 0:
    return (spec.prefill_chunk,)
  return halvings(spec.prefill_chunk, spec.prefill_chunk_min)


def row_counts(spec) -> tuple[int, ...]:
  """Rows a prefill call can take."""
  if spec.prefill_chunk_min <= 0:
    return (spec.prefill_rows,)
  return halvings(spec.prefill_rows, 1)


def smallest_holding(sizes: tuple[int, ...], need: int) -> int:
  """The smallest of `sizes` (ascending) that is >= `need`; the largest if none is."""
  for size in sizes:
    if size >= need:
      return size
  return sizes[-1]
