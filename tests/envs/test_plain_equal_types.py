"""plain_equal judges by type all the way down: dict keys and the sign of zero too.

Before, {True: x} equalled {1: x} and {1.0: x} (dict lookup merges equal keys), and
-0.0 equalled 0.0. A decoded reply's dict is a PlainDict, indexed by typed keys, so a
reply cannot merge keys either.
"""

import json

import pytest

from agentic_rl.envs.grading import PlainDict, plain_equal, typed_key
from agentic_rl.envs.sandbox_server import decode_plain, encode_plain


@pytest.mark.parametrize("got,want", [
    ({True: "x"}, {1: "x"}), ({1: "x"}, {True: "x"}), ({1.0: "x"}, {1: "x"}),
    ({1: "x"}, {1.0: "x"}), ({False: 0}, {0: 0}), ({0.0: 0}, {-0.0: 0}),
    ({(1, True): 0}, {(1, 1): 0}), ({"a": {True: 1}}, {"a": {1: 1}}),
    (-0.0, 0.0), (0.0, -0.0), ([-0.0], [0.0]), ((1, -0.0), (1, 0.0)), ({"k": -0.0}, {"k": 0.0}),
    (1.0, 1), (True, 1), (1, True), (b"a", "a"),
])
def test_type_twins_and_signed_zeros_are_not_equal(got, want):
  assert not plain_equal(got, want)


@pytest.mark.parametrize("value", [
    {True: "x"}, {1: "x", 1.5: [1, 2]}, {(1, "a"): None, b"k": (0.0,)}, {-0.0: 1},
    {"a": {False: {}}}, [{}, {None: -0.0}], float("nan"), {float("inf"): 1},
])
def test_equal_plain_values_are_equal(value):
  assert plain_equal(value, value)


def _through_a_reply(value):
  return decode_plain(json.loads(json.dumps(encode_plain(value, 4096))), 4096, PlainDict)


@pytest.mark.parametrize("got,want,equal", [
    ({True: "x"}, {True: "x"}, True), ({True: "x"}, {1: "x"}, False),
    ({1: "x", 2: "y"}, {2: "y", 1: "x"}, True), ({1.0: 2}, {1: 2}, False),
    ({-0.0: 1}, {0.0: 1}, False), ({"a": [{False: 1}]}, {"a": [{False: 1}]}, True),
    ({"a": [{False: 1}]}, {"a": [{0: 1}]}, False),
])
def test_decoded_dicts_compare_by_typed_keys(got, want, equal):
  decoded = _through_a_reply(got)
  assert plain_equal(decoded, want) is equal


def test_a_reply_cannot_merge_keys_that_python_would():
  # Two entries whose keys Python's dict would merge (1 and True): a dict of two entries
  # is not the one-entry expected value, whichever entry would have won.
  tagged = ["D", [[["I", "1"], ["S", "x"]], [["B", True], ["S", "x"]]]]
  decoded = decode_plain(tagged, 4096, PlainDict)
  assert len(decoded) == 2
  assert not plain_equal(decoded, {1: "x"}) and not plain_equal(decoded, {True: "x"})
  # The same key twice (which no real dict encodes) is not equal either.
  twice = decode_plain(["D", [[["I", "1"], ["S", "x"]], [["I", "1"], ["S", "x"]]]], 4096,
                       PlainDict)
  assert not plain_equal(twice, {1: "x"})


def test_typed_keys_by_hand():
  assert typed_key(1) == ("I", "1") and typed_key(True) == ("B", "1")
  assert typed_key(1.0) == ("F", "1.0") and typed_key(-0.0) == ("F", "-0.0")
  assert typed_key((1, "a")) == ("T", ("I", "1"), ("S", "a"))
  assert len({typed_key(k) for k in (1, 1.0, True, "1", b"1", (1,))}) == 6
  with pytest.raises(TypeError):
    typed_key([1])
