"""The attention-op bundle every kernel backend fills: the signatures of `agentic_rl.kernels.reference`."""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class AttentionOps:
  causal_attention: Callable
  sliding_window_attention: Callable
  # Uncached self-attention (q, k, v, pos_bt, *, window): the training path of S layers.
  local_window_attention: Callable
  block_sparse_attention: Callable
  select_blocks: Callable
