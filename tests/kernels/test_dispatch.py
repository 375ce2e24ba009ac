"""The single kernel dispatch point: backends by name and clear errors.

(The Pallas backend is held to the reference ops in tests/kernels/test_pallas.py.)
"""

import pytest

from agentic_rl.kernels import dispatch, reference


def test_reference_backend_is_the_reference_ops():
  ops = dispatch.get_ops("reference")
  assert ops.causal_attention is reference.causal_attention
  assert ops.sliding_window_attention is reference.sliding_window_attention
  assert ops.block_sparse_attention is reference.block_sparse_attention
  assert ops.select_blocks is reference.select_blocks


def test_unknown_backend_names_the_value_and_the_choices():
  with pytest.raises(ValueError, match=r"kernel_backend='cuda'.*'reference' or 'pallas'"):
    dispatch.get_ops("cuda")
