# tests/gpu/test_cuda_dflash2_refused.py
#
# DFlash2 has no CUDA kernels yet: a DFlash2DraftModel drafter on the CUDA backend is refused at
# load with a message that says so (never drafted as DFlash v1, never moved to the CPU quietly),
# while the same directory loads on the CPU backend; DFlash (v1) drafters still run on CUDA.
from __future__ import annotations

import json

import pytest

import dflash
from dflash import _core
from dflash.drafter_format import write_dflash2_drafter, write_dflash_drafter

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")


def test_dflash2_drafter_is_refused_on_cuda(tmp_path, tiny_model_dirs):
    target = tiny_model_dirs["llama_hd64"]
    cfg = json.loads((target / "config.json").read_text())
    d2 = write_dflash2_drafter(tmp_path / "d2", target_config=cfg, num_layers=1, target_layer_ids=[0, 1],
                               block_size=4, conv_group_size=16, selector_rank=8, selector_top_k=8)
    with pytest.raises(dflash.DFlashError, match=r"DFlash2DraftModel runs on the CPU backend only.*never run as DFlash"):
        dflash.Session(target, draft=d2, device="cuda")
    dflash.Session(target, draft=d2, device="cpu", num_threads=1)
    d1 = write_dflash_drafter(tmp_path / "d1", target_config=cfg, num_layers=1, target_layer_ids=[0, 1], block_size=4)
    sess = dflash.Session(target, draft=d1, device="cuda")
    out = sess.generate([[5, 6, 7, 8]], dflash.SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
