"""launch/check_consistency: routing and block-selection agreement compares top-k choices as
sets (their slot order means nothing), on hand examples."""

import numpy as np
import pytest

from launch.check_consistency import selection_agreement


def test_the_same_experts_in_another_order_agree():
  full = ({"experts": np.array([[[0, 3], [1, 2]]], np.int32)},)  # [B=1, T=2, k=2]
  cached = ({"experts": np.array([[[3, 0], [2, 1]]], np.int32)},)
  assert selection_agreement(full, cached, "experts") == 1.0


def test_partial_overlap_counts_shared_ids_over_the_larger_set():
  # Token 0: {0, 3} vs {3, 1}, one shared; token 1: {1, 2} vs {2, 1}, both: 3 of 4.
  full = ({}, {"experts": np.array([[[0, 3], [1, 2]]], np.int32)})  # a dense layer first
  cached = ({}, {"experts": np.array([[[1, 3], [2, 1]]], np.int32)})
  assert selection_agreement(full, cached, "experts") == pytest.approx(3 / 4)


def test_blocks_ignore_unused_slots_and_empty_rows():
  # [B=1, K=1, T=4, n=3]: the same blocks reordered; -1 slots in other places; a query that
  # lost one of its two blocks; a padding query that selected nothing on either path.
  full = np.array([[[[2, 0, -1], [1, -1, 0], [3, 1, 0], [-1, -1, -1]]]])
  cached = np.array([[[[0, 2, -1], [-1, 0, 1], [0, 1, -1], [-1, -1, -1]]]])
  # Rows: 2 of 2, 2 of 2, 2 of max(3, 2), nothing: 6 / 7.
  got = selection_agreement(({"blocks": full},), ({"blocks": cached},), "blocks")
  assert got == pytest.approx(6 / 7)


def test_no_layer_with_the_key_gives_none():
  layers = ({}, {"experts": np.zeros((1, 2, 2), np.int32)})
  assert selection_agreement(layers, layers, "blocks") is None
  assert selection_agreement(layers, layers, "experts") == 1.0
