"""Config sections defined once: a frozen dataclass per section, built from its ConfigDict.

A section is a frozen dataclass whose fields carry the defaults and whose `__post_init__`
checks values with `check`. `to_config_dict` turns a section into the ConfigDict that
config files edit and that `--config.<field>=value` overrides; `from_config_dict` builds the
section back by field name. A nested dataclass field is a nested section. Both directions
check what the ConfigDict cannot: an unknown key is an error that names it and lists the
valid ones, a wrong type names the field, and a failed `check` names the full path, e.g.
`config.rl.optim.learning_rate=-1: expected a positive number.`

The built sections are hashable, so they are safe as jit static arguments.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

import ml_collections

T = TypeVar("T")


class ConfigError(ValueError):
  """A config value that is wrong; the message names the field and what was expected."""


class FieldError(ConfigError):
  """Raised by `check` inside a section; `from_config_dict` prefixes the section's path."""

  def __init__(self, field: str, value: Any, expected: str):
    self.field, self.value, self.expected = field, value, expected
    super().__init__(f"{field}={value!r}: expected {expected}.")

  def at(self, path: str) -> ConfigError:
    return ConfigError(f"{path}.{self.field}={self.value!r}: expected {self.expected}.")


def check(ok: bool, field: str, value: Any, expected: str) -> None:
  """The one validation helper: raises unless `ok`, naming `field`, `value` and what was
  `expected`. Inside a section, `field` is relative to it (e.g. 'learning_rate')."""
  if not ok:
    raise FieldError(field, value, expected)


def one_of(value: Any, field: str, choices: tuple) -> None:
  check(value in choices, field, value, f"one of {choices}")


def is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def derived(default: Any, source: str) -> Any:
  """A field another section owns: kept out of this section's ConfigDict, filled by the code
  that joins the sections from `source` (e.g. 'config.rollout.max_turns')."""
  return dataclasses.field(default=default, metadata={"derived_from": source})


def _derived_from(f: dataclasses.Field) -> str | None:
  return f.metadata.get("derived_from")


def _field_types(cls) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _is_section(tp) -> bool:
  return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, path: str) -> Any:
  """`value` as the annotation `tp` asks, or a ConfigError naming `path`."""
  origin = typing.get_origin(tp)
  if tp is float:
    if is_number(value):
      return float(value)
    raise ConfigError(f"{path}={value!r}: expected a number.")
  if tp is int:
    if is_int(value):
      return value
    raise ConfigError(f"{path}={value!r}: expected an integer.")
  if tp is bool:
    if isinstance(value, bool):
      return value
    raise ConfigError(f"{path}={value!r}: expected True or False.")
  if tp is str:
    if isinstance(value, str):
      return value
    raise ConfigError(f"{path}={value!r}: expected a string.")
  if origin is dict:
    key_type, item = typing.get_args(tp)
    if isinstance(value, ml_collections.ConfigDict):
      value = value.to_dict()
    if not isinstance(value, dict):
      raise ConfigError(f"{path}={value!r}: expected a section of named entries.")
    return {_coerce(k, key_type, f"{path} key"): (
        from_config_dict(item, v, f"{path}.{k}") if _is_section(item)
        else _coerce(v, item, f"{path}.{k}")) for k, v in value.items()}
  if origin is tuple:
    if not isinstance(value, (tuple, list)):
      raise ConfigError(f"{path}={value!r}: expected a tuple.")
    args = typing.get_args(tp)
    item = args[0] if args else Any
    return tuple(_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value))
  if origin in (typing.Union, types.UnionType):
    for arg in typing.get_args(tp):
      try:
        return _coerce(value, arg, path)
      except ConfigError:
        continue
    raise ConfigError(f"{path}={value!r}: expected {tp}.")
  return value  # Any, or an annotation this helper does not police.


def from_config_dict(cls: type[T], values: Any, path: str, **joined: Any) -> T:
  """The section `cls` built from a ConfigDict (or dict) by field name.

  Missing keys take the dataclass default; an unknown key is a ConfigError that lists the
  valid ones. `path` (e.g. 'config.rl') prefixes every message. `joined` fills derived
  fields from the sections that own them.
  """
  if isinstance(values, cls):
    return dataclasses.replace(values, **joined) if joined else values
  if isinstance(values, ml_collections.ConfigDict):
    values = values.to_dict()
  if not isinstance(values, dict):
    raise ConfigError(f"{path}={values!r}: expected a section (a ConfigDict) of "
                      f"{sorted(f.name for f in dataclasses.fields(cls))}.")
  names = [f.name for f in dataclasses.fields(cls) if f.init and not _derived_from(f)]
  for f in dataclasses.fields(cls):
    if f.name in values and _derived_from(f):
      raise ConfigError(f"{path}.{f.name} is set from {_derived_from(f)}; set that instead "
                        "(one knob, so the two cannot disagree).")
  unknown = sorted(set(values) - set(names))
  if unknown:
    raise ConfigError(f"{path} has unknown field{'s' if len(unknown) > 1 else ''} "
                      f"{', '.join(unknown)}; valid fields: {', '.join(sorted(names))}.")
  missing = [f.name for f in dataclasses.fields(cls) if f.name in names and f.name not in values
             and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
  if missing:
    raise ConfigError(f"{path} lacks the field{'s' if len(missing) > 1 else ''} "
                      f"{', '.join(missing)}.")
  types_by_name = _field_types(cls)
  kwargs = dict(joined)
  for name in names:
    if name not in values:
      continue
    tp, field_path = types_by_name[name], f"{path}.{name}"
    if _is_section(tp):
      kwargs[name] = from_config_dict(tp, values[name], field_path)
    else:
      kwargs[name] = _coerce(values[name], tp, field_path)
  try:
    return cls(**kwargs)
  except FieldError as e:
    sources = {f.name: _derived_from(f) for f in dataclasses.fields(cls) if _derived_from(f)}
    if e.field in sources:  # Name the knob the user sets, not the copy.
      raise ConfigError(f"{sources[e.field]}={e.value!r}: expected {e.expected}.") from None
    raise e.at(path) from None


def to_config_dict(section: Any) -> ml_collections.ConfigDict:
  """A ConfigDict of a section's values (its defaults, for a default-built section)."""
  out = ml_collections.ConfigDict()
  for f in dataclasses.fields(section):
    if not f.init or _derived_from(f):
      continue
    out[f.name] = _to_config_value(getattr(section, f.name))
  return out


def _to_config_value(value: Any) -> Any:
  if dataclasses.is_dataclass(value):
    return to_config_dict(value)
  if isinstance(value, dict):
    return ml_collections.ConfigDict({k: _to_config_value(v) for k, v in value.items()})
  return value

