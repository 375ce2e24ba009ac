"""quantify/mismatch_report.py and mismatch_routes.py: figures by hand, routes, bad input;
launch.measure_mismatch end to end on the shipped base (slow)."""

import json
import os

import numpy as np
import pytest

from agentic_rl.quantify import mismatch_report as mr
from agentic_rl.quantify import mismatch_routes
from configs import quickstart
from tests.quantify.launch_command import run_launch


def test_token_stats_by_hand():
  log_r = np.log([1.0, 2.0, 0.25, 1.0])  # r = 1, 2, 1/4, 1
  s = mr.token_stats(log_r)
  assert s["num_tokens"] == 4
  assert s["k1"] == pytest.approx(-(np.log(2) + np.log(0.25)) / 4)
  # k3 = (r - 1) - log r: 0, 1 - log 2, -0.75 + log 4, 0.
  assert s["k3"] == pytest.approx(((1 - np.log(2)) + (-0.75 + np.log(4))) / 4)
  assert s["abs_logp_diff_max"] == pytest.approx(np.log(4))
  assert s["abs_logp_diff_mean"] == pytest.approx((np.log(2) + np.log(4)) / 4)
  assert s["abs_logp_diff_p50"] == pytest.approx(np.log(2) / 2)  # Between 0 and log 2.
  assert s["ratio_outside_frac"] == 0.25  # Only r = 1/4 lies outside [0.5, 2].
  assert mr.token_stats(np.zeros(0))["k3"] is None


def test_grouped_stats_and_agreement_by_layer_type():
  log_r = np.array([0.0, 0.1, -0.1, 0.2])
  g = mr.grouped_stats(log_r, np.array([0, 1, 1, 3]))
  assert list(g) == ["0", "1", "3"] and g["1"]["num_tokens"] == 2
  assert g["3"]["abs_logp_diff_max"] == pytest.approx(0.2)
  sums = {"layer/route_overlap": np.array([0, 6, 4, 9.0]),
          "layer/route_slots": np.array([0, 8, 4, 10.0]),
          "layer/block_overlap": np.array([0, 0, 0, 3.0]),
          "layer/block_used": np.array([0, 0, 0, 4.0])}
  out = mr.agreement_by_layer_type(sums, ("S", "S", "S", "G"))
  assert out == {"S": {"routing_agreement": 10 / 12},
                 "G": {"routing_agreement": 0.9, "block_agreement": 0.75}}


def test_routes_set_what_they_say():
  config = quickstart.get_config()
  a = mismatch_routes.route_config(config, "a")
  b = mismatch_routes.route_config(config, "b")
  assert a.model.layer_pattern == "SSSF" and config.model.layer_pattern == "SSSG"
  assert (a.model.cache_dtype, b.model.cache_dtype) == ("float32", "bfloat16")
  assert b.model.layer_pattern == "SSSG" and not b.rl.replay.blocks and b.rl.replay.routing
  one = {"bf16_cache": ("model", "cache_dtype", "bfloat16"),
         "no_routing_replay": ("rl.replay", "routing", False),
         "no_sampling_mask": ("rl.replay", "sampling_mask", False)}
  for name, (section, field, value) in one.items():
    c = mismatch_routes.route_config(config, name)
    node = c
    for s in section.split("."):
      node = node[s]
    assert node[field] == value, name
    assert c.model.layer_pattern == "SSSF", name  # Otherwise route A.
  sparse = mismatch_routes.route_config(config, "no_block_replay")
  assert sparse.model.layer_pattern == "SSSG" and not sparse.rl.replay.blocks
  assert set(a.train.allow_fingerprint_change) >= {"layer_pattern", "cache_dtype"}
  bf16 = {n: mismatch_routes.route_config(config, n) for n in mismatch_routes.ROUTES
          if n.startswith("bf16_compute")}
  assert all(c.model.dtype == "bfloat16" and c.model.cache_dtype == "float32"
             for c in bf16.values())
  assert not bf16["bf16_compute_no_routing_replay"].rl.replay.routing
  assert bf16["bf16_compute_sparse"].model.layer_pattern == "SSSG"
  assert not bf16["bf16_compute_no_block_replay"].rl.replay.blocks


def test_a_route_setting_a_field_the_config_lacks_is_an_error():
  from tests.train.tiny_config import tiny_config
  route = mismatch_routes._set(mismatch_routes._route_a, **{"rl.replay.experts": False})
  with pytest.raises(ValueError, match=r"override rl\.replay\.experts: the config has no field"):
    route(tiny_config())


def test_unknown_route_lists_the_valid_ones():
  with pytest.raises(ValueError, match=r"unknown route\(s\) \['c'\]; valid routes: a, b, "):
    mismatch_routes.parse_routes("a,c")
  with pytest.raises(ValueError, match="twice"):
    mismatch_routes.parse_routes("a,a")
  assert mismatch_routes.parse_routes("") == list(mismatch_routes.ROUTES)


def test_routes_that_differ_only_in_replay_share_a_sampler():
  config = quickstart.get_config()
  key = {n: mismatch_routes.sampler_key(mismatch_routes.route_config(config, n))
         for n in ("a", "no_routing_replay", "b", "b_block_replay", "b_no_routing_replay",
                   "bf16_cache")}
  assert key["a"] == key["no_routing_replay"] != key["b"]
  assert key["b"] == key["b_block_replay"] == key["b_no_routing_replay"]
  assert key["bf16_cache"] not in (key["a"], key["b"])


def _settings(**replay):
  out = {"layer_pattern": "SSSG", "cache_dtype": "bfloat16", "replay_routing": True,
         "replay_blocks": True, "replay_sampling_mask": True, "sampler_truncates": False}
  return {**out, **{f"replay_{k}": v for k, v in replay.items()}}


def test_paired_replay_by_hand():
  on_r = np.array([0.1, -0.2, 0.0, 0.3])
  off_r = np.array([0.1, -0.5, 0.0, 0.2])  # Tokens 1 and 3 changed: one up, one down.
  on = mr.RouteMeasurement("on", _settings(), {}, on_r, "k")
  off = mr.RouteMeasurement("off", _settings(routing=False), {}, off_r, "k")
  p = mr.paired_replay(on, off, "replay_routing")
  assert p["tokens_changed"] == 2 and p["unreplayed_larger_on_changed"] == 1
  k3 = lambda x: np.mean(np.exp(x) - 1 - x)
  assert p["k3_replayed_on_changed"] == pytest.approx(k3(np.array([-0.2, 0.3])))
  assert p["k3_unreplayed_on_changed"] == pytest.approx(k3(np.array([-0.5, 0.2])))
  assert p["k3_unreplayed"] == pytest.approx(k3(off_r))
  d = np.array([0.0, 0.3, 0.0, -0.1])
  half = 1.96 * d.std(ddof=1) / 2
  assert p["abs_log_r_increase_mean"] == pytest.approx(0.05)
  assert p["abs_log_r_increase_ci95"] == pytest.approx([0.05 - half, 0.05 + half])


def test_only_same_token_single_flag_pairs_are_compared():
  r = np.zeros(3)
  ms = [mr.RouteMeasurement("b", _settings(blocks=False), {}, r, "k"),
        mr.RouteMeasurement("b_block_replay", _settings(), {}, r, "k"),
        mr.RouteMeasurement("b_no_routing_replay", _settings(blocks=False, routing=False), {},
                            r, "k"),
        mr.RouteMeasurement("elsewhere", _settings(routing=False), {}, r, "other")]
  pairs = [(p["replayed"], p["unreplayed"], p["flag"]) for p in mr.replay_comparisons(ms)]
  # b_block_replay vs b_no_routing_replay differ in two flags; "elsewhere" has other tokens.
  assert pairs == [("b", "b_no_routing_replay", "replay_routing"),
                   ("b_block_replay", "b", "replay_blocks")]
  with pytest.raises(ValueError, match="share no tokens"):
    mr.paired_replay(ms[0], mr.RouteMeasurement("x", _settings(), {}, np.zeros(2), "k"),
                     "replay_blocks")


def test_a_checkpoint_of_another_layout_is_refused_naming_the_field(tmp_path):
  from tests.train.tiny_config import tiny_config
  config = tiny_config()
  config.model.layer_pattern = "SSSF"  # The shipped base is SSSG.
  with pytest.raises(ValueError, match=r"layer_pattern: saved 'SSSG', now 'SSSF'"):
    mr.check_checkpoint(config, quickstart.BASE)


@pytest.mark.slow  # ~4 min: three samplings, five learner compiles.
def test_measure_mismatch_on_the_shipped_base(tmp_path):
  out = str(tmp_path / "mm")
  names = ("a", "b", "b_no_routing_replay", "bf16_compute_sparse",
           "bf16_compute_no_block_replay")
  run = run_launch(
      "measure_mismatch", "--config", "tests/train/tiny_config_file.py",
      "--checkpoint", quickstart.BASE, "--workdir", out, "--num_tasks", "8",
      "--routes", ",".join(names), "--config.rollout.max_turns=6",
      "--config.rollout.max_new_tokens_per_turn=48", "--json", timeout=1800)
  assert run.returncode == 0, run.stderr[-3000:]
  summary = json.loads(run.stdout.strip().splitlines()[-1])
  routes = summary["routes"]
  a, b, free = routes["a"], routes["b"], routes["b_no_routing_replay"]
  for r in routes.values():
    for key in ("k1", "k3", "abs_logp_diff_p99", "routing_agreement", "by_turn",
                "by_position", "by_layer_type"):
      assert key in r
    assert r["num_tokens"] > 100
  # Route A (fp32 cache, dense) sits at float32 round-off; route B's bf16 cache does not.
  assert a["k3"] < 1e-10 < b["k3"] and a["abs_logp_diff_p99"] < b["abs_logp_diff_p99"]
  # Replayed choices agree by construction; the learner's own choices flip on some tokens.
  assert a["routing_agreement"] == b["routing_agreement"] == 1.0
  assert free["routing_agreement"] < 1.0 and b["block_agreement"] < 1.0
  # Routes that differ only in replay score one sampling's tokens, so their difference is
  # replay's alone: with bf16 compute, blocks the learner picks itself raise the mismatch.
  assert free["rollouts_of"] == "b" and free["num_tokens"] == b["num_tokens"]
  on, off = routes["bf16_compute_sparse"], routes["bf16_compute_no_block_replay"]
  assert off["rollouts_of"] == "bf16_compute_sparse" and off["block_agreement"] < 1.0
  assert off["k3"] > on["k3"]
  pairs = {(p["replayed"], p["unreplayed"]): p for p in summary["replay_pairs"]}
  assert set(pairs) == {("b", "b_no_routing_replay"),
                        ("bf16_compute_sparse", "bf16_compute_no_block_replay")}
  blocks = pairs[("bf16_compute_sparse", "bf16_compute_no_block_replay")]
  assert blocks["tokens_changed"] > 0
  assert blocks["k3_unreplayed_on_changed"] > blocks["k3_replayed_on_changed"]
  report = json.load(open(os.path.join(out, "report.json")))
  assert report["routes"].keys() == routes.keys()
  md = open(os.path.join(out, "report.md")).read()
  assert "| b_no_routing_replay |" in md and "Replay on the same tokens" in md
  for png in ("mismatch_hist.png", "mismatch_by_turn.png"):
    with open(os.path.join(out, png), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _measurement(name, scale):
  rng = np.random.default_rng(len(name))
  log_r = rng.normal(0, scale, 50)
  turns = np.arange(50) % 3
  report = {**mr.token_stats(log_r), "routing_agreement": 1.0, "block_agreement": None,
            "trajectories": 2, "by_turn": mr.grouped_stats(log_r, turns),
            "by_position": {"0-512": mr.token_stats(log_r)}, "by_layer_type": {}}
  return mr.RouteMeasurement(name, {"cache_dtype": "float32"}, report, log_r)


def test_reports_have_a_panel_and_a_line_per_route(tmp_path):
  ms = [_measurement("a", 1e-6), _measurement("b", 1e-3), _measurement("sparse", 1e-5)]
  hist = mr.write_histograms(ms, str(tmp_path / "h.png"))
  turns = mr.write_by_turn(ms, str(tmp_path / "t.png"))
  assert len(hist.axes) == 3 and len(turns.axes[0].lines) == 3
  for png in ("h.png", "t.png"):
    assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  md = mr.markdown(ms, "# title")
  assert md.count("\n| a |") == 1 and "## sparse" in md and "| 2 |" in md  # Turn 2's row.
  summary = mr.summary_json(ms)
  assert summary["routes"]["b"]["k3"] == ms[1].report["k3"]
  assert summary["routes"]["b"]["settings"] == {"cache_dtype": "float32"}


def test_the_command_refuses_an_unknown_route_before_any_work(tmp_path):
  out = run_launch("measure_mismatch", "--checkpoint", "/nonexistent",
                   "--workdir", str(tmp_path), "--routes", "a,fast")
  assert out.returncode != 0 and "unknown route(s) ['fast']; valid routes: a, b" in out.stderr
  assert not os.listdir(tmp_path)
