"""The env config section (`config.env`): every SWE tool-environment option, checked once.

`EnvSpec` holds the difficulty tiers, the time budget, the sandbox limits and isolation
level, the output bounds, the tool allowlists and the seed ranges of the splits, with their
defaults and checks. `default_env_config()` is the ConfigDict config files edit;
`validate_env_config` builds the spec from it once per run (a bad value is a `ValueError`
naming `config.env.<field>`), and envs, sandboxes and task sources take the built spec.
The turn budget is `config.rollout.max_turns` (`EnvSpec.max_turns`, joined by the run).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from agentic_rl.config_schema import check, derived, from_config_dict, one_of, to_config_dict

ISOLATION_LEVELS = ("auto", "bubblewrap", "fallback")
PER_CALL_NAMESPACES = ("auto", "off")
MEMORY_CGROUP_MODES = ("auto", "best_effort", "off")
BUDGET_END_REWARDS = ("zero", "measured")
# How a measured test outcome becomes reward (agentic_rl/envs/swe_env.py: episode_reward).
REWARDS = ("repaired_fraction", "tests_fraction", "outcome")
# How the agent writes a tool call: the toy's grammar (agentic_rl/envs/tool_call.py) or a
# model's native JSON calls (agentic_rl/envs/json_tool_call.py: Qwen3 / Hermes).
TOOL_FORMATS = ("grammar", "json")
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


def _int_in(field: str, value: int, lo: int, hi: int | None = None) -> None:
  check(lo <= value and (hi is None or value <= hi), field, value,
        f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]")


@dataclasses.dataclass(frozen=True)
class TierSpec:
  num_functions: int  # Tested functions in the module.
  num_bugs: int  # Each in a different tested function.
  num_distractors: int  # Untested, correct functions: more code to read.
  cases_per_function: int  # Visible test cases (subtests) per function.
  allowlist: tuple[str, ...]  # Tools a task of this tier may call.
  # Hidden cases per tested function: what submit and the reward grade (fewer where the
  # function's case pool, less its visible arguments, is smaller).
  hidden_cases_per_function: int = 4

  def __post_init__(self):
    _int_in("num_functions", self.num_functions, 1, 40)
    _int_in("num_bugs", self.num_bugs, 1, self.num_functions)
    _int_in("num_distractors", self.num_distractors, 0, 40)
    _int_in("cases_per_function", self.cases_per_function, 1, 20)
    _int_in("hidden_cases_per_function", self.hidden_cases_per_function, 1, 20)
    unknown = [x for x in self.allowlist if x not in ALL_TOOLS]
    check(not unknown, "allowlist", self.allowlist,
          f"tools among {ALL_TOOLS} (unknown: {unknown})")
    for required in REQUIRED_TOOLS:
      check(required in self.allowlist, "allowlist", self.allowlist,
            f"a list that includes {required!r}")


@dataclasses.dataclass(frozen=True)
class SandboxSpec:
  isolation: str = "auto"  # bubblewrap when it works here, else fallback.
  timeout_s: float = 5.0  # Wall clock per command; the whole process tree is killed.
  cpu_s: int = 5  # RLIMIT_CPU per process.
  memory_mb: int = 512  # Per process: RLIMIT_AS plus what /tmp and /dev/shm may hold.
  # All the sandbox's processes together, with every page they hold (tmpfs, memfd, pipes):
  # a memory cgroup per sandbox where the host can make them ("auto"), else no total bound.
  total_memory_mb: int = 1024
  # "auto": where the host can make memory cgroups, a sandbox whose own cannot be made
  # fails to start (IsolationUnavailable), rather than run unbounded beside bounded ones;
  # "best_effort": it runs without, and its missing_guarantees say so; "off": none.
  memory_cgroup: str = "auto"
  tmpfs_mb: int = 32  # Size of the sandbox's /tmp (a tmpfs under bubblewrap) ...
  shm_mb: int = 8  # ... and of /dev/shm; both are taken off RLIMIT_AS.
  disk_quota_mb: int = 16  # Per episode: bytes the workspace may hold in total ...
  max_files: int = 2048  # ... and files plus directories (a tmpfs per workspace; root).
  # A graded run's reply may take what an honest reply to its n calls takes,
  # sandbox_server.reply_limit: 512 + 12 * (300 + 3 * 80) + n * (max(max_value_chars,
  # 12 * 3 * 80) + 64) bytes = 6,992 + 4,160 n at the defaults (the hard tier's 24 hidden
  # cases: 106,832), and never more than this; a larger reply fails the run unread.
  max_reply_bytes: int = 262_144
  max_value_chars: int = 4096  # One returned value's JSON size; larger never matches.
  file_size_mb: int = 8  # RLIMIT_FSIZE.
  max_processes: int = 32  # RLIMIT_NPROC (enforced through a per-sandbox uid).
  max_open_files: int = 64  # RLIMIT_NOFILE.
  capture_bytes: int = 65_536  # Head + tail of each stream kept from a command.
  output_kill_bytes: int = 4_194_304  # A command writing more is killed.
  uid_base: int = 200_000  # When run as root, each sandbox runs as its own uid ...
  uid_count: int = 4096  # ... drawn from [uid_base, uid_base + uid_count).
  python: str = "auto"  # Interpreter inside the sandbox; "auto" picks one it can run.
  # Each call in fresh user/pid/mount/IPC namespaces when the kernel allows ("auto"), or
  # never ("off": leftovers are then found by uid; for kernels that refuse, and for tests).
  per_call_namespaces: str = "auto"
  workspace_root: str = ""  # Parent of the per-episode workspaces; "" = system temp.

  def __post_init__(self):
    one_of(self.isolation, "isolation", ISOLATION_LEVELS)
    check(self.timeout_s > 0, "timeout_s", self.timeout_s, "a number > 0")
    _int_in("cpu_s", self.cpu_s, 1)
    _int_in("memory_mb", self.memory_mb, 32)
    _int_in("file_size_mb", self.file_size_mb, 1)
    _int_in("total_memory_mb", self.total_memory_mb, self.memory_mb)
    one_of(self.memory_cgroup, "memory_cgroup", MEMORY_CGROUP_MODES)
    _int_in("tmpfs_mb", self.tmpfs_mb, 1)
    _int_in("shm_mb", self.shm_mb, 1)
    check(self.tmpfs_mb + self.shm_mb <= self.memory_mb - 64, "tmpfs_mb", self.tmpfs_mb,
          f"tmpfs_mb + shm_mb (= {self.tmpfs_mb + self.shm_mb}) <= memory_mb - 64 "
          f"(= {self.memory_mb - 64}): they come out of the memory budget")
    _int_in("disk_quota_mb", self.disk_quota_mb, self.file_size_mb, 1 << 20)
    _int_in("max_files", self.max_files, 16, 1 << 24)
    _int_in("max_reply_bytes", self.max_reply_bytes, 4096)
    _int_in("max_value_chars", self.max_value_chars, 64)
    _int_in("max_processes", self.max_processes, 2, 100_000)
    _int_in("max_open_files", self.max_open_files, 16)
    _int_in("capture_bytes", self.capture_bytes, 1024)
    _int_in("output_kill_bytes", self.output_kill_bytes, self.capture_bytes)
    _int_in("uid_base", self.uid_base, 1000, 2**31 - 1)
    _int_in("uid_count", self.uid_count, 1, 2**31 - 1 - self.uid_base)
    one_of(self.per_call_namespaces, "per_call_namespaces", PER_CALL_NAMESPACES)
    check(bool(self.python), "python", self.python,
          '"auto" or the path of a python3 interpreter')


@dataclasses.dataclass(frozen=True)
class SplitsSpec:
  train_seed_start: int = 0
  train_size: int = 1_000_000
  heldout_seed_start: int = 1_000_000_000
  heldout_size: int = 10_000

  def __post_init__(self):
    _int_in("train_seed_start", self.train_seed_start, 0)
    _int_in("heldout_seed_start", self.heldout_seed_start, 0)
    _int_in("train_size", self.train_size, 1)
    _int_in("heldout_size", self.heldout_size, 1)
    train = (self.train_seed_start, self.train_seed_start + self.train_size)
    held = (self.heldout_seed_start, self.heldout_seed_start + self.heldout_size)
    check(not (train[0] < held[1] and held[0] < train[1]), "heldout_seed_start",
          self.heldout_seed_start, f"held-out seeds [{held[0]}, {held[1]}) disjoint from "
          f"the train seeds [{train[0]}, {train[1]})")


def _default_tiers() -> dict[str, TierSpec]:
  return {
      # One function with one bug: the curriculum's first rung (the quickstart trains on it).
      "tiny": TierSpec(1, 1, 0, 2, _BASE_TOOLS),
      "easy": TierSpec(3, 1, 0, 3, _BASE_TOOLS),
      "medium": TierSpec(4, 2, 2, 3, _BASE_TOOLS + ("python",)),
      "hard": TierSpec(6, 3, 3, 4, _BASE_TOOLS + ("python",)),
  }


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """The SWE env's options: sized for a tiny CPU model (easy trajectories ~1-2K bytes)."""

  name: str = "swe"  # The env's registry name (agentic_rl/envs/registry.py).
  tiers: dict[str, TierSpec] = dataclasses.field(default_factory=_default_tiers)
  default_tier: str = "easy"
  bug_families: tuple[str, ...] = BUG_FAMILIES
  max_turns: int = derived(20, "config.rollout.max_turns")  # Every step() is one turn.
  time_budget_s: float = 300.0  # Wall-clock budget from reset(), model time included.
  # repaired_fraction: max(0, passing now - passing at the start) / failing at the start,
  # so tests the untouched repo already passed earn nothing and "ls, test, submit" earns 0;
  # tests_fraction: passing / total (gives that partial credit); outcome: 1 if all pass.
  reward: str = "repaired_fraction"
  # Reward when a budget ends an unsubmitted episode: zero, or `reward` on the tests then.
  budget_end_reward: str = "zero"
  # Re-measure the hidden tests after each replace, so the process signal lands on the edit
  # that earned it. A run joins it: on only when its advantage estimator reads process
  # signals (turn_level, gae); otherwise the hidden runs would cost time nothing reads.
  process_signal_on_edit: bool = derived(
      True, "config.rl.advantage.estimator (on for turn_level and gae)")
  max_observation_chars: int = 1200  # Hard bound on every observation returned.
  tool_format: str = "grammar"  # One of TOOL_FORMATS.
  max_tool_call_chars: int = 4000  # Longer calls are refused before parsing arguments.
  max_body_chars: int = 3000  # Bound on the body of replace / python.
  max_path_chars: int = 120
  view_max_lines: int = 80  # Lines shown by one view call.
  max_file_bytes: int = 262_144  # view / replace refuse larger files.
  max_replace_lines: int = 60  # Lines one replace may write.
  audit_max_arg_chars: int = 200  # Arguments are truncated to this in the audit log.
  audit_fsync: bool = False  # Flush per line always; fsync per line on request.
  sandbox: SandboxSpec = SandboxSpec()
  splits: SplitsSpec = SplitsSpec()

  def __post_init__(self):
    check(bool(self.tiers), "tiers", self.tiers, "at least one tier")
    check(self.default_tier in self.tiers, "default_tier", self.default_tier,
          f"one of the tiers {sorted(self.tiers)}")
    check(bool(self.bug_families) and all(f in BUG_FAMILIES for f in self.bug_families),
          "bug_families", self.bug_families, f"a non-empty subset of {BUG_FAMILIES}")
    _int_in("max_turns", self.max_turns, 1, 10_000)
    check(self.time_budget_s > 0, "time_budget_s", self.time_budget_s, "a number > 0")
    one_of(self.reward, "reward", REWARDS)
    one_of(self.budget_end_reward, "budget_end_reward", BUDGET_END_REWARDS)
    one_of(self.tool_format, "tool_format", TOOL_FORMATS)
    _int_in("max_observation_chars", self.max_observation_chars, 200)
    _int_in("max_tool_call_chars", self.max_tool_call_chars, 16)
    _int_in("max_body_chars", self.max_body_chars, 1, self.max_tool_call_chars)
    _int_in("max_path_chars", self.max_path_chars, 1, 4096)
    _int_in("view_max_lines", self.view_max_lines, 1)
    _int_in("max_file_bytes", self.max_file_bytes, 1)
    _int_in("max_replace_lines", self.max_replace_lines, 1)
    _int_in("audit_max_arg_chars", self.audit_max_arg_chars, 8)

  def replace(self, **changes) -> "EnvSpec":
    return dataclasses.replace(self, **changes)


def default_env_config() -> ml_collections.ConfigDict:
  """The defaults, as the ConfigDict config files edit."""
  return to_config_dict(EnvSpec())


def validate_env_config(config=None, *, max_turns: int | None = None,
                        process_signal_on_edit: bool | None = None) -> EnvSpec:
  """The env spec from `config.env` (a ConfigDict, a dict or a built spec; None = the
  defaults), with the run's turn budget and per-edit measuring when given (a run joins
  both from its other sections). A built spec is returned as is."""
  joined = {} if max_turns is None else {"max_turns": max_turns}
  if process_signal_on_edit is not None:
    joined["process_signal_on_edit"] = bool(process_signal_on_edit)
  return from_config_dict(EnvSpec, EnvSpec() if config is None else config, "config.env",
                          **joined)
