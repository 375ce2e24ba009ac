"""The single kernel dispatch point: backends by name and clear errors.

(The Pallas backend is held to the reference ops in tests/kernels/test_pallas.py.)
"""

import jax
import pytest

from agentic_rl.kernels import dispatch, reference


def test_reference_backend_is_the_reference_ops():
  ops = dispatch.get_ops("reference")
  assert ops.causal_attention is reference.causal_attention
  assert ops.sliding_window_attention is reference.sliding_window_attention
  assert ops.block_sparse_attention is reference.block_sparse_attention
  assert ops.select_blocks is reference.select_blocks


def test_unknown_backend_names_the_value_and_the_choices():
  with pytest.raises(ValueError, match=r"kernel_backend='cuda'.*'reference', 'pallas' or 'auto'"):
    dispatch.get_ops("cuda")


def test_auto_is_pallas_on_accelerators_and_the_reference_on_cpu():
  assert dispatch.resolve_backend("auto", "cpu") == "reference"
  for platform in ("gpu", "cuda", "rocm", "tpu"):
    assert dispatch.resolve_backend("auto", platform) == "pallas"
  assert dispatch.resolve_backend("pallas", "cpu") == "pallas"  # Named: as asked.
  if jax.default_backend() == "cpu":
    assert dispatch.get_ops("auto") is dispatch.REFERENCE_OPS
