"""The main job: SFT warm start on the scripted expert, then agentic RL.

    tasks (grain, train split) -> rollout engine (sandboxed SWE envs) -> learner
    -> held-out evaluation -> logs -> orbax checkpoint

One `Trainer(config, workdir).run()` call. Restarting with the same workdir
resumes from the latest checkpoint; SIGTERM saves one and returns. Every
random choice derives from (config.seed, step), so a resumed run repeats an
uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from agentic_rl import resources
from agentic_rl.envs import env as env_lib
from agentic_rl.envs import registry
from agentic_rl.model import config as model_config_lib
from agentic_rl.model import transformer
from agentic_rl.rl import config as rl_config_lib
from agentic_rl.rl import dynamic_sampling
from agentic_rl.rl import task_selection
from agentic_rl.rl import train_step as train_step_lib
from agentic_rl.rollout import config as rollout_config_lib
from agentic_rl.rollout import engine as engine_lib
from agentic_rl.rollout import tokenizer as tokenizer_lib
from agentic_rl.records.trajectory import to_batch
from agentic_rl.train import config as train_config_lib
from agentic_rl.train import distributed
from agentic_rl.train import fingerprint as fingerprint_lib
from agentic_rl.train.curves import history_row, write_curves
from agentic_rl.train.evaluation import (episode_rates, heldout_scores, heldout_solved_matrix,
                                         paired_gain, pass1_stderr, pass_at_k_curve,
                                         SOLVED_REWARD)
from agentic_rl.train import params_file
from agentic_rl.train import sft as sft_lib
from agentic_rl.train.checkpointing import Checkpointer, resolve_checkpoint
from agentic_rl.train.metrics_logger import MetricsLogger
from agentic_rl.train.task_stream import TaskStream

# What a run's params carry of their history (a checkpoint's extras, a params file's metadata).
_PROVENANCE_KEYS = ("phase", "sft_step", "rl_step", "sft_best_step", "sft_plateau")
# What a held-out score depends on besides the params; scores agree only when these do.
_EVAL_SETTING_KEYS = ("heldout/num_tasks", "heldout/samples_per_task", "heldout/temperature")
# Logged per RL step as rollout/end_<reason> (episodes that ended so), errors included.
END_REASONS = tuple(dict.fromkeys(rollout_config_lib.END_REASONS + env_lib.END_REASONS))


@dataclasses.dataclass
class _Route:
  """What depends on the active route's config: rebuilt when the stage switches."""
  name: str
  config: ml_collections.ConfigDict
  model: transformer.Model
  rl_spec: Any
  rollout_spec: Any
  eval_spec: Any
  train_step: Any
  engine: engine_lib.RolloutEngine
  eval_engine: engine_lib.RolloutEngine


class Trainer:

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    self.base_config = config
    self.workdir = os.path.abspath(workdir)
    self.train_spec = tc = train_config_lib.validate_train_config(config.train)
    self.info = distributed.initialize(tc.coordinator_address, tc.num_processes, tc.process_id)
    self.mesh = distributed.data_mesh()
    self.tokenizer = tokenizer_lib.make_tokenizer(config.tokenizer)
    self._tokenizer_hash = fingerprint_lib.tokenizer_hash(config.tokenizer)
    # The env by name (config.env.name): its spec, envs, tasks, families and expert.
    self.env_spec = spec = registry.build_spec(config.env, max_turns=config.rollout.max_turns)
    self.env_family = family = registry.family_of(spec)
    self.train_source = family.task_source(spec, "train", spec.default_tier)
    # RL draws from these: the default tier and every tier of the curriculum.
    self.tiers = tuple(spec.tiers)
    wanted = (spec.default_tier,) + tuple(
        t for t in config.rl.task_selection.get("curriculum", ()) if t != spec.default_tier)
    unknown = [t for t in wanted if t not in self.tiers]
    if unknown:
      raise ValueError(f"config.rl.task_selection.curriculum names tiers {unknown}; the env "
                       f"has {list(self.tiers)}.")
    self.tasks = TaskStream(family, spec, wanted, config.seed)
    self.heldout_source = family.task_source(spec, "heldout", spec.default_tier)
    os.makedirs(self.workdir, exist_ok=True)
    self.audit = family.make_audit_log(  # config.env.audit_* reach the run's log.
        spec, os.path.join(self.workdir, f"audit.{self.info.process_index}.jsonl"))
    self.logger: MetricsLogger | None = None
    self._stop = threading.Event()
    self._route: _Route | None = None

  # -- setup ----------------------------------------------------------------------------

  def _env_factory(self):
    return self.env_family.make_env(self.env_spec, self.audit)

  def _build_route(self, name: str, config: ml_collections.ConfigDict) -> _Route:
    if self._route is not None:
      self._route.engine.close()
      self._route.eval_engine.close()
    spec = model_config_lib.validate(config.model)
    model = transformer.Model(spec)
    rl_spec = rl_config_lib.validate(config.rl, config.model, config.rollout)
    rollout_spec = rollout_config_lib.validate(config.rollout, spec, seed=config.seed)
    tc = self.train_spec
    greedy = {"top_k": 0, "top_p": 1.0} if tc.eval_temperature == 0 else {}
    eval_spec = dataclasses.replace(rollout_spec, temperature=tc.eval_temperature,
                                    group_size=tc.eval_samples, **greedy)
    # Weights arrive through set_params before every use.
    engine = engine_lib.RolloutEngine(model, None, rollout_spec, self.tokenizer,
                                      self._env_factory)
    eval_engine = engine_lib.RolloutEngine(model, None, eval_spec, self.tokenizer,
                                           self._env_factory)
    step = train_step_lib.make_train_step(model, rl_spec)
    return _Route(name, config, model, rl_spec, rollout_spec, eval_spec, step, engine,
                  eval_engine)

  def _route_for_step(self, rl_step: int) -> tuple[str, ml_collections.ConfigDict]:
    switch = self.train_spec.switch_to_route_a_at
    if switch >= 0 and rl_step >= switch:
      return "A", train_config_lib.apply_overrides(self.base_config,
                                                   self.base_config.route_a)
    return "base", self.base_config

  def _ensure_route(self, rl_step: int):
    name, config = self._route_for_step(rl_step)
    if self._route is None or self._route.name != name:
      self._route = self._build_route(name, config)
    return self._route

  def _local(self, tree):
    """This process's copy of a replicated tree (what the rollout engine uses)."""
    if self.info.process_count == 1:
      return tree
    return jax.tree.map(lambda x: x.addressable_data(0), tree)

  # -- evaluation ----------------------------------------------------------------------

  def evaluate(self, params, num_tasks: int) -> dict:
    t0 = time.time()
    solved_bk, rewards = self._heldout_solved(params, num_tasks)
    return {**heldout_scores(solved_bk),  # solve_rate, pass_at_k, samples_per_task
            "heldout/solve_stderr": pass1_stderr(solved_bk),
            # Per task, for the paired gain against the start point.
            "heldout/solves_per_task": solved_bk.sum(axis=1).round().astype(int).tolist(),
            "heldout/seconds": time.time() - t0,
            "heldout/mean_reward": float(np.mean(rewards)),
            "heldout/num_tasks": int(num_tasks),
            "heldout/episodes": int(rewards.size),
            "heldout/temperature": float(self.train_spec.eval_temperature)}

  def _heldout_solved(self, params, num_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """([num_tasks, eval_samples] solved matrix, every episode's reward), all processes."""
    route = self._route
    indices = [i for i in distributed.shard_indices(num_tasks, self.info)]
    tasks = [self.heldout_source[i] for i in indices]
    route.eval_engine.set_params(self._local(params), 0)
    trajs = route.eval_engine.run(tasks, task_seeds=indices)
    rewards = np.asarray([t.reward for t in trajs], np.float32)
    solved_bk = heldout_solved_matrix([t.group_id for t in trajs], rewards, len(tasks),
                                      route.eval_spec.group_size)
    solved_bk = self._gather(solved_bk.reshape(-1)).reshape(-1, solved_bk.shape[1])
    return solved_bk, self._gather(rewards)

  def evaluate_checkpoint(self, path: str, source: str = "checkpoint") -> dict:
    """Held-out scores of the params saved at `path` (a workdir, its checkpoints/ folder,
    one step folder, or a params.safetensors folder) under this config's eval settings,
    with the pass@k curve. `source` names where `path` came from in errors (e.g. a flag)."""
    route = self._ensure_route(0)
    holder = self._init_state(route)
    if self.info.process_count > 1:
      holder = distributed.replicate(self.mesh, jax.device_get(holder))
    holder, provenance = self._load_params(path, holder, source)
    return {"checkpoint": provenance, **self.score_params(holder["train"].params)}

  def score_params(self, params) -> dict:
    """Held-out scores of `params` under this config's eval settings, with the pass@k
    curve and each task's solves (what launch/evaluate and launch/export_base report)."""
    self._ensure_route(0)
    num_tasks = int(self.train_spec.eval_tasks)
    t0 = time.time()
    solved_bk, rewards = self._heldout_solved(params, num_tasks)
    curve = pass_at_k_curve(solved_bk)
    samples = solved_bk.shape[1]
    return {**self._eval_settings(),
            "pass_at_k": {str(k): v for k, v in curve.items()},
            "sharpening_headroom": curve[samples] - curve[1],
            "solve_stderr": pass1_stderr(solved_bk),
            "episodes": int(solved_bk.size),
            "mean_reward": float(np.mean(rewards)),
            "solves_per_task": solved_bk.sum(axis=1).round().astype(int).tolist(),
            "seconds": time.time() - t0}

  def _eval_settings(self) -> dict:
    tc = self.train_spec
    return dict(zip(_EVAL_SETTING_KEYS, (int(tc.eval_tasks), int(tc.eval_samples),
                                         float(tc.eval_temperature))))

  def _same_eval_settings(self, scores: dict) -> bool:
    return all(scores.get(k) == v for k, v in self._eval_settings().items())

  def _gather(self, x: np.ndarray) -> np.ndarray:
    if self.info.process_count == 1:
      return x
    return np.asarray(multihost_utils.process_allgather(x)).reshape(-1)

  # -- the run -------------------------------------------------------------------------

  def _init_state(self, route: _Route):
    params = route.model.init(jax.random.key(self.base_config.seed))
    # The KL reference is the policy RL starts from: set when SFT hands over or the start
    # params are loaded (_with_reference); a checkpoint carries it from then on.
    ref = params if route.rl_spec.loss.kl_coef > 0 else None
    state = train_step_lib.init_train_state(route.model, params, route.rl_spec, ref_params=ref)
    return {"train": state}

  def _sft_optimizer(self, route: _Route):
    return train_step_lib.make_optimizer(
        sft_lib.sft_learner_spec(route.rl_spec, self.train_spec))

  def run(self) -> dict:
    start_wall = time.time()
    cfg, tc = self.base_config, self.train_spec
    num_rl_steps = int(cfg.rl.num_steps)
    route = self._ensure_route(0)
    holder = self._init_state(route)
    ckpt = Checkpointer(os.path.join(self.workdir, "checkpoints"),
                        max_to_keep=tc.keep_checkpoints)
    extras = {"phase": "sft" if tc.sft_steps else "rl", "sft_step": 0, "rl_step": 0}
    if self.info.process_count > 1:  # Restore onto the global mesh, replicated.
      holder = distributed.replicate(self.mesh, jax.device_get(holder))
    restored = ckpt.restore(holder)
    if restored is not None:
      _, holder, extras = restored
      self._check_fingerprint(extras.pop("fingerprint", None),
                              self._route_for_step(extras["rl_step"])[1],
                              f"the checkpoint in {ckpt.directory}")
      print(f"resumed from {ckpt.directory} at {extras['phase']} step "
            f"{extras['sft_step'] if extras['phase'] == 'sft' else extras['rl_step']}",
            flush=True)
    elif tc.init_checkpoint:
      holder, extras["init_checkpoint"] = self._load_params(
          tc.init_checkpoint, holder, "config.train.init_checkpoint")
    global_step = extras["sft_step"] + extras["rl_step"]
    self.logger = MetricsLogger(self.workdir, resume_step=global_step,
                                enabled=self.info.is_primary)
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
    try:
      holder, extras = self._run_sft(route, holder, extras, ckpt)
      if not self._stop.is_set():
        holder, extras = self._run_rl(holder, extras, ckpt, num_rl_steps)
    finally:
      signal.signal(signal.SIGTERM, previous_handler)
    if self._stop.is_set():
      ckpt.close()
      print("SIGTERM: checkpoint saved, exiting.", flush=True)
      self.close()
      return {"interrupted": True, **{k: extras[k] for k in ("phase", "sft_step", "rl_step")}}
    ckpt.close()
    summary = self._summary(extras, start_wall, holder["train"].params)
    # Every process prints it: replicas of one data-parallel run must agree.
    print(f"process {self.info.process_index} final params sha256 {summary['params_sha256']}",
          flush=True)
    if self.info.is_primary:
      with open(os.path.join(self.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
      if extras.get("history"):
        summary["curves"] = write_curves(extras["history"],
                                         os.path.join(self.workdir, "curves.png"),
                                         title=f"seed {self.base_config.seed}")
      print(format_summary(summary), flush=True)
    self.close()
    return summary

  def load_params(self, path: str, source: str) -> tuple[Any, dict]:
    """(params, provenance) saved at `path`: a run's workdir, checkpoints/ or step folder,
    or a params.safetensors folder; checked against this config's model and layout."""
    holder, provenance = self._load_params(path, self._init_state(self._ensure_route(0)),
                                           source)
    return holder["train"].params, provenance

  def _load_params(self, path: str, holder: dict, source: str) -> tuple[dict, dict]:
    """`holder` with the params saved at `path` (everything else as given) and where they
    came from: a params.safetensors folder (a shipped base) or a run's checkpoint. `source`
    (the config field or flag `path` came from) prefixes load errors."""
    path = resources.resolve(path)
    if params_file.params_path(path):
      return self._params_from_file(path, holder, source)
    return self._params_from_checkpoint(path, holder, source)

  def _params_from_checkpoint(self, path: str, holder: dict, source: str
                              ) -> tuple[dict, dict]:
    """`holder` with the params of the checkpoint at `path` (a workdir, its checkpoints/
    folder or one step folder)."""
    directory, step = resolve_checkpoint(path)
    reader = Checkpointer(directory, read_only=True)
    # The source may or may not carry a KL reference (its run's kl_coef): try both layouts.
    layouts = [holder]
    if holder["train"].ref_params is not None:
      layouts.insert(0, {**holder, "train": holder["train"].replace(ref_params=None)})
    try:
      for n, layout in enumerate(layouts):
        try:
          _, restored, source_extras = reader.restore(layout, step=step)
          break
        except RuntimeError as err:
          if n + 1 == len(layouts):
            raise RuntimeError(f"{source}={path!r}: {err}") from err
    finally:
      reader.close()
    changed = self._check_fingerprint(source_extras.get("fingerprint"), self.base_config,
                                      f"{source}={path!r}")
    params = restored["train"].params  # Restored with `holder`'s shardings (replicated).
    print(f"params from {directory} step {step} (phase {source_extras.get('phase')}, "
          f"sft step {source_extras.get('sft_step')}, rl step {source_extras.get('rl_step')})",
          flush=True)
    provenance = {"directory": directory, "step": int(step), "layout_changed": changed,
                  **{k: source_extras.get(k) for k in _PROVENANCE_KEYS}}
    return {**holder, "train": _with_reference(holder["train"].replace(params=params))}, \
        provenance

  def _params_from_file(self, path: str, holder: dict, source: str) -> tuple[dict, dict]:
    """`holder` with the params of a safetensors params file (a shipped base model); the
    config.json beside it gives the layout they were trained under."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    changed = self._check_fingerprint(
        fingerprint_lib.of_config_json(os.path.join(folder, "config.json")), self.base_config,
        f"{source}={path!r}")
    like = holder["train"].params
    # A value head (route A's critic) starts fresh on a base that has none.
    params = params_file.load_params(path, jax.device_get(like), source,
                                     fresh_prefixes=("value_head/",))
    if self.info.process_count > 1:
      params = distributed.replicate(self.mesh, params)
    else:
      params = jax.tree.map(jnp.asarray, params)
    meta = params_file.read_metadata(path)
    file = params_file.params_path(path)
    print(f"params from {file} ({meta.get('description', 'no description')})", flush=True)
    provenance = {"file": file, "layout_changed": changed,
                  **{k: meta.get(k) for k in _PROVENANCE_KEYS}}
    return {**holder, "train": _with_reference(holder["train"].replace(params=params))}, \
        provenance

  def close(self):
    """Closes the logs, the engines' sandboxes and the audit log."""
    if self.logger is not None:
      self.logger.close()
    if self._route is not None:
      self._route.engine.close()
      self._route.eval_engine.close()
    self.audit.close()

  def _save(self, ckpt, holder, extras, *, force=False):
    global_step = extras["sft_step"] + extras["rl_step"]
    if self.info.process_count > 1:  # Orbax writes multi-host state as global arrays.
      holder = distributed.replicate(self.mesh, jax.device_get(holder))
    # The layout the params were trained under: checked when they are loaded again.
    extras = {**extras, "fingerprint": self._fingerprint(self._route.config)}
    ckpt.save(global_step, holder, None, extras, force=force)

  def _fingerprint(self, config) -> dict:
    """The layout of a route's config; the run's one tokenizer is hashed once, in init."""
    return {**fingerprint_lib.model_layout(config.model), "tokenizer": self._tokenizer_hash}

  def _check_fingerprint(self, saved, config, source: str) -> list[str]:
    """The allowed fingerprint fields that differ; an error for any other difference."""
    changed = fingerprint_lib.check(saved, self._fingerprint(config),
                                    self.train_spec.allow_fingerprint_change, source)
    if saved is None:
      print(f"{source} records no layout fingerprint: not checked.", flush=True)
    elif changed:
      print(f"{source}: layout fields {changed} differ, as "
            "config.train.allow_fingerprint_change allows.", flush=True)
    return changed

  # -- SFT -----------------------------------------------------------------------------

  def _run_sft(self, route, holder, extras, ckpt):
    tc = self.train_spec
    if extras["phase"] != "sft":
      return holder, extras
    optimizer = self._sft_optimizer(route)
    state = holder["train"]
    if extras["sft_step"] == 0:
      state = state.replace(opt_state=optimizer.init(state.params))
    if self.info.process_count > 1:
      state = distributed.replicate(self.mesh, jax.device_get(state))
    demo_idx = list(distributed.shard_indices(tc.sft_demos, self.info))
    tasks = [self.train_source[i] for i in demo_idx]
    t0 = time.time()
    demos = sft_lib.render_demonstrations(self.tokenizer, route.rollout_spec,
                                          self._env_factory, tasks,
                                          route.rollout_spec.system_prompt,
                                          play_expert=self.env_family.play_expert)
    long_idx = [i for i, d in enumerate(demos) if d is None]
    if long_idx:  # An action over max_new_tokens_per_turn: the engine truncates it as RL would.
      recorded = sft_lib.record_demonstrations(
          route.model, self._local(state.params), route.rollout_spec, self.tokenizer,
          self._env_factory, [tasks[i] for i in long_idx],
          play_expert=self.env_family.play_expert, steps=route.engine.steps)
      for i, d in zip(long_idx, recorded):
        demos[i] = d
    # Every process pads to the same length: the batch is one global array.
    longest = int(self._gather(np.asarray([max(d.length for d in demos)], np.int64)).max())
    length = sft_lib.padded_length(longest, route.rollout_spec.max_len)
    arrays = sft_lib.demonstration_arrays(demos, length)
    print(f"SFT: {len(demos)} expert demonstrations in {time.time() - t0:.1f}s "
          f"(mean {np.mean([d.length for d in demos]):.0f} tokens, padded to {length}; "
          f"{len(long_idx)} with an "
          f"action over max_new_tokens_per_turn, recorded through the engine)", flush=True)
    step_fn = sft_lib.make_sft_step(route.model, optimizer)
    local_batch = tc.sft_batch_size // self.info.process_count
    plateau = self._sft_plateau(route, length) if tc.sft_eval_every else None
    if plateau is not None:
      plateau.load_state_dict(extras.get("sft_plateau"))
    while extras["sft_step"] < tc.sft_steps and not self._stop.is_set():
      s = extras["sft_step"]
      rng = np.random.default_rng([self.base_config.seed, 7, s])
      rows = rng.choice(len(demos), size=local_batch, replace=len(demos) < local_batch)
      batch = distributed.global_batch(self.mesh, {k: v[rows] for k, v in arrays.items()}) \
          if self.info.process_count > 1 else {k: jnp.asarray(v[rows]) for k, v in arrays.items()}
      t1 = time.time()
      state, metrics = step_fn(state, batch)
      metrics = jax.device_get(metrics)
      extras["sft_step"] = s + 1
      self.logger.scalars(extras["sft_step"], metrics)
      if self.info.is_primary:
        print(f"sft {s + 1}/{tc.sft_steps} | loss {metrics['sft/loss']:.3f} | "
              f"acc {metrics['sft/token_accuracy']:.3f} | {time.time() - t1:.2f}s", flush=True)
      holder = {**holder, "train": state}
      stop = False
      if plateau is not None and extras["sft_step"] % tc.sft_eval_every == 0:
        stop = plateau.score(extras["sft_step"], state.params)
        extras["sft_plateau"] = plateau.state_dict()
        self.logger.scalars(extras["sft_step"], {"sft/validation_nll": plateau.last_nll,
                                                 "sft/validation_token_accuracy":
                                                 plateau.last_accuracy})
        if self.info.is_primary:
          print(f"sft {extras['sft_step']}: validation nll {plateau.last_nll:.4f} "
                f"(best {plateau.best_nll:.4f} at step {plateau.best_step}), "
                f"token accuracy {plateau.last_accuracy:.3f}", flush=True)
      if extras["sft_step"] % tc.checkpoint_every == 0 or stop:
        self._save(ckpt, holder, extras, force=stop)
      if stop:
        break
    if self._stop.is_set():
      self._save(ckpt, holder, extras, force=True)
      return holder, extras
    if plateau is not None and plateau.best_params is not None:
      state = state.replace(params=plateau.best_params)
      extras["sft_best_step"] = plateau.best_step
      print(f"SFT stopped at step {extras['sft_step']} (validation plateau); keeping the "
            f"params of step {plateau.best_step}, validation nll {plateau.best_nll:.4f}",
            flush=True)
    # Hand over to RL: a fresh optimiser state, the SFT checkpoint's held-out score.
    state = _with_reference(state.replace(
        opt_state=train_step_lib.make_optimizer(route.rl_spec).init(state.params),
        step=jnp.zeros((), jnp.int32), skipped_steps=jnp.zeros((), jnp.int32)))
    holder = {**holder, "train": state}
    extras["phase"] = "rl"
    self._evaluate_start(state.params, extras)
    self._save(ckpt, holder, extras, force=True)
    return holder, extras

  def _sft_plateau(self, route, length):
    tc = self.train_spec
    first = tc.sft_demos  # Train tasks the SFT set does not hold.
    tasks = [self.train_source[first + i] for i in range(tc.sft_validation_demos)]
    demos = sft_lib.render_demonstrations(self.tokenizer, route.rollout_spec,
                                          self._env_factory, tasks,
                                          route.rollout_spec.system_prompt,
                                          play_expert=self.env_family.play_expert)
    demos = [d for d in demos if d is not None]
    arrays = {k: jnp.asarray(v) for k, v in sft_lib.demonstration_arrays(demos, length).items()}
    score = jax.jit(lambda p: sft_lib.demonstration_scores(route.model, p, arrays))
    return sft_lib.PlateauStop(score, patience=tc.sft_patience, min_delta=tc.sft_min_delta)

  def _evaluate_start(self, params, extras):
    """Scores the checkpoint RL starts from (logged once; saved with the next checkpoint)."""
    extras["heldout_sft"] = self.evaluate(params, self.train_spec.eval_tasks)
    start = extras["heldout_sft"]
    self.logger.scalars(extras["sft_step"] + extras["rl_step"],
                        {k.replace("heldout/", "heldout_sft/"): v
                         for k, v in start.items() if not isinstance(v, list)})
    extras.setdefault("history", []).append(history_row(0, {
        "heldout/solve_rate": start["heldout/solve_rate"],
        "heldout/solve_stderr": start["heldout/solve_stderr"]}))
    print(f"held-out solve rate of the RL starting point: {start['heldout/solve_rate']:.3f} "
          f"± {start['heldout/solve_stderr']:.3f} ({start['heldout/episodes']} episodes, "
          f"{start['heldout/seconds']:.0f}s)", flush=True)

  # -- RL ------------------------------------------------------------------------------

  def _make_pool(self, spec, extras) -> tuple[task_selection.TaskPool, TaskStream]:
    """The run's task pool and its stream, restored from `extras` when resuming."""
    stream = self.tasks
    pool = task_selection.TaskPool(
        spec, stream, shard=(self.info.process_index, self.info.process_count),
        default_tier=self.env_spec.default_tier)
    if extras.get("pool"):
      pool.load_state_dict(extras["pool"])
      stream.position.update(extras["stream"])
    return pool, stream

  def _run_rl(self, holder, extras, ckpt, num_steps):
    cfg, tc = self.base_config, self.train_spec
    state = holder["train"]
    if self.info.process_count > 1:
      state = distributed.replicate(self.mesh, jax.device_get(state))
    start_scored_here = ("heldout_sft" in extras
                         and self._same_eval_settings(extras["heldout_sft"]))
    if not start_scored_here and extras["rl_step"] == 0:
      # No SFT phase, or a start point scored under other eval settings (a copied or
      # resumed checkpoint): score the params RL starts from, so the summary compares
      # like with like.
      self._ensure_route(extras["rl_step"])
      self._evaluate_start(state.params, extras)
      self._save(ckpt, holder, extras, force=True)
    elif not start_scored_here:
      print("warning: the RL starting point was scored under other held-out settings "
            f"({_eval_settings_text(extras['heldout_sft'])}) than this run's "
            f"({_eval_settings_text(self._eval_settings())}) and RL has already moved the "
            "params, so it cannot be re-scored; the summary flags the comparison.", flush=True)
    pool, stream = self._make_pool(self._ensure_route(extras["rl_step"]).rl_spec, extras)
    run_start, steps_done = time.time(), 0
    while extras["rl_step"] < num_steps and not self._stop.is_set():
      step = extras["rl_step"]
      route = self._ensure_route(step)
      t0 = time.time()
      pool.rng = np.random.default_rng([cfg.seed, 11, step])
      route.engine.set_params(self._local(state.params), step)
      seeds_used, end_reasons = [], []

      def generate(task_ids, group_size, _route=route, _step=step):
        seeds = [int(_step) * 1_000_003 + self.tasks.number(t) for t in task_ids]
        seeds_used.extend(seeds)
        trajs = _route.engine.run([self.tasks.task(t) for t in task_ids], task_seeds=seeds)
        end_reasons.extend(t.end_reason for t in trajs)
        groups = []
        for g, task in enumerate(task_ids):
          members = [t for t in trajs if t.group_id == g]
          groups.append(dynamic_sampling.Group(task, np.asarray([m.reward for m in members]),
                                               members))
        return groups

      sampler = dynamic_sampling.DynamicSampler(pool, generate)
      groups, collect_stats = sampler.collect(tc.groups_per_step // self.info.process_count)
      rollout_s = time.time() - t0
      trajs = []
      for g, group in enumerate(groups):
        gid = self.info.process_index * len(groups) + g
        for t in group.payload:
          trajs.append(dataclasses.replace(t, group_id=gid))
      # Task numbers travel as int32: a float32 gather would round ids above 2^24.
      numbers = self._gather(np.asarray([self.tasks.number(t) for t, _ in pool.outcomes],
                                        np.int32))
      outcome_rewards = self._gather(np.asarray([r for _, r in pool.outcomes], np.float32))
      selection = pool.selection_stats()
      pool.apply([self.tasks.task_id(n) for n in numbers], list(outcome_rewards))
      pool.end_step()

      t1 = time.time()
      # Every process pads to one length: the longest trajectory rounded up to a multiple
      # of 128 (a handful of shapes to compile, far less padding than max_len).
      longest = int(self._gather(np.asarray([max(t.length for t in trajs)], np.int64)).max())
      longest = max(longest, 1)  # Every group may have failed to start (no tokens).
      local_batch = to_batch(trajs, length=sft_lib.padded_length(
          longest, route.rollout_spec.max_len, multiple=128))
      batch = (distributed.global_batch(self.mesh, local_batch)
               if self.info.process_count > 1 else local_batch)
      state, metrics = route.train_step(state, batch)
      metrics = jax.device_get(metrics)
      learner_s = time.time() - t1
      extras["rl_step"] = step + 1
      gen_tokens = float(self._gather(np.asarray([sum(t.num_generated for t in trajs)],
                                                 np.float64)).sum())
      rewards = self._gather(np.asarray([t.reward for t in trajs], np.float64))
      tool_stats = _tool_statistics(trajs)
      logged = {**metrics,
                # Every episode sampled this step, the uniform groups dynamic sampling
                # dropped included; batch/* is the part the learner trained on.
                **episode_rates("rollout", outcome_rewards),
                **episode_rates("batch", rewards),
                "rollout/generated_tokens": gen_tokens,
                "rollout/tokens_per_s": gen_tokens / max(rollout_s, 1e-9),
                "rollout/seconds": rollout_s,
                "rollout/groups_dropped": collect_stats.groups_dropped,
                "rollout/sampling_rounds": collect_stats.rounds,
                "rollout/peak_kv_bytes": route.engine.stats.peak_kv_bytes,
                "rollout/mean_length": float(np.mean([t.length for t in trajs])),
                **end_reason_metrics(end_reasons, self._gather),
                "learner/seconds": learner_s,
                "learner/tokens_per_s": float(np.asarray(local_batch.loss_mask_bt).sum()
                                              * self.info.process_count) / max(learner_s, 1e-9),
                "stage/route_a": float(route.name == "A"),
                **selection,
                **tool_stats}
      logged["rollout/solve_stderr"] = _solve_stderr_by_task(numbers, outcome_rewards)
      if (step + 1) % tc.eval_every == 0 or step + 1 == num_steps:
        evaluation = self.evaluate(state.params, tc.eval_tasks)
        logged.update({k: v for k, v in evaluation.items() if not isinstance(v, list)})
        extras["heldout_last"] = evaluation
      global_step = extras["sft_step"] + extras["rl_step"]
      logged = self.logger.scalars(global_step, logged)
      extras.setdefault("history", []).append(history_row(step + 1, logged))
      extras["rl_wall_seconds"] = extras.get("rl_wall_seconds", 0.0) + time.time() - t0
      extras.setdefault("mismatch_kl", []).append(
          float(metrics.get("mismatch/k3", float("nan"))))
      if (step + 1) % tc.log_samples_every == 0:
        for t in trajs[:tc.num_samples_logged]:
          self.logger.text(global_step, "samples", render_trajectory(self.tokenizer, t))
      steps_done += 1
      eta = (time.time() - run_start) / steps_done * (num_steps - step - 1)
      if self.info.is_primary:
        solve = extras.get("heldout_last", extras["heldout_sft"])["heldout/solve_rate"]
        print(f"rl {step + 1}/{num_steps} | reward {logged['rollout/reward_mean']:.3f} | "
              f"train solve {logged['rollout/solve_rate']:.3f} | held-out solve {solve:.3f} | "
              f"{logged['rollout/tokens_per_s']:.0f} tok/s | ETA {eta:.0f}s", flush=True)
      extras["pool"], extras["stream"] = pool.state_dict(), dict(stream.position)
      holder = {**holder, "train": state}
      if extras["rl_step"] % tc.checkpoint_every == 0 or extras["rl_step"] == num_steps:
        self._save(ckpt, holder, extras)
    if self._stop.is_set():
      self._save(ckpt, holder, extras, force=True)
    return holder, extras

  def _summary(self, extras, start_wall, params) -> dict:
    kl = [k for k in extras.get("mismatch_kl", []) if math.isfinite(k)]
    start = extras.get("heldout_sft", {})
    final = extras.get("heldout_last", start)
    gain = None
    if start.get("heldout/solves_per_task") and final.get("heldout/solves_per_task"):
      gain = paired_gain(
          np.asarray(start["heldout/solves_per_task"])[:, None]
          / start["heldout/samples_per_task"],
          np.asarray(final["heldout/solves_per_task"])[:, None]
          / final["heldout/samples_per_task"])
    return {
        "heldout_gain": None if gain is None else gain["gain"],
        "heldout_gain_stderr": None if gain is None else gain["stderr"],
        "heldout_gain_ci95": None if gain is None else [gain["ci95_low"], gain["ci95_high"]],
        "heldout_episodes": final.get("heldout/episodes"),
        "heldout_stderr_sft": start.get("heldout/solve_stderr"),
        "heldout_stderr_final": final.get("heldout/solve_stderr"),
        "rl_wall_seconds": extras.get("rl_wall_seconds", 0.0),
        "heldout_solve_rate_sft": extras.get("heldout_sft", {}).get("heldout/solve_rate"),
        "heldout_solve_rate_final": final.get("heldout/solve_rate"),
        "heldout_mean_reward_sft": extras.get("heldout_sft", {}).get("heldout/mean_reward"),
        "heldout_mean_reward_final": final.get("heldout/mean_reward"),
        "heldout_pass_at_k_sft": extras.get("heldout_sft", {}).get("heldout/pass_at_k"),
        "heldout_pass_at_k_final": final.get("heldout/pass_at_k"),
        "heldout_samples_per_task": final.get("heldout/samples_per_task"),
        # False when the start and the final score came from different eval settings.
        "heldout_comparable": self._same_eval_settings(extras.get("heldout_sft", {}))
                              and self._same_eval_settings(final),
        "mismatch_kl_mean": float(np.mean(kl)) if kl else None,
        "mismatch_kl_max": float(np.max(kl)) if kl else None,
        "init_checkpoint": extras.get("init_checkpoint"),
        "rl_steps": extras["rl_step"],
        "sft_steps": extras["sft_step"],
        "wall_seconds": time.time() - start_wall,
        "params_sha256": params_digest(params),
        "config": json.loads(self.base_config.to_json_best_effort()),
    }


def _with_reference(state):
  """The state with its KL reference (when it has one) set to its current params."""
  if state.ref_params is None:
    return state
  return state.replace(ref_params=jax.tree.map(jnp.copy, state.params))


def end_reason_metrics(reasons, gather=lambda x: x) -> dict:
  """rollout/end_<reason>: episodes by how they ended, one key per END_REASONS entry and
  'other', summed over processes by `gather` (a flat all-gather of each one's counts)."""
  names = END_REASONS + ("other",)
  counts = [sum(r == n for r in reasons) for n in END_REASONS]
  counts.append(len(reasons) - sum(counts))
  counts = gather(np.asarray(counts, np.int32)).reshape(-1, len(names)).sum(0)
  return {f"rollout/end_{n}": int(c) for n, c in zip(names, counts)}


def _solve_stderr_by_task(task_n: np.ndarray, rewards_n: np.ndarray) -> float:
  """Stderr of the solve rate of episodes of tasks `task_n`, tasks as the unit."""
  _, inverse = np.unique(task_n, return_inverse=True)
  solved_n = (np.asarray(rewards_n, np.float64) >= SOLVED_REWARD).astype(np.float64)
  per_task_b = np.bincount(inverse, solved_n) / np.bincount(inverse)
  return pass1_stderr(per_task_b[:, None])


def _eval_settings_text(scores: dict) -> str:
  return ", ".join(f"{k.split('/')[-1]}={scores.get(k)}" for k in _EVAL_SETTING_KEYS)


def params_digest(params) -> str:
  """A hash of every parameter's bytes: equal runs give equal digests."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(params)):
    h.update(jax.tree_util.keystr(path).encode())
    h.update(np.ascontiguousarray(leaf).tobytes())
  return h.hexdigest()


def _tool_statistics(trajs) -> dict:
  calls, denied, errors = {}, 0, 0
  for t in trajs:
    for info in t.tool_infos:
      if not info:
        continue
      tool = info.get("tool") or "none"
      calls[tool] = calls.get(tool, 0) + 1
      denied += info.get("decision") == "denied"
      errors += info.get("decision") == "error"
  out = {f"tools/calls_{k}": v for k, v in calls.items()}
  out["tools/calls_total"] = sum(calls.values())
  out["tools/denied"] = denied
  out["tools/errors"] = errors
  return out


def render_trajectory(tokenizer, traj) -> str:
  """A readable transcript: the context as text, model turns marked."""
  parts = []
  spans = sorted(traj.turn_spans)
  pos = 0
  for n, (start, end) in enumerate(spans):
    parts.append(tokenizer.decode(traj.tokens[pos:start]))
    parts.append(f"\n>>> model turn {n + 1}:\n" + tokenizer.decode(traj.tokens[start:end]))
    pos = end
  parts.append(tokenizer.decode(traj.tokens[pos:]))
  return (f"reward {traj.reward:.2f}, end: {traj.end_reason}, {traj.length} tokens\n"
          + "".join(parts))


def format_summary(summary: dict) -> str:
  rows = [(k, summary.get(k)) for k in ("heldout_solve_rate_sft", "heldout_solve_rate_final",
                                        "heldout_pass_at_k_sft", "heldout_pass_at_k_final",
                                        "heldout_mean_reward_sft", "heldout_mean_reward_final",
                                        "heldout_episodes", "mismatch_kl_mean", "rl_steps",
                                        "rl_wall_seconds", "wall_seconds")]
  width = max(len(k) for k, _ in rows)
  lines = ["summary"] + [f"  {k:<{width}}  {v:.4g}" if isinstance(v, float)
                         else f"  {k:<{width}}  {v}" for k, v in rows]
  if summary.get("heldout_gain") is not None:
    low, high = summary["heldout_gain_ci95"]
    lines.append(f"held-out pass@1 {100 * summary['heldout_solve_rate_sft']:.1f}% -> "
                 f"{100 * summary['heldout_solve_rate_final']:.1f}%: gain "
                 f"{100 * summary['heldout_gain']:+.1f} points, 95% interval "
                 f"[{100 * low:+.1f}, {100 * high:+.1f}] (paired over "
                 f"{summary['heldout_episodes']} episodes)")
  if summary.get("curves"):
    lines.append(f"learning curves: {summary['curves']}")
  return "\n".join(lines)

