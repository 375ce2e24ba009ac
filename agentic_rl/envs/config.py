"""The env config section: every tool-environment option, with validation.

`default_env_config()` returns one `ml_collections.ConfigDict` holding the
difficulty tiers, the turn and time budgets, the sandbox limits and isolation
level, the output bounds, the tool allowlists and the seed ranges of the
splits. `validate_env_config` turns a bad value into a `ValueError` that names
the field, the value and what was expected; envs, sandboxes and datasets call
it before doing anything.
"""

from __future__ import annotations

import ml_collections

ISOLATION_LEVELS = ("auto", "bubblewrap", "fallback")
PER_CALL_NAMESPACES = ("auto", "off")
BUDGET_END_REWARDS = ("zero", "measured")
# How a measured test outcome becomes reward (agentic_rl/envs/swe_env.py: episode_reward).
REWARDS = ("repaired_fraction", "tests_fraction", "outcome")
BUG_FAMILIES = (
    "wrong_constant",
    "swapped_operator",
    "off_by_one",
    "wrong_variable_returned",
    "wrong_comparison",
)
# Every tool the SWE env knows (agentic_rl/envs/tool_call.py holds their grammar).
ALL_TOOLS = ("ls", "view", "replace", "test", "python", "submit")
# submit must always be allowed: without it an episode can only end on a budget.
REQUIRED_TOOLS = ("submit",)

_BASE_TOOLS = ("ls", "view", "replace", "test", "submit")


def _tier(num_functions: int, num_bugs: int, num_distractors: int,
          cases_per_function: int, allowlist: tuple[str, ...],
          hidden_cases_per_function: int = 4) -> ml_collections.ConfigDict:
  t = ml_collections.ConfigDict()
  t.num_functions = num_functions  # Tested functions in the module.
  t.num_bugs = num_bugs  # Each in a different tested function.
  t.num_distractors = num_distractors  # Untested, correct functions: more code to read.
  t.cases_per_function = cases_per_function  # Visible test cases (subtests) per function.
  # Hidden cases per tested function: what submit and the reward grade (fewer where the
  # function's case pool, less its visible arguments, is smaller).
  t.hidden_cases_per_function = hidden_cases_per_function
  t.allowlist = allowlist  # Tools a task of this tier may call.
  return t


def default_env_config() -> ml_collections.ConfigDict:
  """Defaults sized for a tiny CPU model: easy trajectories are ~1-2K bytes."""
  c = ml_collections.ConfigDict()

  c.tiers = ml_collections.ConfigDict()
  # One function with one bug: the curriculum's first rung (the quickstart trains on it).
  c.tiers.tiny = _tier(1, 1, 0, 2, _BASE_TOOLS)
  c.tiers.easy = _tier(3, 1, 0, 3, _BASE_TOOLS)
  c.tiers.medium = _tier(4, 2, 2, 3, _BASE_TOOLS + ("python",))
  c.tiers.hard = _tier(6, 3, 3, 4, _BASE_TOOLS + ("python",))
  c.default_tier = "easy"
  c.bug_families = BUG_FAMILIES

  c.max_turns = 20  # Turn budget: every step() is one turn, malformed calls included.
  c.time_budget_s = 300.0  # Wall-clock budget from reset(), model time included.
  # repaired_fraction: max(0, passing now - passing at the start) / failing at the start,
  # so tests the untouched repo already passed earn nothing and "ls, test, submit" earns 0;
  # tests_fraction: passing / total (gives that partial credit); outcome: 1 if all pass.
  c.reward = "repaired_fraction"
  # Reward when a budget ends an unsubmitted episode: zero, or `reward` on the tests then.
  c.budget_end_reward = "zero"
  c.process_signal_on_edit = True  # Re-measure tests (hidden) after each replace.

  c.max_observation_chars = 1200  # Hard bound on every observation returned.
  c.max_tool_call_chars = 4000  # Longer calls are refused before parsing arguments.
  c.max_body_chars = 3000  # Bound on the body of replace / python.
  c.max_path_chars = 120
  c.view_max_lines = 80  # Lines shown by one view call.
  c.max_file_bytes = 262_144  # view / replace refuse larger files.
  c.max_replace_lines = 60  # Lines one replace may write.
  c.audit_max_arg_chars = 200  # Arguments are truncated to this in the audit log.
  c.audit_fsync = False  # Flush per line always; fsync per line on request.

  c.sandbox = ml_collections.ConfigDict()
  c.sandbox.isolation = "auto"  # bubblewrap when it works here, else fallback.
  c.sandbox.timeout_s = 5.0  # Wall clock per command; the whole process tree is killed.
  c.sandbox.cpu_s = 5  # RLIMIT_CPU per process.
  c.sandbox.memory_mb = 512  # Per process: RLIMIT_AS plus what /tmp and /dev/shm may hold.
  # All the sandbox's processes together, with every page they hold (tmpfs, memfd, pipes):
  # a memory cgroup per sandbox where the host can make them ("auto"), else no total bound.
  c.sandbox.total_memory_mb = 1024
  # "auto": where the host can make memory cgroups, a sandbox whose own cannot be made
  # fails to start (IsolationUnavailable), rather than run unbounded beside bounded ones;
  # "best_effort": it runs without, and its missing_guarantees say so; "off": none.
  c.sandbox.memory_cgroup = "auto"
  c.sandbox.tmpfs_mb = 32  # Size of the sandbox's /tmp (a tmpfs under bubblewrap) ...
  c.sandbox.shm_mb = 8  # ... and of /dev/shm; both are taken off RLIMIT_AS.
  c.sandbox.disk_quota_mb = 16  # Per episode: bytes the workspace may hold in total ...
  c.sandbox.max_files = 2048  # ... and files plus directories (a tmpfs per workspace; root).
  # A graded run's reply may take what an honest reply to its n calls takes,
  # sandbox_server.reply_limit: 512 + 12 * (300 + 3 * 80) + n * (max(max_value_chars,
  # 12 * 3 * 80) + 64) bytes = 6,992 + 4,160 n at the defaults (the hard tier's 24 hidden
  # cases: 106,832), and never more than this; a larger reply fails the run unread.
  c.sandbox.max_reply_bytes = 262_144
  c.sandbox.max_value_chars = 4096  # One returned value's JSON size; larger never matches.
  c.sandbox.file_size_mb = 8  # RLIMIT_FSIZE.
  c.sandbox.max_processes = 32  # RLIMIT_NPROC (enforced through a per-sandbox uid).
  c.sandbox.max_open_files = 64  # RLIMIT_NOFILE.
  c.sandbox.capture_bytes = 65_536  # Head + tail of each stream kept from a command.
  c.sandbox.output_kill_bytes = 4_194_304  # A command writing more is killed.
  c.sandbox.uid_base = 200_000  # When run as root, each sandbox runs as its own uid ...
  c.sandbox.uid_count = 4096  # ... drawn from [uid_base, uid_base + uid_count).
  c.sandbox.python = "auto"  # Interpreter inside the sandbox; "auto" picks one it can run.
  # Each call in fresh user/pid/mount/IPC namespaces when the kernel allows ("auto"), or
  # never ("off": leftovers are then found by uid; for kernels that refuse, and for tests).
  c.sandbox.per_call_namespaces = "auto"
  c.sandbox.workspace_root = ""  # Parent of the per-episode workspaces; "" = system temp.

  c.splits = ml_collections.ConfigDict()
  c.splits.train_seed_start = 0
  c.splits.train_size = 1_000_000
  c.splits.heldout_seed_start = 1_000_000_000
  c.splits.heldout_size = 10_000
  return c


def _fail(field: str, value, expected: str):
  raise ValueError(f"env config: {field} = {value!r} is invalid; expected {expected}")


def _check_int(c, field: str, lo: int, hi: int | None = None):
  v = c
  for part in field.split("."):
    v = v[part]
  if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
    rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    _fail(field, v, f"an int {rng}")


def _check_pos_float(c, field: str):
  v = c
  for part in field.split("."):
    v = v[part]
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
    _fail(field, v, "a number > 0")


def validate_env_config(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Raises ValueError naming the first bad field; returns `c` unchanged."""
  if not isinstance(c, ml_collections.ConfigDict):
    raise ValueError(f"env config must be an ml_collections.ConfigDict, got {type(c).__name__}")
  if "tiers" not in c or not c.tiers:
    _fail("tiers", c.get("tiers"), "at least one tier")
  for name, t in c.tiers.items():
    for f in ("num_functions", "num_bugs", "num_distractors", "cases_per_function",
              "hidden_cases_per_function", "allowlist"):
      if f not in t:
        _fail(f"tiers.{name}", sorted(t.keys()), f"a field {f!r}")
    _check_int(c, f"tiers.{name}.num_functions", 1, 40)
    _check_int(c, f"tiers.{name}.num_bugs", 1, t.num_functions)
    _check_int(c, f"tiers.{name}.num_distractors", 0, 40)
    _check_int(c, f"tiers.{name}.cases_per_function", 1, 20)
    _check_int(c, f"tiers.{name}.hidden_cases_per_function", 1, 20)
    allow = tuple(t.allowlist)
    unknown = [x for x in allow if x not in ALL_TOOLS]
    if unknown:
      _fail(f"tiers.{name}.allowlist", allow, f"tools among {ALL_TOOLS} (unknown: {unknown})")
    for req in REQUIRED_TOOLS:
      if req not in allow:
        _fail(f"tiers.{name}.allowlist", allow, f"a list that includes {req!r}")
  if c.default_tier not in c.tiers:
    _fail("default_tier", c.default_tier, f"one of the tiers {sorted(c.tiers.keys())}")
  fams = tuple(c.bug_families)
  if not fams or any(f not in BUG_FAMILIES for f in fams):
    _fail("bug_families", fams, f"a non-empty subset of {BUG_FAMILIES}")
  _check_int(c, "max_turns", 1, 10_000)
  _check_pos_float(c, "time_budget_s")
  if c.reward not in REWARDS:
    _fail("reward", c.reward, f"one of {REWARDS}")
  if c.budget_end_reward not in BUDGET_END_REWARDS:
    _fail("budget_end_reward", c.budget_end_reward, f"one of {BUDGET_END_REWARDS}")
  _check_int(c, "max_observation_chars", 200)
  _check_int(c, "max_tool_call_chars", 16)
  _check_int(c, "max_body_chars", 1)
  if c.max_body_chars > c.max_tool_call_chars:
    _fail("max_body_chars", c.max_body_chars, f"<= max_tool_call_chars ({c.max_tool_call_chars})")
  _check_int(c, "max_path_chars", 1, 4096)
  _check_int(c, "view_max_lines", 1)
  _check_int(c, "max_file_bytes", 1)
  _check_int(c, "max_replace_lines", 1)
  _check_int(c, "audit_max_arg_chars", 8)

  s = c.sandbox
  if s.isolation not in ISOLATION_LEVELS:
    _fail("sandbox.isolation", s.isolation, f"one of {ISOLATION_LEVELS}")
  _check_pos_float(c, "sandbox.timeout_s")
  _check_int(c, "sandbox.cpu_s", 1)
  _check_int(c, "sandbox.memory_mb", 32)
  _check_int(c, "sandbox.file_size_mb", 1)
  _check_int(c, "sandbox.total_memory_mb", s.memory_mb)
  if s.memory_cgroup not in ("auto", "best_effort", "off"):
    _fail("sandbox.memory_cgroup", s.memory_cgroup, "'auto', 'best_effort' or 'off'")
  _check_int(c, "sandbox.tmpfs_mb", 1)
  _check_int(c, "sandbox.shm_mb", 1)
  if s.tmpfs_mb + s.shm_mb > s.memory_mb - 64:
    _fail("sandbox.tmpfs_mb", s.tmpfs_mb,
          f"tmpfs_mb + shm_mb (= {s.tmpfs_mb + s.shm_mb}) <= memory_mb - 64 "
          f"(= {s.memory_mb - 64}): they come out of the memory budget")
  _check_int(c, "sandbox.disk_quota_mb", 1, 1 << 20)
  if s.disk_quota_mb < s.file_size_mb:
    _fail("sandbox.disk_quota_mb", s.disk_quota_mb, f">= file_size_mb ({s.file_size_mb})")
  _check_int(c, "sandbox.max_files", 16, 1 << 24)
  _check_int(c, "sandbox.max_reply_bytes", 4096)
  _check_int(c, "sandbox.max_value_chars", 64)
  _check_int(c, "sandbox.max_processes", 2, 100_000)
  _check_int(c, "sandbox.max_open_files", 16)
  _check_int(c, "sandbox.capture_bytes", 1024)
  _check_int(c, "sandbox.output_kill_bytes", s.capture_bytes)
  _check_int(c, "sandbox.uid_base", 1000, 2**31 - 1)
  _check_int(c, "sandbox.uid_count", 1, 2**31 - 1 - s.uid_base)
  if s.per_call_namespaces not in PER_CALL_NAMESPACES:
    _fail("sandbox.per_call_namespaces", s.per_call_namespaces,
          f"one of {PER_CALL_NAMESPACES}")
  if not isinstance(s.python, str) or not s.python:
    _fail("sandbox.python", s.python, '"auto" or the path of a python3 interpreter')
  if not isinstance(s.workspace_root, str):
    _fail("sandbox.workspace_root", s.workspace_root, 'a directory path or ""')

  sp = c.splits
  for f in ("train_seed_start", "heldout_seed_start"):
    _check_int(c, f"splits.{f}", 0)
  for f in ("train_size", "heldout_size"):
    _check_int(c, f"splits.{f}", 1)
  train = (sp.train_seed_start, sp.train_seed_start + sp.train_size)
  held = (sp.heldout_seed_start, sp.heldout_seed_start + sp.heldout_size)
  if train[0] < held[1] and held[0] < train[1]:
    raise ValueError(
        f"env config: splits overlap: train seeds [{train[0]}, {train[1]}) and held-out "
        f"seeds [{held[0]}, {held[1]}) must be disjoint")
  return c
