"""The one place the model picks its attention kernels, by `config.model.kernel_backend`.

Every backend implements the signatures of `agentic_rl.kernels.reference`. Selection
(`select_blocks`) always stays in XLA: no Pallas backend lowers top-k.
"""

from __future__ import annotations

import functools

from agentic_rl.kernels import reference
from agentic_rl.kernels.ops import AttentionOps


REFERENCE_OPS = AttentionOps(
    causal_attention=reference.causal_attention,
    sliding_window_attention=reference.sliding_window_attention,
    local_window_attention=reference.local_window_attention,
    block_sparse_attention=reference.block_sparse_attention,
    select_blocks=reference.select_blocks,
)


@functools.cache
def get_ops(backend: str, interpret: bool = False) -> AttentionOps:
  if backend == "reference":
    return REFERENCE_OPS
  if backend == "pallas":
    from agentic_rl.kernels import pallas_ops  # Imported lazily: reference runs need no Pallas.
    return pallas_ops.make_ops(interpret=interpret)
  raise ValueError(f"kernel_backend={backend!r}: expected 'reference' or 'pallas'.")
