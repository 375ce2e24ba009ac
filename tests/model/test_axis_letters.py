"""One letter per axis (issue 29): the attention params' new names, the shipped base read
under them, and a lint that the suffixes of names agree with the einsum strings they meet.

Letters: b batch, t query time, s key/cache slot, d d_model, n query heads, k kv heads,
g query heads per kv head, h head_dim, c key blocks, j selected-block slot, l token in a
block, e experts, f FFN hidden, v vocab (agentic_rl/model/attention.py, agentic_rl/kernels/reference.py).
"""

from __future__ import annotations

import ast
import os
import pathlib
import re

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from agentic_rl import resources
from agentic_rl.model import config as model_config
from agentic_rl.model.transformer import Model
from agentic_rl.train import params_file
from configs import quickstart

ROOT = pathlib.Path(__file__).parents[2]
LINTED = ("agentic_rl/model/attention.py", "agentic_rl/kernels/reference.py", "agentic_rl/model/moe.py")
OLD_TO_NEW = {"w_q_dhk": "w_q_dnh", "w_k_dhk": "w_k_dkh", "w_v_dhk": "w_v_dkh",
              "w_o_hkd": "w_o_nhd", "w_gate_dh": "w_gate_dn", "b_gate_h": "b_gate_n"}


# --- Param names: a params file under the old names loads, mapped to the new ----------

def test_the_rename_table_is_the_documented_one():
  assert params_file.LEGACY_PARAM_NAMES == OLD_TO_NEW


def test_a_base_under_the_old_names_loads_under_the_new_names_with_its_values(tmp_path):
  # The shipped base, written back under the old names as bases saved before the rename
  # hold them (the shipped one has been rebuilt since).
  shipped = load_file(os.path.join(resources.resolve(quickstart.BASE), params_file.PARAMS_FILE))
  new_to_old = {new: old for old, new in OLD_TO_NEW.items()}
  old = {}
  for name, array in shipped.items():
    head, _, last = name.rpartition("/")
    old[f"{head}/{new_to_old.get(last, last)}"] = array
  assert any(n.rpartition("/")[2] in OLD_TO_NEW for n in old)
  base = tmp_path / "old_names"
  base.mkdir()
  save_file(old, str(base / params_file.PARAMS_FILE))
  model = Model(model_config.validate(quickstart.get_config().model))
  fresh = model.init(jax.random.key(0))
  fresh_names = set(params_file.flatten(fresh))
  assert "layer_0/attn/w_q_dnh" in fresh_names
  assert not any(n.rpartition("/")[2] in OLD_TO_NEW for n in fresh_names)

  loaded = params_file.flatten(params_file.load_params(str(base), fresh, "old-named base"))
  assert set(loaded) == fresh_names
  for name, array in old.items():
    head, _, last = name.rpartition("/")
    new = f"{head}/{OLD_TO_NEW.get(last, last)}"
    assert loaded[new].dtype == array.dtype and loaded[new].shape == array.shape, name
    np.testing.assert_array_equal(loaded[new], array, err_msg=name)
  np.testing.assert_array_equal(loaded["layer_0/attn/w_o_nhd"], old["layer_0/attn/w_o_hkd"])


def _attn_params():
  rng = np.random.default_rng(0)
  return {"attn": {"w_q_dnh": rng.normal(size=(4, 2, 3)).astype(np.float32),
                   "b_gate_n": rng.normal(size=(2,)).astype(np.float32)}}


def test_old_names_load_and_a_name_in_neither_form_is_an_error_naming_it(tmp_path):
  like = _attn_params()
  arrays = {"attn/w_q_dhk": like["attn"]["w_q_dnh"], "attn/b_gate_h": like["attn"]["b_gate_n"]}
  save_file(arrays, str(tmp_path / params_file.PARAMS_FILE))
  loaded = params_file.load_params(str(tmp_path), _attn_params())
  np.testing.assert_array_equal(loaded["attn"]["w_q_dnh"], arrays["attn/w_q_dhk"])

  arrays["attn/w_q_dhx"] = arrays.pop("attn/w_q_dhk")  # Neither old nor new.
  save_file(arrays, str(tmp_path / params_file.PARAMS_FILE))
  with pytest.raises(ValueError) as err:
    params_file.load_params(str(tmp_path), _attn_params(), "config.train.init_checkpoint")
  text = str(err.value)
  assert "unexpected 1: ['attn/w_q_dhx']" in text
  assert "missing 1: ['attn/w_q_dnh']" in text


def test_an_old_name_that_does_not_fit_is_reported_under_the_files_name(tmp_path):
  arrays = {"attn/w_q_dhk": np.zeros((4, 2, 5), np.float32),  # another head_dim
            "attn/b_gate_h": np.zeros((2,), np.float32)}
  save_file(arrays, str(tmp_path / params_file.PARAMS_FILE))
  with pytest.raises(ValueError, match=re.escape(
      "attn/w_q_dhk (as attn/w_q_dnh): file (4, 2, 5) float32, model (4, 2, 3) float32")):
    params_file.load_params(str(tmp_path), _attn_params())


def test_a_file_with_both_the_old_and_the_new_name_is_an_error(tmp_path):
  like = _attn_params()
  arrays = {"attn/w_q_dhk": like["attn"]["w_q_dnh"], "attn/w_q_dnh": like["attn"]["w_q_dnh"],
            "attn/b_gate_n": like["attn"]["b_gate_n"]}
  save_file(arrays, str(tmp_path / params_file.PARAMS_FILE))
  with pytest.raises(ValueError, match="holds both 'attn/w_q_dhk' and 'attn/w_q_dnh'"):
    params_file.load_params(str(tmp_path), like)


# --- Lint: a name's suffix letters are the einsum subscripts it meets ---------------------

_SUFFIX = re.compile(r"_([a-z]{2,})$")


def _suffix(node):
  """The shape suffix of an operand (`q_btnh`, or `q_btnh.astype(...)`), or None."""
  if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
      and node.func.attr == "astype"):
    node = node.func.value
  if isinstance(node, ast.Name):
    match = _SUFFIX.search(node.id)
    return (node.id, match.group(1)) if match else None
  return None


def _is_einsum(node):
  return isinstance(node, ast.Call) and (
      (isinstance(node.func, ast.Attribute) and node.func.attr == "einsum")
      or (isinstance(node.func, ast.Name) and node.func.id == "einsum"))


def einsum_letter_problems(source: str, filename: str = "<source>") -> tuple[list[str], int]:
  """(disagreements, names checked) between shape-suffixed names and the einsum strings
  they meet: each operand's subscripts must equal its suffix, and a suffixed name assigned
  an einsum (alone, or as the left of an arithmetic op) must carry its output letters."""
  problems, checked = [], 0
  tree = ast.parse(source, filename)
  outputs = {}  # id(einsum call) -> the suffixed name it is assigned to
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      value = node.value.left if isinstance(node.value, ast.BinOp) else node.value
      if _is_einsum(value) and _suffix(node.targets[0]):
        outputs[id(value)] = _suffix(node.targets[0])
  for node in ast.walk(tree):
    if not (_is_einsum(node) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
      continue
    spec = node.args[0].value.replace(" ", "")
    inputs, _, output = spec.partition("->")
    where = f"{filename}:{node.lineno} einsum({spec!r})"
    for letters, operand in zip(inputs.split(","), node.args[1:]):
      named = _suffix(operand)
      if named:
        checked += 1
        if named[1] != letters:
          problems.append(f"{where}: operand {named[0]} has letters {named[1]!r}, "
                          f"the string says {letters!r}")
    if id(node) in outputs:
      checked += 1
      name, letters = outputs[id(node)]
      if letters != output:
        problems.append(f"{where}: assigned to {name} (letters {letters!r}), the string "
                        f"gives {output!r}")
  return problems, checked


@pytest.mark.parametrize("relpath", LINTED)
def test_einsum_strings_use_the_letters_of_their_operands(relpath):
  problems, checked = einsum_letter_problems((ROOT / relpath).read_text(), relpath)
  assert not problems, "\n".join(problems)
  assert checked >= 5, f"{relpath}: only {checked} suffixed names met an einsum"


def test_the_lint_catches_a_letter_that_means_two_axes():
  wrong = ('q_bthk = jnp.einsum("btd,dhk->bthk", x_btd, w_q_dnh)\n'
           'y_btd = jnp.einsum("btnh,nhd->btd", o_btnh.astype(dtype), w_o_nhd)\n')
  problems, checked = einsum_letter_problems(wrong)
  assert checked == 6
  assert len(problems) == 1 and "w_q_dnh has letters 'dnh'" in problems[0], problems
