"""Multi-process setup: one JAX process per host, data split across processes (the mesh
and what sits on it: agentic_rl/parallel/).

On a TPU pod every host runs the same command and `jax.distributed.initialize()`
discovers the others. On CPU (tests, laptops) processes are started by hand
with an explicit coordinator and gloo collectives.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from jax.experimental import multihost_utils


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
  process_index: int
  process_count: int

  @property
  def is_primary(self) -> bool:
    return self.process_index == 0


def initialize(coordinator_address: str = "", num_processes: int = 1,
               process_id: int = 0) -> ProcessInfo:
  """Joins the multi-process job when there is one; a no-op for a single process.

  With `coordinator_address` empty and `num_processes > 1` (or on a TPU pod, where
  the environment says so) JAX finds its peers itself.
  """
  on_pod = bool(os.environ.get("TPU_WORKER_HOSTNAMES")
                or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"))
  if num_processes > 1 or on_pod:
    if not on_pod:  # CPU processes need gloo for cross-process collectives.
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator_address:
      jax.distributed.initialize(coordinator_address, num_processes, process_id)
    else:
      jax.distributed.initialize()
  return ProcessInfo(jax.process_index(), jax.process_count())


def shard_indices(num_items: int, info: ProcessInfo) -> range:
  """The slice of a global item list that this process owns (round-robin)."""
  return range(info.process_index, num_items, info.process_count)


def all_gather(info: ProcessInfo, x: np.ndarray) -> np.ndarray:
  """Every process's `x`, flattened and concatenated in process order."""
  if info.process_count == 1:
    return x
  return np.asarray(multihost_utils.process_allgather(x)).reshape(-1)
