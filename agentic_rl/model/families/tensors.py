"""How one Hugging Face tensor (or a stack of them) becomes one of our params, and back.

A `TensorRule` names our param (slash path, e.g. 'layer_0/attn/w_q_dnh'), the Hugging Face
tensor(s) it comes from and the transform between them. Transforms are exact (transposes,
reshapes, stacks): import then export returns the same bytes.

  copy     same shape (norm scales, embeddings).
  linear   HF [out, in] (torch Linear) <-> ours: W.T reshaped to our shape, whose first
           `in_axes` axes are the input (w_q_dnh [d, n, h]: 1; w_o_nhd [n, h, d]: 2).
  bias     HF [out] <-> ours [*out] (b_q_nh: [n, h]): a reshape.
  experts  E tensors HF [out, in] <-> ours [E, in, out]: each transposed, stacked on axis 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np

TRANSFORMS = ("copy", "linear", "bias", "experts")


@dataclasses.dataclass(frozen=True)
class TensorRule:
  ours: str  # Our param path, '/'-joined.
  hf: tuple[str, ...]  # The Hugging Face tensor name(s); several only for 'experts'.
  transform: str
  shape: tuple[int, ...]  # Our param's shape.
  in_axes: int = 1  # linear: how many leading axes of ours are the input.

  def __post_init__(self):
    if self.transform not in TRANSFORMS:
      raise ValueError(f"{self.ours}: unknown transform {self.transform!r}")

  @property
  def hf_shape(self) -> tuple[int, ...]:
    """The shape each Hugging Face tensor of this rule has."""
    if self.transform == "copy":
      return self.shape
    if self.transform == "bias":
      return (int(np.prod(self.shape)),)
    if self.transform == "experts":
      return (self.shape[2], self.shape[1])
    return (int(np.prod(self.shape[self.in_axes:])), int(np.prod(self.shape[:self.in_axes])))

  def to_ours(self, hf_arrays: list[np.ndarray]) -> np.ndarray:
    if self.transform == "experts":
      return np.stack([a.T for a in hf_arrays])
    (a,) = hf_arrays
    if self.transform == "linear":
      return np.ascontiguousarray(a.T).reshape(self.shape)
    return a.reshape(self.shape)

  def to_hf(self, ours: np.ndarray) -> list[np.ndarray]:
    if self.transform == "experts":
      return [np.ascontiguousarray(ours[e].T) for e in range(ours.shape[0])]
    if self.transform == "linear":
      h_out, h_in = self.hf_shape
      return [np.ascontiguousarray(ours.reshape(h_in, h_out).T)]
    return [np.ascontiguousarray(ours.reshape(self.hf_shape))]
