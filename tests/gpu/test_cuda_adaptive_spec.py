# tests/gpu/test_cuda_adaptive_spec.py
#
# Adaptive speculation on the CUDA backend (speculation="adaptive"): one graph per (draft length,
# padded batch size), the length chosen per step. Checked: under forced draft-length schedules
# (a test hook; 0 = the AR graph that keeps the drafter's context) graph replays give exactly the
# tokens of the same steps run eagerly, for DFlash and DFlash2, greedy and seeded T > 0, across
# padded batch sizes and under preemption / chunked prefill; greedy output equals target-only
# greedy (or diverges only where the fp32 top-2 gap is within the bf16 tolerance, as in
# test_cuda_models.py) under forced switching and under the policy; the step costs measured at
# start-up are sane (positive, at the graph batch sizes, an AR step no dearer than a speculative
# one at the same batch size). Skipped without a usable Hopper GPU.
from __future__ import annotations

import json

import numpy as np
import pytest

import dflash
from dflash import _core

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")

KV = dict(kv_cache_tokens=16384, max_num_seqs=16)
FLAT = [[1, 1.0, 1.0, 1.0, 1.0]]  # four draft lengths, every one free: the schedule decides
# Speculation pays for one or two requests, not from three on (policy runs that switch as the batch drains).
SWITCH_ROWS = [[1, 1.0, 1.0, 1.0, 1.0], [2, 2.0, 2.0, 2.0, 2.0], [3, 1.0, 6.0, 6.0, 6.0], [16, 1.0, 9.0, 9.0, 9.0]]
SCHEDULES = {"dflash": [0, 7, 0, 0, 3, 1, 7, 0], "dflash2": [0, 4, 0, 0, 3, 1, 4, 0]}  # blocks 8 and 5


def _prompts(n, seed, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(lo, hi)))] for _ in range(n)]


def _drafter(tmp_path, target, kind):
    if kind == "dflash":
        from dflash.drafter_format import write_dflash_drafter

        cfg = json.loads((target / "config.json").read_text())
        return write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=2, target_layer_ids=[0, 1],
                                    block_size=8)
    from tests.gpu.gpu_helpers import gpu_dflash2

    return gpu_dflash2(tmp_path, target, block_size=5, selector_top_k=16)


def _session(target, draft=None, **kw):
    c = _core.SessionConfig()
    c.device = "cuda"
    c.kv_cache_tokens, c.max_num_seqs = KV["kv_cache_tokens"], KV["max_num_seqs"]
    if draft is not None:
        c.draft_dir = str(draft)
    for k, v in kw.items():
        setattr(c, k, v)
    return _core.Session(str(target), c)


def _run(sess, prompts, temperature):
    ids = []
    for i, p in enumerate(prompts):
        req = _core.RequestInput()
        req.prompt = list(p)
        s = _core.SamplingConfig()
        s.max_tokens, s.temperature, s.top_p, s.seed, s.ignore_eos = 12 + 5 * (i % 4), temperature, 0.9, 100 + i, True
        req.sampling = s
        ids.append(sess.add_request(req))
    while sess.has_unfinished():
        sess.step()
    out = [list(sess.take_result(i).token_ids) for i in ids]
    st = sess.stats()
    assert st.num_free_blocks == st.num_blocks
    return out


@pytest.mark.parametrize("draft", ["dflash", "dflash2"])
@pytest.mark.parametrize("name", ["llama_hd64", "qwen3_hd128"])
def test_graphs_per_length_equal_eager(name, draft, tiny_model_dirs, tmp_path):
    target = tiny_model_dirs[name]
    dr = _drafter(tmp_path, target, draft)
    kw = dict(speculation="adaptive", spec_length_schedule=SCHEDULES[draft], spec_cost_table=FLAT)
    on, off = _session(target, dr, **kw), _session(target, dr, cuda_graphs=False, **kw)
    for n, temperature in [(1, 0.0), (3, 0.0), (6, 0.8), (13, 0.0), (16, 0.7)]:
        prompts = _prompts(n, seed=60 + n)
        assert _run(on, prompts, temperature) == _run(off, prompts, temperature), (name, draft, n, temperature)
    s_on, s_off = on.stats(), off.stats()
    assert s_on.cuda_graphs and not s_off.cuda_graphs
    assert s_on.engine.graph_steps > 0 and s_on.engine.eager_steps == 0
    assert list(s_on.graph_batch_sizes) == [1, 2, 4, 8, 16]
    steps = list(s_on.engine.spec_length_steps)
    assert steps == list(s_off.engine.spec_length_steps) and all(steps[x] > 0 for x in SCHEDULES[draft])
    print(f"{name} {draft}: capture of {len(s_on.draft_lengths)} lengths x {len(s_on.graph_batch_sizes)} sizes "
          f"{s_on.graph_capture_s:.3f} s")


@pytest.mark.parametrize("draft", ["dflash", "dflash2"])
def test_greedy_equals_target_only_under_switching(draft, tiny_model_dirs, tmp_path):
    from tests.gpu.test_cuda_models import TOL_FACTOR, _check_greedy, bf16_floor

    name = "qwen3_hd128"
    target = tiny_model_dirs[name]
    dr = _drafter(tmp_path, target, draft)
    cpu = dflash.Session(target, device="cpu", num_threads=2)
    gap_tol = TOL_FACTOR * bf16_floor(name, tiny_model_dirs, cpu)
    prompts = _prompts(8, seed=7)
    want = _run(_session(target), prompts, 0.0)
    for kw in (dict(spec_length_schedule=SCHEDULES[draft], spec_cost_table=FLAT), dict(spec_cost_table=SWITCH_ROWS)):
        spec = _session(target, dr, speculation="adaptive", **kw)
        got = _run(spec, prompts, 0.0)
        for p, g, w in zip(prompts, got, want):
            _check_greedy(cpu, p, g, w, f"{name} {draft} adaptive {sorted(kw)} vs target-only", gap_tol)
        steps = list(spec.stats().engine.spec_length_steps)
        assert steps[0] > 0 and sum(steps[1:]) > 0, steps


def test_measured_cost_table_is_sane(tiny_model_dirs, tmp_path):
    target = tiny_model_dirs["qwen3_hd128"]
    dr = _drafter(tmp_path, target, "dflash")
    sess = dflash.Session(target, draft=str(dr), device="cuda", speculation="adaptive", **KV)
    st = sess.stats()
    costs = st["spec_cost_table"]
    fixed = dflash.Session(target, draft=str(dr), device="cuda", **KV).stats()
    print(f"measured in {st['spec_cost_measure_s']:.3f} s; capture {st['graph_capture_s']:.3f} s for "
          f"{len(st['draft_lengths'])} lengths (fixed: {fixed['graph_capture_s']:.3f} s for one): {costs}")
    assert costs["batch_sizes"] == st["graph_batch_sizes"] == [1, 2, 4, 8, 16]
    assert costs["lengths"] == st["draft_lengths"] == [0, 1, 3, 7]
    seconds = np.array(costs["seconds"])
    assert np.all(np.isfinite(seconds)) and np.all(seconds > 0) and np.all(seconds < 1.0)
    assert np.all(seconds[:, :1] <= seconds[:, 1:]), seconds  # an AR step is no dearer than a speculative one
    assert st["spec_cost_measure_s"] > 0
    # The policy on the measured table: lossless, and the chosen lengths are counted.
    prompts = _prompts(12, seed=8)
    params = [dflash.SamplingParams(max_tokens=10 + 4 * (i % 3), ignore_eos=True) for i in range(len(prompts))]
    got = [o.token_ids for o in sess.generate(prompts, params)]
    assert got == [o.token_ids for o in dflash.Session(target, draft=str(dr), device="cuda", speculation="adaptive",
                                                       spec_cost_table=costs, **KV).generate(prompts, params)]
    st = sess.stats()
    print(f"chosen lengths: {st['spec_length_steps']}")
    assert sum(st["spec_length_steps"].values()) > 0 and st["num_free_blocks"] == st["num_blocks"]


@pytest.mark.parametrize("draft", ["dflash", "dflash2"])
def test_switching_with_preemption_and_chunked_prefill_graphs_equal_eager(draft, tiny_model_dirs, tmp_path):
    target = tiny_model_dirs["qwen3_hd128"]
    dr = _drafter(tmp_path, target, draft)
    tight = dict(kv_cache_tokens=192, block_size=16, max_num_seqs=8, max_num_batched_tokens=24,
                 speculation="adaptive", spec_length_schedule=SCHEDULES[draft], spec_cost_table=FLAT)
    on, off = _session(target, dr, **tight), _session(target, dr, cuda_graphs=False, **tight)
    prompts = _prompts(10, seed=5, lo=10, hi=100)
    for temperature in (0.0, 0.8):
        assert _run(on, prompts, temperature) == _run(off, prompts, temperature), (draft, temperature)
    e_on, e_off = on.stats().engine, off.stats().engine
    assert e_on.graph_steps > 0 and e_on.num_preemptions > 0 and e_on.num_preemptions == e_off.num_preemptions
    assert e_on.num_prefill_chunks > len(prompts) * 2
