"""What the SFT and RL phases share during one run, built once by the Trainer."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from agentic_rl.parallel import placement
from agentic_rl.rl.train_step import TrainState
from agentic_rl.train import distributed
from agentic_rl.train.checkpointing import Checkpointer
from agentic_rl.train.evaluator import Evaluator
from agentic_rl.train.metrics_logger import MetricsLogger
from agentic_rl.train.routes import Routes
from agentic_rl.train.run_state import RunState
from agentic_rl.train.state_io import StateIO
from agentic_rl.train.task_stream import TaskStream


@dataclasses.dataclass
class RunContext:
  config: ml_collections.ConfigDict  # The base config (before any route override).
  train_spec: Any
  info: distributed.ProcessInfo
  mesh: Any
  tokenizer: Any
  env_family: Any
  env_spec: Any
  env_factory: Callable
  train_source: Any  # The env's train split at its default tier (SFT demonstrations).
  tasks: TaskStream  # RL's task stream.
  routes: Routes
  evaluator: Evaluator
  state_io: StateIO
  checkpoints: Checkpointer
  logger: MetricsLogger
  stop: threading.Event  # Set by SIGTERM: save and return.
  learner_lengths: tuple[int, ...]  # RL batches pad to one of these (train/learner_lengths.py).

  def gather(self, x):
    return distributed.all_gather(self.info, x)

  def place_rows(self, local_batch):
    """This process's rows of a batch as global arrays, rows over the mesh's batch axes."""
    return placement.place_rows(self.mesh, local_batch, self.info.process_count)

  def learning(self):
    """The context a learner step runs in: the mesh set (expert parallelism needs it)."""
    return jax.set_mesh(self.mesh)

  def save(self, state: TrainState, run: RunState, *, force: bool = False):
    self.state_io.save(self.checkpoints, state, run, self.routes.current.config, force=force)

  def say(self, text: str):
    """Console progress, from the primary process only."""
    if self.info.is_primary:
      print(text, flush=True)
