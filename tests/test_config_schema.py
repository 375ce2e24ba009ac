"""Sections defined once: ConfigDict <-> frozen dataclass by field name, with named errors."""

import dataclasses

import ml_collections
import pytest

from agentic_rl.config_schema import (ConfigError, check, derived, from_config_dict,
                                      to_config_dict)
from tests.dict_sections import DictSections


@dataclasses.dataclass(frozen=True)
class Inner:
  rate: float = 0.5
  names: tuple[str, ...] = ("a",)

  def __post_init__(self):
    check(0 <= self.rate <= 1, "rate", self.rate, "a number in [0, 1]")


@dataclasses.dataclass(frozen=True)
class Part:
  size: int  # Required: no default.
  flag: bool = False


@dataclasses.dataclass(frozen=True)
class Outer:
  steps: int = 3
  inner: Inner = Inner()
  parts: dict[str, Part] = dataclasses.field(default_factory=lambda: {"x": Part(1)})
  copy: int = derived(7, "config.other.copy")

  def __post_init__(self):
    check(self.steps >= 0, "steps", self.steps, "an integer >= 0")
    check(self.copy > 0, "copy", self.copy, "a positive integer")


def test_defaults_round_trip_through_the_config_dict():
  c = to_config_dict(Outer())
  assert isinstance(c, ml_collections.ConfigDict)
  assert set(c.keys()) == {"steps", "inner", "parts"}  # The derived copy is not a knob here.
  assert c.inner.rate == 0.5 and c.parts.x.size == 1
  assert from_config_dict(Outer, c, "config.o") == Outer()


def test_values_are_built_by_field_name_and_coerced():
  c = to_config_dict(Outer())
  c.inner.rate = 1  # An int where a float is declared is a float.
  c.inner.names = ["p", "q"]  # A list where a tuple is declared is a tuple.
  c.parts.y = ml_collections.ConfigDict({"size": 4, "flag": True})
  built = from_config_dict(Outer, c, "config.o", copy=9)
  assert built.inner == Inner(1.0, ("p", "q")) and isinstance(built.inner.rate, float)
  assert built.parts == {"x": Part(1), "y": Part(4, True)} and built.copy == 9
  assert hash(Inner(1.0, ("p", "q"))) == hash(built.inner)  # A jit static argument.


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update({"stepz": 1}),
     "config.o has unknown field stepz; valid fields: inner, parts, steps."),
    (lambda c: c.inner.update({"rat": 1, "nam": 2}),
     "config.o.inner has unknown fields nam, rat; valid fields: names, rate."),
    (lambda c: c.update({"steps": -1}), "config.o.steps=-1: expected an integer >= 0."),
    (lambda c: c.update({"steps": True}), "config.o.steps=True: expected an integer."),
    (lambda c: c.inner.update({"rate": 2.0}), "config.o.inner.rate=2.0: expected a number "
                                              "in [0, 1]."),
    (lambda c: c.inner.update({"names": "ab"}), "config.o.inner.names='ab': expected a tuple."),
    (lambda c: c.parts.update({"z": {"flag": True}}), "config.o.parts.z lacks the field size."),
    (lambda c: c.update({"copy": 2}), "config.o.copy is set from config.other.copy; set that "
                                      "instead"),
])
def test_bad_values_name_their_full_path(edit, message):
  c = to_config_dict(Outer()).to_dict()
  edit(DictSections(c))
  with pytest.raises(ConfigError) as e:
    from_config_dict(Outer, c, "config.o")
  assert message in str(e.value), str(e.value)


def test_a_bad_derived_value_names_the_knob_that_owns_it():
  with pytest.raises(ConfigError, match=r"^config.other.copy=0: expected a positive integer"):
    from_config_dict(Outer, {}, "config.o", copy=0)


def test_a_built_section_passes_through():
  built = Outer()
  assert from_config_dict(Outer, built, "config.o") is built
  assert from_config_dict(Outer, built, "config.o", copy=5).copy == 5


