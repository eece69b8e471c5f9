# tests/test_bench_ship_decision.py
#
# The drafter-comparison scripts of bench/ on synthetic reports: merge_acceptance_modes.py (one
# stored copy of a T = 0 run two modes share, tau ratios to the reference mode) and
# ship_decision.py (tokens/s ratio = tau ratio / step-time ratio per cell; the candidate ships
# only if it is faster overall and at every temperature) and the headline keys with the goal gaps
# of update_headline_acceptance.py --modes. Nothing here runs a model.
from __future__ import annotations

import importlib
import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


def _bench_module(name):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def _cell(dataset, t, tau, wall=1.0, steps=100):
    return {"dataset": dataset, "temperature": t, "tau": tau, "acceptance_rate_per_position": [0.5, 0.25],
            "wall_time_s": wall, "num_spec_steps": steps}


def _report(tmp_path, name, cells):
    path = tmp_path / name
    path.write_text(json.dumps({"date": "d", "command": f"cmd {name}", "results": cells}))
    return str(path)


@pytest.fixture
def merged(tmp_path):
    m = _bench_module("merge_acceptance_modes")
    s0 = _report(tmp_path, "s0.json", [_cell("gsm8k", 0.0, 4.0), _cell("math", 0.0, 3.0)])
    s1 = _report(tmp_path, "s1.json", [_cell("gsm8k", 1.0, 2.0), _cell("math", 1.0, 1.5)])
    c0 = _report(tmp_path, "c0.json", [_cell("gsm8k", 0.0, 4.4), _cell("math", 0.0, 3.3)])
    c1 = _report(tmp_path, "c1.json", [_cell("gsm8k", 1.0, 1.8), _cell("math", 1.0, 1.5)])
    modes = dict(m.load_mode(spec) for spec in (f"ship={s0},{s1}", f"ship_greedy={s0}", f"cand={c0},{c1}"))
    return m.merge(modes, "ship", "synthetic")


def test_merge_stores_a_shared_run_once_and_divides_by_the_reference(merged):
    assert sorted(merged["reports"]) == ["c0.json", "c1.json", "s0.json", "s1.json"]
    assert merged["modes"]["ship_greedy"] == ["s0.json"]
    row = next(r for r in merged["tau_table"] if r["dataset"] == "gsm8k" and r["temperature"] == 0.0)
    assert row["tau_ship_greedy"] == row["tau_ship"] == 4.0
    assert row["tau_cand_over_ship"] == pytest.approx(1.1)
    t1 = next(r for r in merged["tau_table"] if r["dataset"] == "gsm8k" and r["temperature"] == 1.0)
    assert "tau_ship_greedy" not in t1 and t1["tau_cand_over_ship"] == pytest.approx(0.9)


def test_merge_refuses_a_cell_twice_in_one_mode(tmp_path):
    m = _bench_module("merge_acceptance_modes")
    a = _report(tmp_path, "a.json", [_cell("gsm8k", 0.0, 4.0)])
    _, reps = m.load_mode(f"x={a},{a}")
    with pytest.raises(SystemExit, match="twice"):
        m.cells_of(reps)


def test_ship_decision_divides_tau_by_step_time_and_needs_every_temperature(merged):
    d = _bench_module("ship_decision")
    out = d.decide(merged, "ship", "cand", {"t0": 1.05, "t_pos": 0.98})
    cell = next(c for c in out["cells"] if c["dataset"] == "gsm8k" and c["temperature"] == 0.0)
    assert cell["tokens_per_s_ratio"] == pytest.approx(1.1 / 1.05)
    t1 = next(c for c in out["cells"] if c["dataset"] == "math" and c["temperature"] == 1.0)
    assert t1["tokens_per_s_ratio"] == pytest.approx(1.0 / 0.98)
    by_t = out["tokens_per_s_ratio_by_temperature"]
    assert by_t["0"] == pytest.approx(1.1 / 1.05)  # both T = 0 cells have tau ratio 1.1
    assert by_t["1"] == pytest.approx(((0.9 / 0.98) * (1.0 / 0.98)) ** 0.5)
    assert by_t["1"] < 1.0 and out["candidate_wins"] is False
    faster = d.decide(merged, "ship", "cand", {"t0": 1.0, "t_pos": 0.9})
    assert faster["tokens_per_s_ratio_by_temperature"]["1"] > 1.0 and faster["candidate_wins"] is True


def test_step_seconds_from_reports():
    d = _bench_module("ship_decision")
    assert d.e2e_step_s({"dflash": {"seconds": 2.0, "spec_steps": 1000}}) == pytest.approx(0.002)
    rep = {"results": [_cell("gsm8k", 1.0, 2.0, wall=3.0, steps=1000), _cell("math", 1.0, 2.0, wall=1.0, steps=1000)]}
    assert d.acceptance_step_s(rep) == pytest.approx(0.002)


def test_headline_modes_keys_and_goal_gaps(merged):
    h = _bench_module("update_headline_acceptance")
    figures = h.modes_figures(merged, "ship", "cand")
    assert figures["tau_gsm8k_t0"] == 4.0 and figures["tau_dflash2_gsm8k_t1"] == 1.8
    assert figures["tau_dflash2_over_dflash_math_t0"] == pytest.approx(1.1)
    assert figures["goal_gap_dflash2_over_dflash_t0_worst_set"] == pytest.approx(1.2 - 1.1)
    assert figures["goal_gap_tau_gsm8k_t1_best_mode"] == pytest.approx(2.5 - 2.0)  # the best mode at T = 1
    assert figures["goal_gap_tau_gsm8k_t0_shipped"] == pytest.approx(0.0)
    assert "goal_gap_tau_humaneval_t0_shipped" not in figures  # no HumanEval cell here
