"""The package layering, read from the import statements: what each layer may import."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[1]


def _imports(path: pathlib.Path) -> set[str]:
  """Every module a file imports, at any depth (lazy imports inside functions count)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return names


def _package_imports(package: str) -> dict[str, set[str]]:
  folder = ROOT.joinpath(*package.split("."))
  return {str(p.relative_to(ROOT)): _imports(p) for p in sorted(folder.glob("*.py"))}


@pytest.mark.parametrize("package,forbidden", [
    ("agentic_rl.rollout", ("agentic_rl.rl", "agentic_rl.train")),
    ("agentic_rl.records", ("agentic_rl.rl", "agentic_rl.rollout", "agentic_rl.train",
                            "agentic_rl.envs")),
    ("agentic_rl.rl", ("agentic_rl.rollout", "agentic_rl.train")),
    ("agentic_rl.model", ("agentic_rl.rl", "agentic_rl.rollout", "agentic_rl.train",
                          "agentic_rl.envs")),
    ("agentic_rl.envs", ("agentic_rl.rl", "agentic_rl.rollout", "agentic_rl.train",
                         "agentic_rl.model")),
    # The mesh and sharding sit beside the model: neither the learner nor rollout.
    ("agentic_rl.parallel", ("agentic_rl.rl", "agentic_rl.rollout", "agentic_rl.train",
                             "agentic_rl.envs")),
    # Checkpoint interop writes the model and tokenizer sections; it trains and rolls out
    # nothing.
    ("agentic_rl.interop", ("agentic_rl.rl", "agentic_rl.rollout.engine", "agentic_rl.train",
                            "agentic_rl.envs")),
    # The kernels sit below the model: they import no other part of the package.
    ("agentic_rl.kernels", tuple(f"agentic_rl.{m}" for m in
                                 ("model", "rl", "rollout", "train", "envs", "records"))),
])
def test_a_layer_imports_nothing_above_it(package, forbidden):
  bad = {f: sorted(m for m in mods if m.startswith(forbidden))
         for f, mods in _package_imports(package).items()}
  assert not {f: m for f, m in bad.items() if m}


def test_the_kernels_import_no_circle():
  mods = _package_imports("agentic_rl.kernels")
  pallas_ops, dispatch = mods["agentic_rl/kernels/pallas_ops.py"], mods["agentic_rl/kernels/dispatch.py"]
  assert not any(m.startswith("agentic_rl.kernels.dispatch") for m in pallas_ops)
  assert "agentic_rl.kernels.ops" in pallas_ops | dispatch


@pytest.mark.parametrize("package", ["agentic_rl.rollout", "agentic_rl.records", "agentic_rl.rl",
                                     "agentic_rl.train"])
def test_only_the_model_reads_layer_letters(package):
  """Consumers ask the model what each layer records (ModelSpec.replay_keys)."""
  folder = ROOT.joinpath(*package.split("."))
  for path in folder.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Compare):
        consts = [c.value for c in [node.left, *node.comparators]
                  if isinstance(c, ast.Constant)]
        assert not set(consts) & {"S", "G", "F"}, f"{path.name}:{node.lineno}"
