# tests/gpu/test_cuda_prewait_reads.py
#
# The decode attention kernels that read before their programmatic-launch wait (the CUDA-core
# kernel's staged and fused-RoPE versions, the tensor-core kernel) read there only what the kernel
# ahead does not write: the batch's metadata, the block table and the keys of earlier steps. Here
# the step's late writes (the queries, this step's K/V rows, or the raw QKV projection for the
# fused kernel) land through cuda_late_copy_rows, a kernel that lets the attention launch at once
# and writes 200 us later. Before it lands those rows hold other values, so a kernel that read any
# of them early would give another result: each launch must have the bits of the same kernel
# launched with everything in place. A control writes one earlier key late too (key 0 of every
# sequence, which the first pass reads before the wait), as the first of the chained late copies
# (the others land after it): then some launch must differ, which shows that the attention really
# ran ahead of the late copies (the test is not vacuous). The fused kernels are compared with
# themselves here; test_cuda_decode_attention_rope.py compares them with the unfused pair.
# Skipped without a usable Hopper GPU.
from __future__ import annotations

import pytest

from .test_cuda_decode_attention_rope import RopeInputs, _bits, _testing, batch_of
from .test_triton_attention import _SKIP_REASON, Batch

pytestmark = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")

DELAY_NS = 200_000
# (kernel, query kind): the CUDA-core kernel (register version: waits first, a baseline), staged,
# fused RoPE on either, and the tensor-core kernel for AR rows and for 16-query verify rows.
KERNELS = [("register", "decode"), ("staged", "decode"), ("staged", "multi"), ("rope", "decode"),
           ("rope_staged", "multi"), ("tensor_cores", "decode"), ("tensor_cores", "verify")]
HEADS = [(32, 8, 128), (9, 3, 64)]
KV_LENS = [1000, 70, 300, 17]


def _batch(kind, nh, nkv, hd, seed):
    if kind == "verify":  # 16 queries per sequence: 16 x group rows per KV head (tensor cores)
        return Batch(KV_LENS, [16] * len(KV_LENS), nh, nkv, hd, seed=seed)
    return batch_of(kind, KV_LENS, nh, nkv, hd, seed=seed)


def _slots(b: Batch, keys_of):
    """Pool slots of keys_of(sequence, kv_len, num_q) -> positions, over the batch."""
    import torch

    table = b.table.cpu()
    out = []
    for s, (n, nq) in enumerate(zip(b.kv_lens, b.q_lens)):
        out += [int(table[s, j // b.block_size]) * b.block_size + j % b.block_size for j in keys_of(s, n, nq)]
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def _launch(b: Batch, kernel, k_pool, v_pool, q, rope: RopeInputs | None, qkv, out, stream, workspace, counters):
    t = _testing()
    batch = (b.query_start, b.kv_len, b.table, True, 0, max(b.q_lens), max(b.kv_lens))
    opts = {"workspace": workspace, "counters": counters, "stream": stream}
    if kernel.startswith("rope"):
        t.cuda_decode_attention_rope(qkv, rope.q_norm, rope.k_norm, 1e-6, rope.positions, rope.inv_freq, rope.slots,
                                     k_pool, v_pool, out, *batch, **opts, staged=kernel == "rope_staged")
    else:
        t.cuda_decode_attention(q, k_pool, v_pool, out, *batch, **opts, tensor_cores=kernel == "tensor_cores",
                                staged=kernel == "staged")


def _run(b: Batch, kernel, rope, late: bool, extra_late_keys: bool = False):
    """One launch of `kernel` on copies of the batch. late=False: every input in place first.
    late=True: the queries (or qkv) and this step's K/V rows (or, for the fused kernel, nothing of
    the pools) start out as other values and land through a late copy right before the launch;
    extra_late_keys: key 0 of every sequence too. Returns the output."""
    import torch

    t = _testing()
    k_pool, v_pool = b.k_pool.clone(), b.v_pool.clone()
    q = b.q_dev.clone()
    qkv = rope.qkv.clone() if rope is not None else None
    out = torch.full_like(b.q_dev, float("nan"))
    n = t.cuda_decode_attention_max_splits()
    ws = torch.empty(t.cuda_decode_attention_workspace_bytes(sum(b.q_lens), b.nh, b.hd, n), dtype=torch.uint8,
                     device="cuda")
    counters = torch.zeros(len(b.kv_lens) * b.nkv, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()  # a stream of its own (programmatic launch on a created stream)
    stream = side.cuda_stream
    torch.cuda.synchronize()
    if late:
        copies = []  # (destination, the values it must end with, rows), landing in this order
        flat_k, flat_v = k_pool.view(-1, b.nkv, b.hd), v_pool.view(-1, b.nkv, b.hd)
        if extra_late_keys:  # first: the chained copies land ~DELAY_NS apart, this one earliest
            first = _slots(b, lambda s, kv, nq: [0] if kv > nq else [])
            copies.append((flat_k, flat_k.clone(), first))
        if rope is None:
            rows = torch.arange(q.shape[0], dtype=torch.int32, device="cuda")
            copies.append((q, q.clone(), rows))
            new = _slots(b, lambda s, kv, nq: range(kv - nq, kv))
            copies += [(flat_k, flat_k.clone(), new), (flat_v, flat_v.clone(), new)]
        else:
            rows = torch.arange(qkv.shape[0], dtype=torch.int32, device="cuda")
            copies.append((qkv, qkv.clone(), rows))
        for dst, _, rows in copies:  # the old values: other random ones, finite
            dst[rows.long()] = torch.randn_like(dst[rows.long()].float()).to(dst.dtype)
        torch.cuda.synchronize()
        for dst, src, rows in copies:
            t.cuda_late_copy_rows(dst, src, rows, DELAY_NS, stream)
    _launch(b, kernel, k_pool, v_pool, q, rope, qkv, out, stream, ws, counters)
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0, "the split counters must return to zero"
    return out


@pytest.mark.parametrize("nh,nkv,hd", HEADS)
@pytest.mark.parametrize("kernel,kind", KERNELS)
def test_late_writes_are_waited_for(kernel, kind, nh, nkv, hd):
    import torch

    b = _batch(kind, nh, nkv, hd, seed=nh + hd)
    rope = RopeInputs(b, hd == 128, seed=hd) if kernel.startswith("rope") else None
    want = _run(b, kernel, rope, late=False)
    assert torch.isfinite(want.float()).all()
    for trial in range(3):
        got = _run(b, kernel, rope, late=True)
        assert torch.equal(_bits(got), _bits(want)), f"{kernel} {kind}: a late write was read early (trial {trial})"


@pytest.mark.parametrize("kernel,kind", [("staged", "decode"), ("rope_staged", "multi"), ("tensor_cores", "verify")])
def test_control_an_early_read_is_seen(kernel, kind):
    """Key 0 of every sequence is read before the wait by these kernels: written late, the launch
    misses it in some trial, so the late copy really lands after the attention has started."""
    import torch

    b = _batch(kind, 32, 8, 128, seed=3)
    rope = RopeInputs(b, True, seed=4) if kernel.startswith("rope") else None
    want = _run(b, kernel, rope, late=False)
    differs = [not torch.equal(_bits(_run(b, kernel, rope, late=True, extra_late_keys=True)), _bits(want))
               for _ in range(5)]
    assert any(differs), f"{kernel}: the early-read key was always seen; the late copy did not overlap the launch"
