# tests/test_api.py
#
# The public Python API: names, prompt forms (str, list of str, token ids, chat messages),
# outputs and metrics, stop strings, stats, stubs, and that the GIL is released while the C++
# engine runs.
from __future__ import annotations

import importlib.resources
import threading
import time

import pytest

import dflash
from tests.runtime_helpers import assert_no_leaks


@pytest.fixture(scope="module")
def sess(tiny_model_dirs):
    return dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", num_threads=2)


def test_public_names_and_build_info(tiny_model_dirs):
    assert set(dflash.__all__) == {"Session", "SamplingParams", "RequestOutput", "RequestMetrics", "StreamOutput",
                                   "DFlashError"}
    assert issubclass(dflash.DFlashError, RuntimeError)
    assert isinstance(dflash.built_with_cuda(), bool)
    if not dflash._core.cuda_usable():  # a CPU machine: asking for CUDA says why it cannot
        match = "no usable GPU" if dflash.built_with_cuda() else "no CUDA backend"
        with pytest.raises(ValueError, match=match):
            dflash.Session(tiny_model_dirs["llama_gqa"], device="cuda")
        assert dflash.Session(tiny_model_dirs["llama_gqa"], device="auto").stats()["device"] == "cpu"
    p = dflash.SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.stop_token_ids) == (
        256, 0.0, 1.0, 0, None, None, None)


def test_stub_files_are_shipped():
    files = importlib.resources.files("dflash")
    assert files.joinpath("_core.pyi").is_file()
    text = files.joinpath("_core.pyi").read_text()
    assert "class Session" in text and "def step" in text


def test_prompt_forms(sess):
    params = dflash.SamplingParams(max_tokens=4)
    one = sess.generate("hello world", params)
    assert len(one) == 1 and one[0].prompt == "hello world"
    assert one[0].prompt_token_ids == sess.tokenizer.encode("hello world")
    many = sess.generate(["hello world", "the sea"], params)
    assert [o.prompt for o in many] == ["hello world", "the sea"]
    assert many[0].token_ids == one[0].token_ids
    ids = sess.generate([one[0].prompt_token_ids], params)
    assert ids[0].token_ids == one[0].token_ids and ids[0].prompt is None
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = sess.generate(conv, params)
    rendered = sess.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
    assert chat[0].prompt == rendered and rendered.endswith("<|im_start|>assistant\n")
    assert chat[0].prompt_token_ids == sess.tokenizer.encode(rendered, add_special_tokens=False)
    two = sess.generate([conv, [{"role": "user", "content": "yo"}]], params)
    assert len(two) == 2 and two[0].token_ids == chat[0].token_ids
    assert sess.generate([], params) == []
    assert_no_leaks(sess)


def test_output_fields_and_metrics(sess):
    out = sess.generate("a b c", dflash.SamplingParams(max_tokens=6, stop_token_ids=[]))[0]
    assert isinstance(out, dflash.RequestOutput)
    assert isinstance(out.text, str) and isinstance(out.token_ids, list)
    assert out.finish_reason in ("stop", "length")
    m = out.metrics
    assert isinstance(m, dflash.RequestMetrics)
    assert m.prompt_tokens == len(out.prompt_token_ids)
    assert m.generated_tokens == len(out.token_ids)
    assert m.num_steps == len(out.token_ids)
    assert 0 < m.time_to_first_token <= m.total_time
    if len(out.token_ids) > 1:
        assert m.decode_tokens_per_s > 0
    assert out.text == sess.tokenizer.decode(out.token_ids)


def test_stop_strings_cut_the_text(sess):
    params = dflash.SamplingParams(max_tokens=40, stop_token_ids=[])
    free = sess.generate("the", params)[0]
    text = free.text
    assert len(text) > 6, text
    stop = text[3:6]
    first = text.find(stop)
    out = sess.generate("the", dflash.SamplingParams(max_tokens=40, stop_token_ids=[], stop=[stop, "\x00never"]))[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop"
    assert len(out.token_ids) <= len(free.token_ids)
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert_no_leaks(sess)


def test_params_per_prompt(sess):
    outs = sess.generate(["x", "y"], [dflash.SamplingParams(max_tokens=2), dflash.SamplingParams(max_tokens=5)])
    assert len(outs[0].token_ids) <= 2 and len(outs[1].token_ids) <= 5


def test_stats(sess):
    st = sess.stats()
    for key in ("device", "weight_bytes", "kv_cache_bytes", "kv_cache_tokens", "num_blocks",
                "num_free_blocks", "max_model_len", "num_steps", "num_generated_tokens"):
        assert key in st
    assert st["device"] == "cpu" and st["weight_bytes"] > 0
    assert st["kv_cache_tokens"] == st["num_blocks"] * st["block_size"]
    # the CPU runs decode programs eagerly, without padding, and says so
    sess.generate(["hello"], dflash.SamplingParams(max_tokens=3))
    st = sess.stats()
    assert st["cuda_graphs"] is False and st["graph_batch_sizes"] == [] and st["graph_steps"] == 0
    assert st["eager_steps"] >= 2 and st["eager_forwards"] >= 1


# The public keys of Session.stats(), pinned so that renaming or dropping one is a deliberate
# change (they are built from the list in include/dflash/stats.h plus the values derived in
# python/dflash/session.py).
STATS_KEYS = {
    "device", "weight_bytes", "kv_cache_bytes", "kv_cache_tokens", "block_size", "num_blocks", "num_free_blocks",
    "max_model_len", "num_threads", "workspace_bytes", "num_steps", "num_forward_tokens", "num_generated_tokens",
    "num_requests_finished", "num_nonfinite_requests", "draft_weight_bytes", "draft_kv_cache_bytes",
    "num_speculative_tokens", "draft_sampling", "num_spec_steps", "num_drafted", "num_accepted", "acceptance_length",
    "accepted_per_position", "spec_time_s", "decode_time_s", "host_stage_s", "host_launch_s", "host_wait_s",
    "cuda_graphs", "async_decode", "deterministic", "graph_batch_sizes",
    "graph_capture_s",
    "graph_steps", "eager_steps", "eager_forwards", "pipelined_steps", "dropped_rows", "num_preemptions",
    "num_prefill_chunks", "num_running_requests", "num_waiting_requests", "prefix_caching", "num_cached_blocks",
    "num_evictable_blocks", "num_evicted_blocks", "prefix_cache_query_tokens", "prefix_cache_hit_tokens",
    "speculation", "draft_lengths", "spec_length_steps", "spec_cost_table", "spec_cost_measure_s",
}


def test_host_time_of_decode_steps(tiny_model_dirs):
    """The decode steps' host time: staging and queueing (eager on the CPU: every op) are counted,
    and with the waits they fit in the decode time (no pipelining here: every launch is inside it)."""
    s = dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", num_threads=1)
    before = s.stats()
    assert before["host_stage_s"] == before["host_launch_s"] == before["host_wait_s"] == 0.0
    s.generate(["hello there", "a b c"], dflash.SamplingParams(max_tokens=6, ignore_eos=True))
    st = s.stats()
    assert st["eager_steps"] >= 5
    assert st["host_stage_s"] > 0.0 and st["host_launch_s"] > 0.0 and st["host_wait_s"] >= 0.0
    assert st["host_stage_s"] + st["host_launch_s"] + st["host_wait_s"] <= st["decode_time_s"] + 1e-6
    s.close()


def test_stats_keys(sess):
    st = sess.stats()
    assert set(st) == STATS_KEYS
    assert set(st["spec_time_s"]) == {"draft", "verify", "accept", "context_update"}
    assert st["draft_sampling"] is None and st["speculation"] is None and st["spec_cost_table"] is None
    # the core's attributes are named by the same list as its dict
    core = sess._core.stats()
    assert all(getattr(core.engine if hasattr(core.engine, k) else core, k) == v for k, v in core.as_dict().items())


def test_deterministic_is_a_cuda_mode(sess, tiny_model_dirs, monkeypatch):
    assert sess.stats()["deterministic"] is False
    with pytest.raises(ValueError, match="deterministic=True needs device='cuda'"):
        dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", deterministic=True)
    with pytest.raises(ValueError, match="deterministic must be True or False"):
        dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", deterministic=1)
    # The environment override reaches the same check (no CPU session quietly ignores it).
    monkeypatch.setenv("DFLASH_BATCH_INVARIANT", "1")
    with pytest.raises(ValueError, match="batch-invariant kernels"):
        dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu")
    monkeypatch.delenv("DFLASH_BATCH_INVARIANT")
    assert dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", deterministic=False).stats()["deterministic"] is False


def test_ignore_eos_runs_to_max_tokens(sess):
    eos = sess.model_config.eos_token_ids
    out = sess.generate(["hello"], dflash.SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=[]))[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="ignore_eos must be True or False"):
        dflash.SamplingParams(ignore_eos="yes")
    assert eos is not None


def test_gil_is_released_during_generation(tiny_model_dirs):
    s = dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", num_threads=1)
    ticks = 0
    stop = threading.Event()

    def count():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.0005)

    # One long C++ call (Session construction + a long prefill) must let the other thread run.
    from dflash import _core

    t = threading.Thread(target=count)
    t.start()
    try:
        req = _core.RequestInput()
        req.prompt = [5] * 400
        sc = _core.SamplingConfig()
        sc.max_tokens = 1
        req.sampling = sc
        before = ticks
        start = time.perf_counter()
        for _ in range(20):
            rid = s._core.add_request(req)
            s._core.step()
            s._core.take_result(rid)
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        t.join()
    assert ticks - before > 0.2 * elapsed / 0.0005 * 0.1, (ticks - before, elapsed)


def test_session_without_model_opens_the_default_model(tmp_path, monkeypatch):
    """Session() is `dflash generate` without --model: the default model, and its drafter by the
    same rule (the shipped one on CUDA, none on the CPU; "default" / "none" choose)."""
    import json

    from dflash.default_model import default_model_dir
    from dflash.drafter_format import write_dflash_drafter

    model = default_model_dir()
    cfg = json.loads((model / "config.json").read_text())
    dr = write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[1, 15, 28],
                              block_size=4, mask_token_id=16)
    monkeypatch.setenv("DFLASH_DEFAULT_DRAFTER", str(dr))
    s = dflash.Session(device="cpu")
    assert s.model_dir == str(model) and s.draft_dir is None  # target-only on the CPU
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert "Paris" in s.generate(chat, dflash.SamplingParams(max_tokens=16))[0].text
    assert dflash.Session(device="cpu", draft="default").draft_dir == str(dr)
    assert dflash.Session(device="cpu", draft="none").draft_dir is None
    with pytest.raises(ValueError, match="drafter of the default model"):
        dflash.Session(model, device="cpu", draft="default")


def test_draft_rule_shared_by_session_and_cli(tmp_path, monkeypatch):
    import pathlib

    from dflash.default_model import resolve_draft

    monkeypatch.setenv("DFLASH_DEFAULT_DRAFTER", str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_draft(None, default_model=True, device="cuda") == str(tmp_path)
    assert resolve_draft(None, default_model=True, device="cpu") is None
    assert resolve_draft(None, default_model=False, device="cuda") is None
    assert resolve_draft("default", default_model=True, device="cpu") == str(tmp_path)
    assert resolve_draft("none", default_model=True, device="cuda") is None
    assert resolve_draft(pathlib.Path("none"), default_model=False, device="cpu") == "none"  # a Path is a dir
    assert resolve_draft("some/dir", default_model=False, device="cpu") == "some/dir"
    monkeypatch.setenv("DFLASH_DEFAULT_DRAFTER", "none")
    assert resolve_draft(None, default_model=True, device="cuda") is None
    with pytest.raises(ValueError, match="ships no drafter"):
        resolve_draft("default", default_model=True, device="cpu")


def test_unknown_chat_role_is_a_value_error(tiny_model_dirs, tmp_path):
    """A ChatML template that renders any role (as SmolLM2's does) still refuses 'wizard'; the
    known roles pass."""
    import json
    import shutil

    model = shutil.copytree(tiny_model_dirs["llama_gqa"], tmp_path / "m")
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    cfg_path.write_text(json.dumps(cfg))
    s = dflash.Session(model, device="cpu", num_threads=2)
    params = dflash.SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"messages\[1\] has role 'wizard', which is not a chat role; "
                                         r"allowed roles: system, user, assistant, tool, developer"):
        s.generate([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "abracadabra"}], params)
    with pytest.raises(ValueError, match="role 'wizard'"):
        s.tokenizer.apply_chat_template([{"role": "wizard", "content": "x"}])
    roles = ["system", "developer", "user", "assistant", "tool", "user"]
    out = s.generate([{"role": r, "content": "x"} for r in roles], params)
    assert len(out) == 1
    assert_no_leaks(s)
