# tests/nonfinite_helpers.py
#
# NaN containment by injection, shared by the CPU (tests/test_nonfinite_logits.py) and GPU
# (tests/gpu/test_cuda_nonfinite_logits.py) tests. A copy of a tiny model gets NaN in the
# embedding row of one token t0 (the LM head is not tied, so no logit of t0 itself changes):
# every logit row computed after t0 is NaN, and only in the request that holds t0. t0 is the
# first greedy token of a probe prompt, so the probe request samples t0 from finite logits,
# feeds it back, and meets NaN logits in its first decode step; a second request holds t0 in its
# prompt and meets them at its prefill. Both must end with finish_reason "error" while the other
# requests of the same batch (greedy and seeded sampling) generate exactly what they generate in
# the same batch on the clean model, where the two requests run as long (max_tokens 2 and 1) so
# every step has the same rows.
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Callable, Sequence

import numpy as np

import dflash

EMBEDDING = "model.embed_tokens.weight"


def poisoned_copy(model_dir: pathlib.Path, out_dir: pathlib.Path, token: int, value: float = float("nan")) -> pathlib.Path:
    """A copy of the single-file, untied model at model_dir with embedding row `token` set to `value`."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    assert not config.get("tie_word_embeddings"), "a tied LM head would put NaN in every request's logits"
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    table = tensors[EMBEDDING].copy()
    table[token, :] = value
    tensors[EMBEDDING] = table
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _other_requests(vocab: int, seed: int) -> tuple[list[list[int]], list[dflash.SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(3, vocab, size=n)] for n in (9, 23, 14)]
    params = [dflash.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              dflash.SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True),
              dflash.SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=12, ignore_eos=True)]
    return prompts, params


def _probe(clean: dflash.Session, vocab: int, others: Sequence[Sequence[int]], other_outputs: Sequence[Sequence[int]]):
    """A probe prompt whose first greedy token t0 is nowhere in the probe's prompt, the other
    prompts or what the others generate: (prompt, t0)."""
    used = set().union(*map(set, others), *map(set, other_outputs))
    rng = np.random.default_rng(7)
    greedy = dflash.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(64):
        prompt = [int(x) for x in rng.integers(3, vocab, size=11)]
        t0 = clean.generate([prompt], greedy)[0].token_ids[0]
        if t0 not in used and t0 not in prompt:
            return prompt, t0
    raise AssertionError("no probe prompt whose first token is unused elsewhere")


def _run(session: dflash.Session, prompts, params, batch, batch_params):
    """The sequence both sessions run (the same steps, so the same prefix-cache hits): the clean
    requests, the batch with the two probes, the clean requests again."""
    first = session.generate(prompts, params)
    mixed = session.generate(batch, batch_params)
    again = session.generate(prompts, params)
    return first, mixed, again, session.stats()


def check_nan_containment(make_session: Callable[[pathlib.Path], dflash.Session], model_dir: pathlib.Path,
                          tmp_path: pathlib.Path, value: float = float("nan")) -> dict:
    """Runs the injection case (module comment) with sessions from make_session(model_dir) and
    make_session(poisoned copy, embedding row t0 = value); asserts the containment; returns the
    poisoned session's stats."""
    finder = make_session(model_dir)
    vocab = finder.model_config.vocab_size
    prompts, params = _other_requests(vocab, seed=3)
    probe, t0 = _probe(finder, vocab, prompts, [o.token_ids for o in finder.generate(prompts, params)])
    finder.close()
    prefill_probe = prompts[0][:4] + [t0] + prompts[1][:6]
    batch = [probe, *prompts, prefill_probe]
    greedy = dict(temperature=0.0, ignore_eos=True)
    batch_params = [dflash.SamplingParams(max_tokens=2, **greedy), *params, dflash.SamplingParams(max_tokens=1, **greedy)]

    clean = make_session(model_dir)
    want_first, want, want_again, clean_stats = _run(clean, prompts, params, batch, batch_params)
    clean.close()
    assert want[0].token_ids[0] == t0 and len(want[0].token_ids) == 2 and want[-1].finish_reason == "length"
    assert clean_stats["num_nonfinite_requests"] == 0

    poisoned = make_session(poisoned_copy(model_dir, tmp_path / "poisoned", t0, value))
    got_first, got, got_again, stats = _run(poisoned, prompts, params, batch, batch_params)
    poisoned.close()
    # The probe emits t0 (sampled from finite logits) and ends at the NaN row after it; the
    # request with t0 in its prompt ends at its prefill, before emitting anything.
    assert (got[0].finish_reason, got[0].token_ids) == ("error", [t0])
    assert (got[-1].finish_reason, got[-1].token_ids) == ("error", [])
    # Every other request, before, beside and after them, generates what it does on the clean model.
    for g, w in zip([*got_first, *got[1:-1], *got_again], [*want_first, *want[1:-1], *want_again]):
        assert (g.finish_reason, g.token_ids) == (w.finish_reason, w.token_ids)
    assert stats["num_nonfinite_requests"] == 2
    assert stats["num_requests_finished"] == clean_stats["num_requests_finished"] == 2 * len(prompts) + len(batch)
    assert stats["num_running_requests"] == 0 and stats["num_waiting_requests"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    return stats


def check_spec_reads_only_consulted_rows(make_session: Callable[[pathlib.Path], dflash.Session],
                                         model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Speculative decoding (make_session gives a session with a one-hot drafter): a verify step
    judges draft j with row j and stops at the first rejection, so a NaN row behind a rejected
    draft is never read. Drafts are dictated (oracle drafts, a test hook): with t0 poisoned,
      * drafts [q1 (accepted), t0 (rejected), ...]: the rows after t0 are NaN but unread, and
        the request generates exactly what it does on the clean model;
      * with q1 poisoned, drafts [q1 (accepted), ...]: row 1 (after q1) is NaN, so the request
        ends with "error" after q0, q1, the tokens target-only decoding would have emitted first.
    """
    from tests.runtime_helpers import oracle_run

    finder = make_session(model_dir)
    vocab = finder.model_config.vocab_size
    rng = np.random.default_rng(5)
    for _ in range(64):
        prompt = [int(x) for x in rng.integers(3, vocab, size=13)]
        out = finder.generate([prompt], dflash.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        q = out.token_ids
        if q[1] not in prompt and q[1] != q[0]:
            break
    else:
        raise AssertionError("no prompt whose second token is new")
    finder.close()
    t0 = next(t for t in range(3, vocab) if t not in prompt and t not in q)
    accept_oracle = list(q)
    reject_oracle = list(q)
    reject_oracle[2] = t0

    clean = make_session(model_dir)
    clean_reject = oracle_run(clean, [prompt], [reject_oracle], max_tokens=12, ignore_eos=True)[0]
    clean_accept = oracle_run(clean, [prompt], [accept_oracle], max_tokens=12, ignore_eos=True)[0]
    clean.close()
    assert t0 not in clean_reject.token_ids and clean_reject.finish_reason == "length"
    assert list(clean_accept.token_ids[:2]) == q[:2]

    behind_rejected = make_session(poisoned_copy(model_dir, tmp_path / "poison_t0", t0))
    got = oracle_run(behind_rejected, [prompt], [reject_oracle], max_tokens=12, ignore_eos=True)[0]
    assert (got.finish_reason, list(got.token_ids)) == (clean_reject.finish_reason, list(clean_reject.token_ids))
    assert behind_rejected.stats()["num_nonfinite_requests"] == 0
    behind_rejected.close()

    after_accepted = make_session(poisoned_copy(model_dir, tmp_path / "poison_q1", q[1]))
    got = oracle_run(after_accepted, [prompt], [accept_oracle], max_tokens=12, ignore_eos=True)[0]
    assert (got.finish_reason, list(got.token_ids)) == ("error", q[:2])
    stats = after_accepted.stats()
    assert stats["num_nonfinite_requests"] == 1 and stats["num_free_blocks"] == stats["num_blocks"]
    after_accepted.close()
