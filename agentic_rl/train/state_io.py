"""A run's state in and out: checkpoints (save, resume) and start params from another
run's checkpoint or a params.safetensors folder, each checked against the layout
fingerprint of the config that will use them.

On disk a checkpoint's state is {"train": TrainState}; its extras are the RunState
plus the fingerprint of the route that wrote it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections

from agentic_rl import resources
from agentic_rl.model import config as model_config
from agentic_rl.model import layer_stack
from agentic_rl.parallel import placement
from agentic_rl.rl.train_step import TrainState
from agentic_rl.train import distributed
from agentic_rl.train import fingerprint as fingerprint_lib
from agentic_rl.train import params_file
from agentic_rl.train.checkpointing import Checkpointer, resolve_checkpoint
from agentic_rl.train.run_state import RunState, provenance


def restore(reader: Checkpointer, layouts: list[dict], step: int | None = None):
  """reader.restore into the first of `layouts` the checkpoint fits, each also tried under
  the attention params' old names (params_file.LEGACY_PARAM_NAMES: checkpoints written
  before they took one letter per axis), renamed back. When none fits, the first layout's
  error under today's names is raised: it says what differs, and its cause keeps orbax's
  own report."""
  old_name = {new: old for old, new in params_file.LEGACY_PARAM_NAMES.items()}
  first_error = None
  for layout in layouts:
    for to_file, back in ((None, None), (old_name, params_file.LEGACY_PARAM_NAMES)):
      try:
        restored = reader.restore(layout if to_file is None
                                  else params_file.rename_keys(layout, to_file), step=step)
      except RuntimeError as err:
        first_error = first_error or err
        continue
      if restored is None or back is None:
        return restored
      step, tree, extras = restored
      return step, params_file.rename_keys(tree, back), extras
  raise first_error


def with_reference(state: TrainState) -> TrainState:
  """The state with its KL reference (when it has one) set to its current params."""
  if state.ref_params is None:
    return state
  return state.replace(ref_params=jax.tree.map(jnp.copy, state.params))


class StateIO:

  def __init__(self, info: distributed.ProcessInfo, mesh, tokenizer_hash: str,
               allow_fingerprint_change: tuple[str, ...]):
    self.info = info
    self.mesh = mesh
    self.tokenizer_hash = tokenizer_hash  # The run's one tokenizer, hashed once.
    self.allow_fingerprint_change = allow_fingerprint_change

  def place(self, tree):
    """`tree` (a TrainState, params or moments) on the run's mesh by the sharding rules;
    leaves already there are kept as they are."""
    return placement.place(tree, placement.state_shardings(tree, self.mesh))

  def fingerprint(self, config: ml_collections.ConfigDict) -> dict:
    return {**fingerprint_lib.model_layout(config.model), "tokenizer": self.tokenizer_hash}

  def check_fingerprint(self, saved, config, source: str) -> list[str]:
    """The allowed fingerprint fields that differ; an error for any other difference."""
    changed = fingerprint_lib.check(saved, self.fingerprint(config),
                                    self.allow_fingerprint_change, source)
    if saved is None:
      print(f"{source} records no layout fingerprint: not checked.", flush=True)
    elif changed:
      print(f"{source}: layout fields {changed} differ, as "
            "config.train.allow_fingerprint_change allows.", flush=True)
    return changed

  # -- the run's own checkpoints ---------------------------------------------------------

  def save(self, ckpt: Checkpointer, state: TrainState, run: RunState,
           config: ml_collections.ConfigDict, *, force: bool = False):
    """Saves at the run's global step; `config` is the route that trained the params."""
    # Orbax writes multi-host state as global arrays.
    ckpt.save(run.global_step, {"train": self.place(state)}, None,
              run.to_extras(self.fingerprint(config)), force=force)

  def resume(self, ckpt: Checkpointer, layout_for_step, config_for_step
             ) -> tuple[TrainState, RunState] | None:
    """The latest checkpoint in `ckpt`, or None. `layout_for_step(rl_step)` is a state in
    the layout of the route that trains RL step `rl_step` (after a switch to route A, with
    a critic), and `config_for_step(rl_step)` that route's config."""
    extras = ckpt.read_extras()
    if extras is None:
      return None
    source = f"the checkpoint in {ckpt.directory}"
    run, saved_fingerprint = RunState.from_extras(extras, source)
    # The state saved after step N - 1 (rl_step = N) is in the layout of the route that
    # trained step N - 1; at a stage switch, the next step adopts the new route's layout.
    trained_by = max(run.rl_step - 1, 0)
    self.check_fingerprint(saved_fingerprint, config_for_step(trained_by), source)
    layout = {"train": self.place(layout_for_step(trained_by))}
    layouts = [layout]
    # Route A checkpoints written before route A had a critic: the next step grafts one.
    without_critic = params_file.rename_keys(layout, {"value_head": None})
    if jax.tree.structure(without_critic) != jax.tree.structure(layout):
      layouts.append(without_critic)
    _, tree, _ = restore(ckpt, layouts, step=ckpt.latest_step())
    print(f"resumed from {ckpt.directory} at {run.phase} step {run.phase_step}", flush=True)
    return tree["train"], run

  # -- start params from elsewhere ------------------------------------------------------

  def load_params(self, path: str, like: TrainState, config: ml_collections.ConfigDict,
                  source: str) -> tuple[TrainState, dict]:
    """`like` with the params saved at `path` (everything else as given; the KL reference,
    if any, set to them) and where they came from. `path` is a run's workdir, checkpoints/
    or step folder, or a params.safetensors folder (a shipped base). `source` names the
    config field or flag `path` came from in errors."""
    path = resources.resolve(path)
    if params_file.params_path(path):
      params, where = self._params_from_file(path, like, config, source)
    else:
      params, where = self._params_from_checkpoint(path, like, config, source)
    return with_reference(like.replace(params=params)), where

  def _params_from_checkpoint(self, path, like, config, source):
    directory, step = resolve_checkpoint(path)
    reader = Checkpointer(directory, read_only=True)
    try:
      # The layout first: a refused one fails naming its fields, not in orbax's restore.
      extras = reader.read_extras(step) or {}
      changed = self.check_fingerprint(extras.get("fingerprint"), config,
                                       f"{source}={path!r}")
      spec = model_config.validate(config.model)
      # Allowed to differ in scan_layers: restore the saved param tree, then convert.
      saved_scan = "scan_layers" in changed
      if saved_scan:
        like = layer_stack.stack_layers_in(layer_stack.unstack_layers_in(like, spec),
                                           spec.replace(scan_layers=not spec.scan_layers))
      like = self.place(like)
      # The source may or may not carry a KL reference (its run's kl_coef): try both.
      layouts = [{"train": like}]
      if like.ref_params is not None:
        layouts.append({"train": like.replace(ref_params=None)})
      _, restored, extras = restore(reader, layouts, step=step)
    except RuntimeError as err:
      raise RuntimeError(f"{source}={path!r}: {err}") from err
    finally:
      reader.close()
    print(f"params from {directory} step {step} (phase {extras.get('phase')}, "
          f"sft step {extras.get('sft_step')}, rl step {extras.get('rl_step')})", flush=True)
    where = {"directory": directory, "step": int(step), "layout_changed": changed,
             **provenance(extras)}
    params = restored["train"].params
    if saved_scan:
      params = self.place(layer_stack.stack_layers(layer_stack.unstacked(params), spec))
    return params, where  # With `like`'s shardings.

  def _params_from_file(self, path, like, config, source):
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    # The config.json beside the file gives the layout the params were trained under.
    changed = self.check_fingerprint(
        fingerprint_lib.of_config_json(os.path.join(folder, "config.json")), config,
        f"{source}={path!r}")
    # What a base may lack (a critic, pass-through S gates) starts at init.
    params = params_file.load_params(
        path, placement.to_host(like.params), source,
        fresh_prefixes=model_config.validate(config.model).params_started_fresh())
    params = self.place(params)  # Host values, cut into their shards.
    meta = params_file.read_metadata(path)
    file = params_file.params_path(path)
    print(f"params from {file} ({meta.get('description', 'no description')})", flush=True)
    return params, {"file": file, "layout_changed": changed, **provenance(meta)}
