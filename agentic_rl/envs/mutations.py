"""Single-node source mutations of a Python function: the bug families and their inverses.

A mutation changes one AST node of a function and so exactly one source line
(sources are kept in `ast.unparse` form). The task generator draws one
mutation of a chosen family to inject a bug; the scripted expert enumerates
every mutation in a wider search space (all operators, all comparisons, all
names, constants over a range, +-1 added or removed anywhere) to find a
repair, much as a programmer tries the usual suspects. The families are
closed under inversion, so every injected bug has a repair in that space.

Families: wrong_constant, swapped_operator, off_by_one, wrong_variable_returned,
wrong_comparison.
"""

from __future__ import annotations

import ast
import dataclasses
import threading
from collections.abc import Iterator

# CPython 3.11 keeps the AST converter's recursion depth per interpreter, not per thread, so
# ast.parse / literal_eval from concurrent threads can fail with "SystemError: AST constructor
# recursion depth mismatch" (python/cpython gh-106905). Envs and generators run on host
# threads, so every AST conversion in agentic_rl.envs holds this lock.
AST_LOCK = threading.RLock()


def parse(source: str) -> ast.Module:
  with AST_LOCK:
    return ast.parse(source)


def literal_eval(node_or_source):
  with AST_LOCK:
    return ast.literal_eval(node_or_source)

ARITH_OPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)
CMP_OPS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Eq, ast.NotEq)
BOOL_OPS = (ast.And, ast.Or)
# The swaps a programmer typically makes, used when injecting bugs.
NATURAL_ARITH = {ast.Add: (ast.Sub, ast.Mult), ast.Sub: (ast.Add,),
                 ast.Mult: (ast.Add, ast.FloorDiv),
                 ast.FloorDiv: (ast.Mod, ast.Mult), ast.Mod: (ast.FloorDiv,)}
NATURAL_CMP = {ast.Lt: (ast.LtE, ast.Gt), ast.LtE: (ast.Lt, ast.GtE), ast.Gt: (ast.GtE, ast.Lt),
               ast.GtE: (ast.Gt, ast.LtE), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,)}
GENERATOR_CONSTANTS = range(0, 21)
EXPERT_CONSTANTS = range(-3, 41)


@dataclasses.dataclass(frozen=True)
class Mutation:
  family: str
  node_index: int  # Index of the node in ast.walk order of the function.
  action: tuple  # Family-specific: ("const", v) | ("op", OpClass) | ("cmp", i, OpClass) | ...


def canonical(source: str) -> str:
  """The ast.unparse form of a source (what generated modules are written in)."""
  return ast.unparse(parse(source))


def _nodes(fn: ast.FunctionDef) -> list[ast.AST]:
  return list(ast.walk(fn))


def _names(fn: ast.FunctionDef) -> list[str]:
  names = [a.arg for a in fn.args.args]
  for n in ast.walk(fn):
    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id not in names:
      names.append(n.id)
  return names


def _is_int(n: ast.AST) -> bool:
  return isinstance(n, ast.Constant) and type(n.value) is int


def _bound_positions(fn: ast.FunctionDef) -> set[int]:
  """ids of expressions in range() arguments, slice bounds and comparison operands."""
  out = set()
  for n in ast.walk(fn):
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "range":
      out.update(id(a) for a in n.args)
    elif isinstance(n, ast.Slice):
      out.update(id(a) for a in (n.lower, n.upper) if a is not None)
    elif isinstance(n, ast.Compare):
      out.update(id(a) for a in [n.left, *n.comparators])
  return out


def _is_plus_minus_one(n: ast.AST) -> bool:
  return (isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)) and _is_int(n.right)
          and n.right.value == 1)


def enumerate_mutations(fn: ast.FunctionDef, *, expert: bool) -> Iterator[Mutation]:
  """Every single-node mutation; generator-natural ones when expert=False."""
  consts = EXPERT_CONSTANTS if expert else GENERATOR_CONSTANTS
  names = _names(fn)
  bounds = _bound_positions(fn)
  params_nodes = {id(n) for n in ast.walk(fn.args)}
  for i, n in enumerate(_nodes(fn)):
    if id(n) in params_nodes:
      continue
    if _is_int(n):
      v = n.value
      for w in consts:
        if w != v and abs(w - v) != 1:
          yield Mutation("wrong_constant", i, ("const", w))
      for w in (v - 1, v + 1):
        if expert or w >= 0:
          yield Mutation("off_by_one", i, ("const", w))
    if isinstance(n, (ast.BinOp, ast.AugAssign)) and isinstance(n.op, ARITH_OPS):
      alts = ARITH_OPS if expert else NATURAL_ARITH[type(n.op)]
      for op in alts:
        if op is not type(n.op):
          yield Mutation("swapped_operator", i, ("op", op))
    if isinstance(n, ast.BoolOp):
      other = ast.Or if isinstance(n.op, ast.And) else ast.And
      yield Mutation("swapped_operator", i, ("boolop", other))
    if isinstance(n, ast.Compare):
      for j, op in enumerate(n.ops):
        if isinstance(op, CMP_OPS):
          alts = CMP_OPS if expert else NATURAL_CMP[type(op)]
          for new in alts:
            if new is not type(op):
              yield Mutation("wrong_comparison", i, ("cmp", j, new))
    if isinstance(n, ast.Return) and isinstance(n.value, ast.Name):
      for name in names:
        if name != n.value.id:
          yield Mutation("wrong_variable_returned", i, ("name", name))
    if isinstance(n, ast.expr) and not isinstance(getattr(n, "ctx", None), ast.Store):
      if _is_plus_minus_one(n):
        yield Mutation("off_by_one", i, ("unwrap",))
      elif (id(n) in bounds or expert) and not _is_int(n) and isinstance(
          n, (ast.Name, ast.Call, ast.BinOp, ast.Subscript)):
        yield Mutation("off_by_one", i, ("wrap", ast.Add))
        yield Mutation("off_by_one", i, ("wrap", ast.Sub))


def _replace_child(parent: ast.AST, old: ast.AST, new: ast.AST) -> None:
  for field, value in ast.iter_fields(parent):
    if value is old:
      setattr(parent, field, new)
      return
    if isinstance(value, list):
      for k, item in enumerate(value):
        if item is old:
          value[k] = new
          return
  raise ValueError("node not found under its parent")


def _mutate_in_place(nodes: list[ast.AST], parents: dict[int, ast.AST], m: Mutation):
  """Applies `m` to the tree `nodes` came from; returns a function that undoes it."""
  n = nodes[m.node_index]
  kind = m.action[0]
  if kind == "const":
    old = n.value
    n.value = m.action[1]
    return lambda: setattr(n, "value", old)
  if kind in ("op", "boolop"):
    old = n.op
    n.op = m.action[1]()
    return lambda: setattr(n, "op", old)
  if kind == "cmp":
    j, old = m.action[1], n.ops[m.action[1]]
    n.ops[j] = m.action[2]()
    return lambda: n.ops.__setitem__(j, old)
  if kind == "name":
    old = n.value
    n.value = ast.Name(id=m.action[1], ctx=ast.Load())
    return lambda: setattr(n, "value", old)
  if kind in ("wrap", "unwrap"):
    parent = parents[id(n)]
    new = (ast.BinOp(left=n, op=m.action[1](), right=ast.Constant(1)) if kind == "wrap"
           else n.left)
    _replace_child(parent, n, new)
    return lambda: _replace_child(parent, new, n)
  raise ValueError(f"unknown mutation action {m.action!r}")


def _parents(fn: ast.AST) -> dict[int, ast.AST]:
  return {id(c): p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}


def one_line_change(before: str, after: str) -> tuple[int, str, str] | None:
  """(0-based line, old, new) when the sources differ in exactly one line, else None."""
  a, b = before.split("\n"), after.split("\n")
  if len(a) != len(b):
    return None
  diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
  if len(diff) != 1:
    return None
  return diff[0], a[diff[0]], b[diff[0]]


def mutated_code(fn_source: str, *, expert: bool) -> list:
  """A compiled module defining the function, for every mutation in mutated_sources' search
  space, compiled from the mutated tree: no unparse and re-parse per mutation, several
  times faster. Without mutated_sources' filters: a duplicate only costs time, and a
  mutation that changes no line is the function itself."""
  out = []
  with AST_LOCK:  # compile() of a tree is a C-level AST conversion too.
    module = ast.parse(fn_source)
    fn = module.body[0]
    nodes, parents = _nodes(fn), _parents(fn)
    for m in list(enumerate_mutations(fn, expert=expert)):
      target = nodes[m.node_index]
      undo = _mutate_in_place(nodes, parents, m)
      try:  # New nodes take their place's location: only the parent's subtree is walked.
        ast.fix_missing_locations(parents.get(id(target), target))
        out.append(compile(module, "<mutant>", "exec"))
      except (SyntaxError, ValueError, TypeError):
        continue
      finally:
        undo()
  return out


def mutated_sources(fn_source: str, *, expert: bool, family: str | None = None
                    ) -> Iterator[tuple[Mutation, int, str, str]]:
  """(mutation, line, old line, new line) for every one-line mutation of a canonical function."""
  fn = parse(fn_source).body[0]  # The only C-level AST conversion here (see AST_LOCK).
  nodes, parents = _nodes(fn), _parents(fn)
  seen = set()
  for m in list(enumerate_mutations(fn, expert=expert)):
    if family is not None and m.family != family:
      continue
    undo = _mutate_in_place(nodes, parents, m)  # Unparsed, then undone: no copies.
    try:
      new_source = ast.unparse(fn)
    finally:
      undo()
    change = one_line_change(fn_source, new_source)
    if change is None or (change[0], change[2]) in seen:
      continue
    seen.add((change[0], change[2]))
    yield (m, *change)
