"""The host inputs of one prefill call and of one decode step, built from the engine's records.

Prefill: up to `prefill_rows` owners of the prefill queue, all prompt-store groups or all
slots (whichever kind heads the queue), up to `prefill_chunk` context tokens each, in the
smallest compiled (rows, chunk) shape that holds them (prefill_shapes.py).
Decode: one position per slot, -1 for a slot that sits the call out, then up to
decode_steps_per_call steps on the device. Either way a row whose next tokens are
teacher-forced takes them from its `forced` queue; the device draws for the rest (see
device_steps.py).

Token bookkeeping: the last token a slot drew is not yet in its cache; it is
fed by the next decode step or as the first token of the next prefill. A
finishing trajectory feeds it in one last decode step ("flush"), so every
token of the record has its routing and block selection recorded.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from agentic_rl.rollout import config as config_lib
from agentic_rl.rollout import prefill_shapes
from agentic_rl.rollout.episodes import Active, Group, SlotState


@dataclasses.dataclass
class PrefillBatch:
  to_store: bool  # Prompts of groups into the store (else context into slots).
  owners: list  # The Groups or Actives prefilled, in queue order.
  counts: list[int]  # Tokens fed per owner.
  rows_p: np.ndarray  # Cache rows: the owners', then distinct idle rows.
  tokens_pc: np.ndarray
  positions_pc: np.ndarray  # -1 past each row's tokens.
  seeds_p: np.ndarray
  forced_p: np.ndarray  # -1: draw.


def prefill_batch(queue: Sequence[Active | Group], spec: config_lib.RolloutSpec
                  ) -> PrefillBatch:
  """The next prefill call for the owners at the head of `queue` (not removed from it)."""
  to_store = isinstance(queue[0], Group)
  rows_total = spec.prompt_store_rows if to_store else spec.num_slots
  owners = [o for o in queue if isinstance(o, Group) == to_store]
  owners = owners[:spec.prefill_rows]
  waiting = [min(o.builder.length - o.cache_len, spec.prefill_chunk) for o in owners]
  p = prefill_shapes.smallest_holding(prefill_shapes.row_counts(spec), len(owners))
  c = prefill_shapes.smallest_holding(prefill_shapes.chunk_sizes(spec), max(waiting))
  rows = [o.store_row if to_store else o.slot for o in owners]
  # Rows that sit the call out must be distinct from the working ones.
  rows += [r for r in range(rows_total) if r not in rows][:p - len(rows)]
  tokens = np.zeros((p, c), np.int32)
  positions = np.full((p, c), -1, np.int32)
  seeds = np.zeros(p, np.uint32)
  forced = np.full(p, -1, np.int32)
  counts = []
  for i, o in enumerate(owners):
    chunk = o.builder.tokens[o.cache_len:o.cache_len + c]
    tokens[i, :len(chunk)] = chunk
    positions[i, :len(chunk)] = np.arange(o.cache_len, o.cache_len + len(chunk))
    counts.append(len(chunk))
    if not to_store:
      seeds[i] = o.member.seed
      if o.cache_len + len(chunk) == o.builder.length and o.forced:
        forced[i] = o.forced.popleft()
  return PrefillBatch(to_store, owners, counts, np.asarray(rows, np.int32), tokens, positions,
                      seeds, forced)


def decode_inputs(rows: Sequence[Active], spec: config_lib.RolloutSpec
                  ) -> tuple[np.ndarray, ...]:
  """(tokens_s, positions_s, seeds_s, forced_sn, budget_s) of one decode call that feeds
  `rows`: each row's next teacher ids (peeked, not taken: the caller takes what the call
  consumed) and the draws it may make before the host must act: what is left of its turn
  and of its trajectory's token limit; 0 for a flush (one token fed, nothing drawn)."""
  s, n = spec.num_slots, spec.decode_steps_per_call
  tokens = np.zeros(s, np.int32)
  positions = np.full(s, -1, np.int32)
  seeds = np.zeros(s, np.uint32)
  forced = np.full((s, n), -1, np.int32)
  budget = np.zeros(s, np.int32)
  for a in rows:
    tokens[a.slot] = a.builder.tokens[a.cache_len]
    positions[a.slot] = a.cache_len
    seeds[a.slot] = a.member.seed
    if a.state is SlotState.DECODE:
      ids = list(itertools.islice(a.forced, n))
      forced[a.slot, :len(ids)] = ids
      budget[a.slot] = min(spec.max_new_tokens_per_turn - a.builder.turn_generated,
                           spec.token_limit - a.builder.length)
  return tokens, positions, seeds, forced, budget


def advance_lengths(lengths_r, rows_b, positions_bt) -> None:
  """The host record of `cache_lib.new_lengths` after a call fed `positions_bt` to rows."""
  lengths_r[rows_b] = np.maximum(lengths_r[rows_b], positions_bt.max(axis=1) + 1)
