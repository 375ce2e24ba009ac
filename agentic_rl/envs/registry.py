"""Tool environments by name: what the trainer needs from each, behind one seam.

`config.env.name` picks an `EnvFamily`. The family's spec type is the schema of the rest of
`config.env`; with it the trainer builds envs, reads tasks by split and tier, groups tasks
into families for the task pool's priors, and records SFT demonstrations with the family's
scripted expert. Nothing outside this file names a concrete env.

An env's spec must have `tiers` (a mapping), `default_tier` and `max_turns` (joined from
config.rollout.max_turns). Register a new env with `register(EnvFamily(...))` in this file;
WORKSPACE.md, "How to add a tool environment", walks through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from agentic_rl.config_schema import ConfigError, from_config_dict


@dataclasses.dataclass(frozen=True)
class EnvFamily:
  name: str
  spec_type: type  # The frozen dataclass of config.env for this env.
  make_env: Callable[[Any, Any], Any]  # (spec, audit_log or None) -> an envs.env.Env.
  # (spec, split 'train' | 'heldout', tier) -> random-access tasks of that split and tier.
  task_source: Callable[[Any, str, str], Sequence[Any]]
  task_family: Callable[[Any], str]  # A task's family: pass rates are pooled per family.
  # (env, task) -> an episode with .first_observation and .turns [(action, observation)].
  play_expert: Callable[[Any, Any], Any]
  # (spec, path or None) -> the run's envs.audit.AuditLog, with the env's audit options.
  make_audit_log: Callable[[Any, Any], Any] = lambda spec, path: _audit_log(path)
  # (env, task) -> a recovery demonstration: like play_expert's, with a deliberate wrong
  # step and its correction (.no_loss_turns lists the turns not to teach). None: none.
  play_recovery: Callable[[Any, Any], Any] | None = None


def _audit_log(path, **options):
  from agentic_rl.envs.audit import AuditLog
  return AuditLog(path, **options)


def _swe() -> EnvFamily:
  from agentic_rl.envs import config as swe_config

  def make_env(spec, audit_log):
    from agentic_rl.envs.swe_env import SweEnv
    return SweEnv(spec, audit_log=audit_log)

  def task_source(spec, split, tier):
    from agentic_rl.envs.datasets import SweTaskSource  # grain: seconds to import.
    return SweTaskSource(split, tiers=(tier,), config=spec)

  def play_expert(env, task):
    from agentic_rl.envs.expert import play_expert as play
    return play(env, task)

  def play_recovery(env, task):
    from agentic_rl.envs.expert import play_recovery as play
    return play(env, task)

  def make_audit_log(spec, path):
    return _audit_log(path, fsync=spec.audit_fsync, max_arg_chars=spec.audit_max_arg_chars)

  return EnvFamily("swe", swe_config.EnvSpec, make_env, task_source,
                   lambda task: task.bugs[0].family, play_expert, make_audit_log,
                   play_recovery)


def _countdown() -> EnvFamily:
  from agentic_rl.envs import countdown
  return EnvFamily("countdown", countdown.CountdownSpec,
                   lambda spec, audit_log: countdown.CountdownEnv(spec, audit_log=audit_log),
                   countdown.CountdownTaskSource, countdown.task_family,
                   countdown.play_expert)


_BUILDERS: dict[str, Callable[[], EnvFamily]] = {"swe": _swe, "countdown": _countdown}
_FAMILIES: dict[str, EnvFamily] = {}


def register(family: EnvFamily) -> None:
  """Adds (or replaces) an env under `family.name`."""
  _FAMILIES[family.name] = family
  _BUILDERS[family.name] = lambda: family


def names() -> tuple[str, ...]:
  return tuple(sorted(_BUILDERS))


def get(name: str) -> EnvFamily:
  if name not in _BUILDERS:
    raise ConfigError(f"config.env.name={name!r}: expected one of {names()} "
                      "(agentic_rl/envs/registry.py).")
  if name not in _FAMILIES:
    _FAMILIES[name] = _BUILDERS[name]()
  return _FAMILIES[name]


def env_name(env_config: Any) -> str:
  if isinstance(env_config, (ml_collections.ConfigDict, dict)):
    return env_config.get("name", "swe")
  return getattr(env_config, "name")


# Advantage estimators that read the env's per-turn process signals.
PROCESS_SIGNAL_ESTIMATORS = ("turn_level", "gae")


def build_spec(env_config: Any, *, max_turns: int | None = None,
               process_signals: bool | None = None) -> Any:
  """`config.env` as its env's spec (checked once), with the run's turn budget and, for an
  env that can measure per-edit process signals, whether any of the run's advantage
  estimators reads them (`reads_process_signals`)."""
  family = get(env_name(env_config))
  joined = {} if max_turns is None else {"max_turns": max_turns}
  fields = {f.name for f in dataclasses.fields(family.spec_type)}
  if process_signals is not None and "process_signal_on_edit" in fields:
    joined["process_signal_on_edit"] = bool(process_signals)
  return from_config_dict(family.spec_type, env_config, "config.env", **joined)


def reads_process_signals(*estimators: str) -> bool:
  """Whether any of these advantage estimators reads per-turn process signals."""
  return any(e in PROCESS_SIGNAL_ESTIMATORS for e in estimators)


def family_of(spec: Any) -> EnvFamily:
  return get(spec.name)
