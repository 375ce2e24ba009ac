"""The one place the model picks its attention kernels, by `config.model.kernel_backend`:
'reference' (jnp), 'pallas', or 'auto' (Pallas on GPU/TPU, the reference on CPU).

Every backend implements the signatures of `agentic_rl.kernels.reference`. Selection
(`select_blocks`) always stays in XLA: no Pallas backend lowers top-k.
"""

from __future__ import annotations

import functools

import jax

from agentic_rl.kernels import reference
from agentic_rl.kernels.ops import AttentionOps


REFERENCE_OPS = AttentionOps(
    causal_attention=reference.causal_attention,
    sliding_window_attention=reference.sliding_window_attention,
    local_window_attention=reference.local_window_attention,
    block_sparse_attention=reference.block_sparse_attention,
    select_blocks=reference.select_blocks,
)


ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


def resolve_backend(backend: str, platform: str | None = None) -> str:
  """'reference' or 'pallas': 'auto' is Pallas where the kernels compile (GPU, TPU; jax's
  default backend unless `platform` says) and the reference elsewhere (CPU)."""
  if backend == "auto":
    platform = platform or jax.default_backend()
    return "pallas" if platform in ACCELERATORS else "reference"
  if backend not in ("reference", "pallas"):
    raise ValueError(f"kernel_backend={backend!r}: expected 'reference', 'pallas' or 'auto'.")
  return backend


@functools.cache
def get_ops(backend: str, interpret: bool = False) -> AttentionOps:
  backend = resolve_backend(backend)
  if backend == "reference":
    return REFERENCE_OPS
  from agentic_rl.kernels import pallas_ops  # Imported lazily: reference runs need no Pallas.
  return pallas_ops.make_ops(interpret=interpret)
