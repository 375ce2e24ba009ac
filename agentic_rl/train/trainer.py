"""The main job: SFT warm start on the env's expert, then agentic RL.

    tasks -> rollout engine (sandboxed envs) -> learner -> held-out evaluation
    -> logs -> orbax checkpoint

One `Trainer(config, workdir).run()` call. Restarting with the same workdir resumes
from the latest checkpoint; SIGTERM saves one and returns. The phases live beside it
(sft_phase.py, rl_phase.py), as do the evaluator, state I/O, routes and reporting; the
trainer wires them together. Every random choice derives from config.seed and the step,
so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import tempfile
import threading
import time
from typing import Any

import ml_collections

from agentic_rl.envs import registry
from agentic_rl.model import config as model_config
from agentic_rl.parallel import mesh as mesh_lib
from agentic_rl.parallel import mesh_config
from agentic_rl.rollout import config as rollout_config_lib
from agentic_rl.rollout import tokenizer as tokenizer_lib
from agentic_rl.train import config as train_config_lib
from agentic_rl.train import distributed
from agentic_rl.train import fingerprint as fingerprint_lib
from agentic_rl.train import learner_lengths
from agentic_rl.train import reporting
from agentic_rl.train.checkpointing import Checkpointer
from agentic_rl.train.curves import write_curves
from agentic_rl.train.evaluator import Evaluator
from agentic_rl.train.metrics_logger import MetricsLogger
from agentic_rl.train.rl_phase import run_rl
from agentic_rl.train.routes import Routes
from agentic_rl.train.run_context import RunContext
from agentic_rl.train.run_state import RunState
from agentic_rl.train.sft_phase import run_sft
from agentic_rl.train.state_io import StateIO
from agentic_rl.train.task_stream import TaskStream


class Trainer:

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    self.config = config
    self.workdir = os.path.abspath(workdir)
    self.train_spec = tc = train_config_lib.validate_train_config(config.train)
    model_spec = model_config.validate(config.model)
    # max_len 0 means the model's max_seq_len: the learner pads to the resolved capacity.
    rollout_spec = rollout_config_lib.validate(config.rollout, model_spec, seed=config.seed)
    self.learner_lengths = learner_lengths.learner_lengths(tc.learner_lengths,
                                                           rollout_spec.max_len)
    self.info = distributed.initialize(tc.coordinator_address, tc.num_processes, tc.process_id)
    # The learner's mesh (config.mesh), checked against the devices and the model first.
    self.mesh = mesh_lib.build_mesh(mesh_config.validate_mesh_config(config.mesh), model_spec)
    self.tokenizer = tokenizer_lib.make_tokenizer(config.tokenizer)
    # The env by name (config.env.name): its spec, envs, tasks, families and expert.
    self.env_spec = spec = registry.build_spec(
        config.env, max_turns=config.rollout.max_turns,
        process_signals=registry.reads_process_signals(*_estimators(config, tc)))
    self.env_family = family = registry.family_of(spec)
    if tc.sft_recovery_share > 0 and family.play_recovery is None:
      raise ValueError(f"config.train.sft_recovery_share={tc.sft_recovery_share}: the "
                       f"{spec.name!r} env has no recovery play; set it to 0.")
    # RL draws from the default tier and every tier of the curriculum.
    wanted = (spec.default_tier,) + tuple(
        t for t in config.rl.task_selection.get("curriculum", ()) if t != spec.default_tier)
    unknown = [t for t in wanted if t not in spec.tiers]
    if unknown:
      raise ValueError(f"config.rl.task_selection.curriculum names tiers {unknown}; the env "
                       f"has {list(spec.tiers)}.")
    self.tasks = TaskStream(family, spec, wanted, config.seed)
    os.makedirs(self.workdir, exist_ok=True)
    self.audit = family.make_audit_log(  # config.env.audit_* reach the run's log.
        spec, os.path.join(self.workdir, f"audit.{self.info.process_index}.jsonl"))
    self.env_factory = functools.partial(family.make_env, spec, self.audit)
    self.routes = Routes(config, tc, self.tokenizer, self.env_factory, self.mesh)
    self.evaluator = Evaluator(tc, family.task_source(spec, "heldout", spec.default_tier),
                               self.info)
    self.state_io = StateIO(self.info, self.mesh, fingerprint_lib.tokenizer_hash(
        config.tokenizer), tc.allow_fingerprint_change)
    self._logger: MetricsLogger | None = None

  # -- params and scores for the launch commands ------------------------------------------

  def load_params(self, path: str, source: str) -> tuple[Any, dict]:
    """(params, provenance) saved at `path`: a run's workdir, checkpoints/ or step folder,
    or a params.safetensors folder; checked against this config's model and layout.
    `source` names the flag or field `path` came from in errors."""
    route = self.routes.for_step(0)
    state, provenance = self.state_io.load_params(path, route.init_state(self.config.seed),
                                                  self.config, source)
    return state.params, provenance

  def score_params(self, params) -> dict:
    """Held-out scores of `params` under this config's eval settings (Evaluator.score)."""
    return self.evaluator.score(self.routes.for_step(0), params)

  def evaluate_checkpoint(self, path: str, source: str = "checkpoint") -> dict:
    """score_params of the params saved at `path` (see load_params), with where they came
    from under "checkpoint"."""
    params, provenance = self.load_params(path, source)
    return {"checkpoint": provenance, **self.score_params(params)}

  # -- the run ---------------------------------------------------------------------------

  def run(self) -> dict:
    start_wall = time.time()
    tc = self.train_spec
    ckpt = Checkpointer(os.path.join(self.workdir, "checkpoints"),
                        max_to_keep=tc.keep_checkpoints)
    resumed = self.state_io.resume(
        ckpt, lambda step: self.routes.for_step(step).init_state(self.config.seed),
        lambda step: self.routes.config_for_step(step)[1])
    if resumed is not None:
      state, run = resumed
    else:
      state = self.routes.for_step(0).init_state(self.config.seed)
      run = RunState(phase="sft" if tc.sft_steps else "rl")
      if tc.init_checkpoint:
        state, run.init_checkpoint = self.state_io.load_params(
            tc.init_checkpoint, state, self.config, "config.train.init_checkpoint")
    self._logger = MetricsLogger(self.workdir, resume_step=run.global_step,
                                 enabled=self.info.is_primary)
    ctx = RunContext(
        config=self.config, train_spec=tc, info=self.info, mesh=self.mesh,
        tokenizer=self.tokenizer, env_family=self.env_family, env_spec=self.env_spec,
        env_factory=self.env_factory,
        train_source=self.env_family.task_source(self.env_spec, "train",
                                                 self.env_spec.default_tier),
        tasks=self.tasks, routes=self.routes, evaluator=self.evaluator,
        state_io=self.state_io, checkpoints=ckpt, logger=self._logger,
        stop=threading.Event(), learner_lengths=self.learner_lengths)
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: ctx.stop.set())
    try:
      state = run_sft(ctx, state, run)
      if not ctx.stop.is_set():
        state = run_rl(ctx, state, run)
    finally:
      signal.signal(signal.SIGTERM, previous_handler)
      ckpt.close()
    try:
      if ctx.stop.is_set():
        print("SIGTERM: checkpoint saved, exiting.", flush=True)
        return {"interrupted": True, "phase": run.phase, "sft_step": run.sft_step,
                "rl_step": run.rl_step}
      return self._finish(run, start_wall, state.params)
    finally:
      self.close()

  def _finish(self, run: RunState, start_wall: float, params) -> dict:
    """Writes summary.json and curves.png and prints the summary."""
    comparable = (self.evaluator.same_settings(run.heldout_sft)
                  and self.evaluator.same_settings(run.heldout_last or run.heldout_sft))
    summary = reporting.summarize(run, start_wall=start_wall, params=params,
                                  config=self.config, comparable=comparable)
    # Every process prints it: replicas of one data-parallel run must agree.
    print(f"process {self.info.process_index} final params sha256 {summary['params_sha256']}",
          flush=True)
    if self.info.is_primary:
      with open(os.path.join(self.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
      if run.history:
        summary["curves"] = write_curves(run.history, os.path.join(self.workdir, "curves.png"),
                                         title=f"seed {self.config.seed}")
      print(reporting.format_summary(summary), flush=True)
    return summary

  def close(self):
    """Closes the logs, the engines' sandboxes and the audit log."""
    if self._logger is not None:
      self._logger.close()
    self.routes.close()
    self.audit.close()


def load_params_with(config, path: str, source: str) -> tuple[Any, dict]:
  """(params, provenance) saved at `path`, read as Trainer.load_params reads them under
  `config`, by a Trainer on a scratch workdir (for launch commands that only need params)."""
  with tempfile.TemporaryDirectory() as scratch:
    trainer = Trainer(config, scratch)
    try:
      return trainer.load_params(path, source)
    finally:
      trainer.close()


def _estimators(config: ml_collections.ConfigDict, tc) -> tuple[str, ...]:
  """The advantage estimators the run's stages use: its own, and route A's after a switch."""
  own = config.rl.advantage.estimator
  if tc.switch_to_route_a_at < 0:
    return (own,)
  return own, train_config_lib.route_a_config(config).rl.advantage.estimator
