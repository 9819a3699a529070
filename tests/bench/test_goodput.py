"""bench/goodput.py without servers: the rate bisection on synthetic attainment curves with
known answers, the bracket logic around it, the per-run attainment, the configurations and
flags, and the table/JSON summary built from synthetic measurements."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "plan"))
import goodput as gp  # noqa: E402
from plan_helpers import round_profile  # noqa: E402

from pdserve.flags import ConfigError  # noqa: E402
from pdserve.loadtest.metrics import RequestResult  # noqa: E402


class Counted:
    """An attainment curve that records every rate it is asked about."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, []

    def __call__(self, rate: float) -> float:
        self.calls.append(rate)
        return self.fn(rate)


# ---- bisect_rate -------------------------------------------------------------------------

@pytest.mark.parametrize("r_star", [0.7, 3.3, 6.25, 9.99])
def test_bisect_finds_a_step_within_tol(r_star: float) -> None:
    # every request meets the SLOs up to r*, a third miss beyond
    f = Counted(lambda r: 1.0 if r <= r_star else 0.66)
    got = gp.bisect_rate(f, 0.5, 10.0, target=0.9, tol=0.05)
    assert r_star - 0.05 <= got <= r_star
    assert f(got) >= 0.9
    # log2(9.5 / 0.05) < 8 midpoints, plus at most one end
    assert len(f.calls) - 1 <= 9


def test_bisect_on_a_smooth_falling_curve() -> None:
    # logistic: attainment 0.9 exactly at r = 5 + 0.3 ln(1/9)
    r_star = 5 + 0.3 * math.log(1 / 9)
    f = Counted(lambda r: 1 / (1 + math.exp((r - 5) / 0.3)))
    got = gp.bisect_rate(f, 1.0, 20.0, target=0.9, tol=0.01)
    assert r_star - 0.01 <= got <= r_star
    assert 1.0 not in f.calls and 20.0 not in f.calls  # the crossing is inside: ends unmeasured


def test_bisect_on_a_monotone_staircase() -> None:
    # a real run's attainment moves in steps of 1/n (12 requests): flat, then falling
    def attain(r: float) -> float:
        return math.floor(12 * min(1.0, max(0.0, 1 - 0.1 * (r - 4)))) / 12

    got = gp.bisect_rate(attain, 1.0, 16.0, target=0.9, tol=0.02)
    # 11/12 >= 0.9 holds while 1 - 0.1 (r - 4) >= 11/12, i.e. r <= 4 + 5/6
    assert 4 + 5 / 6 - 0.02 <= got <= 4 + 5 / 6


def test_bisect_with_non_monotone_noise_lands_in_the_crossing_band() -> None:
    # falling line crossing 0.9 at 5.25, plus +-0.03 of noise: any rate where the noisy
    # curve can be on either side of 0.9 is a fair answer, nothing outside that band
    def attain(r: float) -> float:
        return min(1.0, 1 - 0.08 * max(0.0, r - 4)) + 0.03 * math.sin(53 * r)

    lo_band, hi_band = 4 + 0.07 / 0.08, 4 + 0.13 / 0.08
    got = gp.bisect_rate(attain, 0.5, 12.0, target=0.9, tol=0.05)
    assert lo_band - 0.05 <= got <= hi_band
    assert attain(got) >= 0.9


def test_bisect_all_fail_returns_zero_after_checking_lo_once() -> None:
    f = Counted(lambda r: 0.2)
    assert gp.bisect_rate(f, 1.0, 9.0, tol=0.5) == 0.0
    assert f.calls.count(1.0) == 1 and 9.0 not in f.calls


def test_bisect_all_pass_returns_hi_after_checking_it_once() -> None:
    f = Counted(lambda r: 1.0)
    assert gp.bisect_rate(f, 1.0, 9.0, tol=0.5) == 9.0
    assert f.calls.count(9.0) == 1 and 1.0 not in f.calls


def test_bisect_bracket_narrower_than_tol_checks_only_the_ends() -> None:
    assert gp.bisect_rate(lambda r: 1.0 if r < 1.05 else 0.0, 1.0, 1.1, tol=0.5) == 1.0
    assert gp.bisect_rate(lambda r: 1.0, 1.0, 1.1, tol=0.5) == 1.1
    assert gp.bisect_rate(lambda r: 0.0, 1.0, 1.1, tol=0.5) == 0.0


@pytest.mark.parametrize("lo, hi, tol", [(0.0, 1.0, 0.1), (2.0, 1.0, 0.1), (1.0, 2.0, 0.0),
                                         (-1.0, 2.0, 0.1)])
def test_bisect_rejects_a_bad_bracket(lo: float, hi: float, tol: float) -> None:
    with pytest.raises(ValueError):
        gp.bisect_rate(lambda r: 1.0, lo, hi, tol=tol)


# ---- brackets around it ------------------------------------------------------------------

def test_search_brackets_from_a_wrong_guess_then_bisects() -> None:
    f = Counted(lambda r: 1.0 if r <= 6.0 else 0.0)
    # far too high: halved 100 -> 50 -> 25 -> 12.5 -> 6.25 -> 3.125, then bisected
    g, edge = gp.search_goodput(f, 100.0, 0.5, 400.0, 0.9, 0.05)
    assert edge == "" and 6.0 - 0.05 * 6.25 <= g <= 6.0
    assert f.calls[:6] == [100.0, 50.0, 25.0, 12.5, 6.25, 3.125]
    assert len(f.calls) == len(set(f.calls))  # no rate run twice
    # far too low: doubled 0.5 -> 1 -> ... -> 8
    f = Counted(lambda r: 1.0 if r <= 6.0 else 0.0)
    g, edge = gp.search_goodput(f, 0.5, 0.1, 400.0, 0.9, 0.05)
    assert edge == "" and 6.0 - 0.05 * 8 <= g <= 6.0
    assert f.calls[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]


def test_search_reuses_known_runs() -> None:
    f = Counted(lambda r: 1.0 if r <= 6.0 else 0.0)
    g, edge = gp.search_goodput(f, 100.0, 0.5, 400.0, 0.9, 0.05,
                                known=[(5.0, 1.0), (7.0, 0.0), (50.0, 0.0)])
    assert 5.9 <= g <= 6.0 and edge == ""
    assert all(5.0 < r < 7.0 for r in f.calls)  # no gallop, the guess is not run
    # a failure below a pass (noise) does not end the bracket there
    g, _ = gp.search_goodput(lambda r: 1.0 if r <= 6.0 else 0.0, 100.0, 0.5, 400.0, 0.9,
                             0.05, known=[(2.0, 0.0), (4.0, 1.0)])
    assert 5.6 <= g <= 6.0


def test_search_edges() -> None:
    f = Counted(lambda r: 0.0)
    assert gp.search_goodput(f, 8.0, 1.5, 100.0, 0.9, 0.1) == (0.0, "below")
    assert f.calls == [8.0, 4.0, 2.0, 1.5]  # ends at the floor, never below it
    f = Counted(lambda r: 1.0)
    assert gp.search_goodput(f, 8.0, 1.0, 100.0, 0.9, 0.1) == (100.0, "above")
    assert f.calls == [8.0, 16.0, 32.0, 64.0, 100.0]
    # a guess outside [floor, ceiling] is clipped into it
    f = Counted(lambda r: 0.0)
    assert gp.search_goodput(f, 0.01, 1.0, 100.0, 0.9, 0.1) == (0.0, "below")
    assert f.calls == [1.0]


def test_snap_puts_guesses_on_one_grid() -> None:
    assert gp.snap(10.0, 10.0) == 10.0
    assert gp.snap(4.6, 10.0) == 5.0 and gp.snap(2.6, 10.0) == 2.5
    assert gp.snap(19.0, 10.0) == 20.0
    assert gp.snap(0.0, 10.0) == 10.0


# ---- the planner's side ------------------------------------------------------------------

def test_planner_goodput_on_a_round_profile() -> None:
    # extend 10 ms + 1 ms/token: a 100-token prompt takes 110 ms; decode steps 20 ms; a
    # machine per node (no sharing), so the figures can be checked by hand
    cfg = gp.GoodputConfig(model="tiny-llama", isl=100, osl=4, cores=2, slos=("x:1:1",),
                           probe_s=10, min_prompts=10, max_prompts=60).resolved()
    colo = gp.Planner(round_profile(), gp.Shape(0, 0, 1), cfg, 0.0, 0)
    assert colo.prefill_bound() == pytest.approx(1 / 0.11)
    loose, tight = gp.Slo("loose", 5000, 100), gp.Slo("tight", 100, 100)
    assert colo.attainment(0.2, loose) == 1.0
    assert colo.attainment(0.2, tight) == 0.0  # no TTFT is under the 110 ms prefill
    g, edge = gp.search_goodput(lambda r: colo.attainment(r, loose), 2.0, 0.1, 40.0, 0.9,
                                0.01)
    assert edge == "" and 1.0 < g < 1 / 0.11 * 1.2
    assert gp.search_goodput(lambda r: colo.attainment(r, tight), 2.0, 0.1, 40.0, 0.9,
                             0.01) == (0.0, "below")
    pd = gp.Planner(round_profile(), gp.Shape(1, 1, 1), cfg, 0.0, 0)
    assert pd.cluster.pd and pd.cluster.label() == "1P1D"
    # a PD request pays the transfer besides the prefill: never sooner than colocated
    assert pd.attainment(0.2, gp.Slo("t", 115, 100)) <= colo.attainment(0.2, gp.Slo("t", 115,
                                                                                    100))


# ---- measured attainment -----------------------------------------------------------------

def test_attainment_counts_failures_as_misses() -> None:
    slo = gp.Slo("x", ttft_ms=100, tpot_ms=10)
    results = [
        RequestResult(success=True, output_len=11, ttft=0.05, e2el=0.05 + 0.09),  # 9 ms TPOT
        RequestResult(success=True, output_len=11, ttft=0.2, e2el=0.3),  # TTFT too long
        RequestResult(success=True, output_len=11, ttft=0.05, e2el=0.05 + 0.2),  # 20 ms TPOT
        RequestResult(success=True, output_len=1, ttft=0.09, e2el=0.09),  # no TPOT: counts 0
        RequestResult(success=False, error="boom"),
    ]
    assert gp.attainment_of(results, slo) == pytest.approx(2 / 5)
    assert gp.attainment_of([], slo) == 0.0


# ---- configurations and flags ------------------------------------------------------------

def test_default_shapes_split_the_cores() -> None:
    assert [(s.label, s.threads) for s in gp.default_shapes(2, 4)] == [("1C", 2), ("1P1D", 1)]
    four = [(s.label, s.threads) for s in gp.default_shapes(4, 4)]
    assert four == [("1C", 4), ("1P1D", 2), ("1P2D", 1), ("2P1D", 1), ("1P3D", 1),
                    ("2P2D", 1), ("3P1D", 1)]
    assert [s.label for s in gp.default_shapes(16, 2)] == ["1C", "1P1D"]
    assert [s.label for s in gp.default_shapes(1, 4)] == ["1C"]


def test_parse_shape() -> None:
    assert gp.parse_shape("1p2d", 6) == gp.Shape(1, 2, 2)
    assert gp.parse_shape("1C", 6) == gp.Shape(0, 0, 6)
    for bad in ("2C", "P1D", "1P0D", "1P1", "xyz"):
        with pytest.raises(ConfigError):
            gp.parse_shape(bad, 4)
    with pytest.raises(ConfigError, match="cores"):
        gp.parse_shape("2P1D", 2)


def test_mode_defaults_and_slos() -> None:
    quick = gp.GoodputConfig(quick=True, cores=2).resolved()
    assert (quick.model, quick.isl, quick.osl) == ("smollm2-135m", 256, 32)
    assert quick.slos == gp.SLO_DEFAULTS["smollm2-135m", 256, 32]
    assert [s.name for s in quick.slo_list()] == ["loose", "tight-ttft", "tight-tpot"]
    full = gp.GoodputConfig(cores=2).resolved()
    assert (full.model, full.isl, full.osl) == ("smollm2-135m", 1024, 128)
    assert full.prompts_at(0.01) == full.min_prompts and full.prompts_at(1e6) == full.max_prompts
    assert full.prompts_at(2.0) == 60  # 2 req/s x 30 s
    own = gp.GoodputConfig(model="tiny-llama", isl=64, slos=("a:10:2",), cores=2).resolved()
    assert own.slo_list() == [gp.Slo("a", 10.0, 2.0)] and own.osl == 128
    tiny = gp.GoodputConfig(model="tiny-llama", isl=512, osl=32, cores=2).resolved()
    assert tiny.slos == gp.SLO_DEFAULTS["tiny-llama", 512, 32]
    for model, isl in (("some/model", 0), ("smollm2-135m", 300)):
        with pytest.raises(ConfigError, match="no default SLO"):
            gp.GoodputConfig(model=model, isl=isl, cores=2).resolved()


@pytest.mark.parametrize("slos", [("a:1",), ("a:1:x",), ("a:0:1",), (":1:2",), ("a:1:2:3",),
                                  ("a:1:2", "a:3:4"), ("a:inf:1",)])
def test_bad_slo_pairs_are_refused(slos: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="--slos"):
        gp.GoodputConfig(slos=slos)


def test_cli_flags_build_the_config() -> None:
    cfg = gp.parse_args(["--quick", "--cores", "2", "--shapes", "1C,1P1D", "--slos",
                         "l:300:30,t:50:5", "--rel-tol", "0.2"])
    assert cfg.quick and cfg.cores == 2 and cfg.rel_tol == 0.2
    assert [s.label for s in cfg.shape_list()] == ["1C", "1P1D"]
    assert [s.name for s in cfg.slo_list()] == ["l", "t"]
    with pytest.raises(SystemExit):
        gp.parse_args(["--slos", "nope"])
    with pytest.raises(SystemExit):
        gp.parse_args(["--target", "1.5"])


# ---- the summary -------------------------------------------------------------------------

SLOS = [gp.Slo("loose", 250, 25), gp.Slo("tight-ttft", 100, 25), gp.Slo("tight-tpot", 250, 8)]


def figs() -> list[gp.Figure]:
    return [
        gp.Figure("1C", 2, "loose", measured=20.0, planner=22.0, runs=6),
        gp.Figure("1C", 2, "tight-ttft", measured=18.0, planner=15.0, runs=6),
        gp.Figure("1C", 2, "tight-tpot", measured=4.0, planner=5.0, runs=6),
        gp.Figure("1P1D", 1, "loose", measured=19.0, planner=21.0, runs=5),
        gp.Figure("1P1D", 1, "tight-ttft", measured=0.0, planner=3.0, measured_edge="below",
                  runs=5),
        gp.Figure("1P1D", 1, "tight-tpot", measured=6.0, planner=7.5, runs=5),
    ]


def test_summary_picks_errors_and_goals() -> None:
    rows, picks, summary = gp.build_summary(figs(), SLOS)
    assert [(r["config"], r["slo"]) for r in rows][:2] == [("1C", "loose"), ("1C", "tight-ttft")]
    by = {(r["config"], r["slo"]): r for r in rows}
    assert by["1C", "loose"]["error_pct"] == 10.0
    assert by["1C", "tight-ttft"]["error_pct"] == pytest.approx(-16.7)
    assert by["1P1D", "tight-ttft"]["error_pct"] is None  # nothing measured to compare with
    assert by["1P1D", "tight-ttft"]["measured_bound"] == "<lo"
    assert summary["planner_pick"] == {"loose": "1C", "tight-ttft": "1C", "tight-tpot": "1P1D"}
    assert summary["measured_best"] == {"loose": "1C", "tight-ttft": "1C",
                                        "tight-tpot": "1P1D"}
    assert summary["goal_pick_within_10pct_every_slo"] is True
    assert summary["max_abs_error_pct"] == 25.0  # 1C tight-tpot: 5 vs 4
    assert summary["errors_compared"] == 5 and summary["goal_error_met"] is False
    assert summary["goodput_req_s"]["1P1D"]["tight-tpot"] == {
        "measured": 6.0, "planner": 7.5, "measured_edge": "", "planner_edge": "",
        "error_pct": 25.0}
    assert [p["slo"] for p in picks] == ["loose", "tight-ttft", "tight-tpot"]
    v = summary["pd_vs_colocated"]
    assert "a draw" in v["loose"]  # 20 vs 19
    assert "PD loses" in v["tight-ttft"] and "divides them" in v["tight-ttft"]
    assert "PD wins" in v["tight-tpot"]


def test_summary_pick_within_ten_percent_and_a_wrong_pick() -> None:
    f = [gp.Figure("1C", 2, "loose", measured=10.0, planner=8.0),
         gp.Figure("1P1D", 1, "loose", measured=9.5, planner=9.0)]
    _, picks, summary = gp.build_summary(f, SLOS[:1])
    assert picks[0]["planner_pick"] == "1P1D" and picks[0]["measured_best"] == "1C"
    assert summary["pick_within_10pct"] == {"loose": True}  # 9.5 >= 0.9 x 10
    f[1] = gp.Figure("1P1D", 1, "loose", measured=8.0, planner=9.0)
    _, _, summary = gp.build_summary(f, SLOS[:1])
    assert summary["pick_within_10pct"] == {"loose": False}
    assert summary["goal_pick_within_10pct_every_slo"] is False


def test_summary_ties_go_to_colocated_and_bounds_are_not_errors() -> None:
    f = [gp.Figure("1C", 2, "loose", measured=5.0, planner=5.0, measured_edge="above"),
         gp.Figure("1P1D", 1, "loose", measured=5.0, planner=5.0, measured_edge="above")]
    rows, _, summary = gp.build_summary(f, SLOS[:1])
    assert summary["planner_pick"] == {"loose": "1C"} == summary["measured_best"]
    assert rows[0]["measured_bound"] == ">=" and rows[0]["error_pct"] is None
    assert summary["max_abs_error_pct"] is None and summary["goal_error_met"] is False
    none = [gp.Figure("1C", 2, "loose", 0.0, 0.0, "below"),
            gp.Figure("1P1D", 1, "loose", 0.0, 0.0, "below")]
    assert "neither meets" in gp.build_summary(none, SLOS[:1])[2]["pd_vs_colocated"]["loose"]


def test_plots_are_written(tmp_path: Path) -> None:
    a = gp.plot_attainment(tmp_path / "1C_attainment.png", "1C", SLOS, 0.9,
                           {"loose": [(5.0, 1.0), (10.0, 0.95), (15.0, 0.4)]},
                           {"loose": [(r, max(0.0, 1 - (r / 20) ** 3)) for r in range(1, 20)]},
                           {"loose": (10.0, 12.0)})
    s = gp.plot_scatter(tmp_path / "1C_ttft_tpot.png", "1C", SLOS,
                        [(30.0, 3.5, 5.0), (80.0, 4.2, 10.0), (400.0, 9.0, 15.0)])
    for path in (a, s):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the whole script, stacks faked -------------------------------------------------------

class FakeStack:
    """A LiveStack whose attainment at a rate is the planner's at 0.7x that rate: a system
    that takes 1/0.7 times the load the planner thinks (its runs' requests are dummies)."""

    def __init__(self, shape, cfg, work, jsonl) -> None:
        self.planner = gp.Planner(round_profile(), shape, cfg, 0.0, 0)
        self.probes: dict[float, gp.Probe] = {}

    def __enter__(self):
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def attainment(self, rate: float, slo: gp.Slo) -> float:
        if rate not in self.probes:
            results = [RequestResult(success=True, output_len=4, ttft=0.1, e2el=0.1 + 0.06)]
            row = {"failed": 0, "duration": 1.0, "median_ttft_ms": 100.0, "p90_ttft_ms": 100.0,
                   "median_tpot_ms": 20.0, "p90_tpot_ms": 20.0}
            self.probes[rate] = gp.Probe(rate, results, row)
        return self.planner.attainment(0.7 * rate, slo)


def test_main_end_to_end_with_fake_stacks(tmp_path: Path, monkeypatch, capsys) -> None:
    import json

    monkeypatch.setattr(gp, "LiveStack", FakeStack)
    monkeypatch.setattr(gp, "get_profile", lambda cfg, t, pd, keep: round_profile())
    monkeypatch.setattr(gp, "usable_cores", lambda: 0)  # a machine per node: by hand
    import pdserve.plan.profile_contention as pc

    monkeypatch.setattr(pc, "runnable_now", lambda seconds=1.0: 0.0)
    out, plots = tmp_path / "g.json", tmp_path / "plots"
    gp.main(["--model", "tiny-llama", "--cores", "2", "--isl", "100", "--osl", "4",
             "--slos", "loose:5000:100,tight:1000:30", "--probe-s", "10", "--min-prompts",
             "10", "--max-prompts", "40", "--out", str(out), "--plot", str(plots)])
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert set(s["goodput_req_s"]) == {"1C", "1P1D"}
    loose = s["goodput_req_s"]["1C"]["loose"]
    assert loose["planner"] > 0 and loose["measured"] > 0
    # the fake is the planner at 0.7x the rate: measured ~ planner / 0.7
    assert loose["measured"] == pytest.approx(loose["planner"] / 0.7, rel=0.25)
    assert s["slo_ms"] == {"loose": {"ttft": 5000.0, "tpot": 100.0},
                           "tight": {"ttft": 1000.0, "tpot": 30.0}}
    assert {r["config"] for r in doc["rows"]} == {"1C", "1P1D"} and len(doc["rows"]) == 4
    assert set(s["pd_vs_colocated"]) == {"loose", "tight"} and s["picks"]
    assert sorted(p.name for p in plots.iterdir()) == [
        "1C_attainment.png", "1C_ttft_tpot.png", "1P1D_attainment.png", "1P1D_ttft_tpot.png"]
    text = capsys.readouterr().out
    assert "planner_pick" in text and "goals:" in text
