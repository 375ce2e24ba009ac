"""Checkpoints through one orbax CheckpointManager: saved asynchronously, last N kept.

A checkpoint holds three items:
  "state":  the train-state pytree (params, optimiser state, step, RNG key data, ...);
  "data":   the grain iterator's state, so the task stream resumes where it stopped;
  "extras": JSON (task statistics, the stage, anything small and host-side).
Orbax writes each step into a temporary directory and renames it when complete,
so a run killed mid-save leaves only whole checkpoints behind.
"""

from __future__ import annotations

import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    """`read_only` opens another run's checkpoints: nothing there is created or cleaned."""
    self.directory = os.path.abspath(directory)
    if read_only and not os.path.isdir(self.directory):
      raise FileNotFoundError(f"checkpoint directory {self.directory} does not exist")
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            # Read-only managers keep and save nothing (orbax warns about any other value).
            max_to_keep=None if read_only else max_to_keep,
            save_interval_steps=0 if read_only else 1,
            create=not read_only, read_only=read_only,
            enable_async_checkpointing=async_save and not read_only,
            cleanup_tmp_directories=not read_only))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_iterator=None, extras: dict | None = None,
           *, force: bool = False) -> bool:
    if step in self._manager.all_steps():
      # A newer state for the same step (e.g. the SFT->RL hand-over, or SIGTERM right
      # after a periodic save) replaces the old one; a kill in between leaves the
      # previous checkpoint as the latest.
      self._manager.wait_until_finished()
      self._manager.delete(step)
    items = {"state": ocp.args.StandardSave(state),
             "extras": ocp.args.JsonSave(extras or {})}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

  def restore(self, abstract_state: Any, data_iterator=None, step: int | None = None):
    """Restores `step` (default: the latest) into the given structure.

    Returns (step, state, extras), or None when the directory holds no checkpoint.
    The data iterator, when given, is restored in place.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    items = {"state": ocp.args.StandardRestore(abstract), "extras": ocp.args.JsonRestore()}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as err:  # Name the checkpoint: a bare orbax trace does not.
      raise RuntimeError(
          f"could not restore checkpoint step {step} from {self.directory}: {err}. "
          "If the config changed since it was written, start a new workdir.") from err
    return step, restored["state"], dict(restored["extras"] or {})

  def read_extras(self, step: int | None = None) -> dict | None:
    """The JSON extras of `step` (default: the latest) without its state, or None when the
    directory holds no checkpoint: what layout to restore the state into."""
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    restored = self._manager.restore(step, args=ocp.args.Composite(
        extras=ocp.args.JsonRestore()))
    return dict(restored["extras"] or {})

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def wait(self):
    self._manager.wait_until_finished()

  def close(self):
    self._manager.wait_until_finished()
    self._manager.close()


def resolve_checkpoint(path: str) -> tuple[str, int]:
  """(checkpoints directory, step) for a run's workdir, its checkpoints/ folder, or one
  step folder inside it; the latest step unless a step folder is named."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"checkpoint path {path} does not exist")
  if os.path.isdir(os.path.join(path, "checkpoints")):
    path = os.path.join(path, "checkpoints")
  base = os.path.basename(path.rstrip(os.sep))
  if base.isdigit() and os.path.isdir(os.path.join(path, "state")):
    return os.path.dirname(path), int(base)
  ckpt = Checkpointer(path, read_only=True)
  steps = ckpt.all_steps()
  ckpt.close()
  if not steps:
    raise FileNotFoundError(f"{path} holds no checkpoint: expected a run's workdir, its "
                            "checkpoints/ folder or one step folder inside it")
  return path, max(steps)
