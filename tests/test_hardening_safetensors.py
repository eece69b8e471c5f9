# tests/test_hardening_safetensors.py
#
# The safetensors reader refuses, with a dflash.DFlashError naming the file and the problem,
# every hostile layout the reference `safetensors` library refuses (the library is the oracle
# of each case): a header length one byte short or long, offsets shifted, overlapping or
# shared between tensors, gaps, data after the last tensor, duplicate names, JSON nested
# 100,000 deep, non-UTF-8 bytes, metadata of the wrong type, a header beyond the format's
# 100 MB bound. A valid file reads exactly as the reference reads it, and a model directory
# with a hostile shard fails at Session construction instead of computing garbage.
from __future__ import annotations

import json
import pathlib
import shutil
import struct

import pytest
import safetensors

from dflash import DFlashError, Session, _core
from tests.fixtures.loader_fuzz import deep_json, join_safetensors, safetensors_seed, split_safetensors

SEED = safetensors_seed()
HEADER, DATA = split_safetensors(SEED)


def _text(header) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def _shift_all(k: int, *, pad_front: bool) -> bytes:
    """Every offset + k, with k bytes inserted before the data (a gap at byte 0) or not (the
    last tensor then runs past the end)."""
    h = json.loads(json.dumps(HEADER))
    for name, info in h.items():
        if name != "__metadata__":
            info["data_offsets"] = [info["data_offsets"][0] + k, info["data_offsets"][1] + k]
    return join_safetensors(h, (b"\0" * k if pad_front else b"") + DATA)


def _with_offsets(name: str, offsets) -> bytes:
    h = json.loads(json.dumps(HEADER))
    h[name]["data_offsets"] = offsets
    return join_safetensors(h, DATA)


def _header_length(delta: int) -> bytes:
    # Trailing spaces after the JSON (writers pad the header so), so a length one byte short
    # still parses and shifts every tensor by one byte.
    text = _text(HEADER) + b"    "
    return struct.pack("<Q", len(text) + delta) + text + DATA


def _duplicate_name(entry) -> bytes:
    """The header with a second "a.weight" entry after all the others."""
    second = _text({"a.weight": entry})[1:-1]
    return join_safetensors(None, DATA, header_text=_text(HEADER)[:-1] + b"," + second + b"}")


def _offsets(name):
    return HEADER[name]["data_offsets"]


A, B = _offsets("a.weight"), _offsets("b.weight")

CASES = [
    # id, file bytes, message regex
    ("header_length_one_byte_short", _header_length(-1), r"there are 1 bytes after the last tensor"),
    ("header_length_one_byte_long", _header_length(+1), r"invalid JSON|outside the file"),
    ("offsets_shifted_by_4", _shift_all(4, pad_front=True), r"the first tensor must start at byte 0 \(a gap"),
    ("offsets_shifted_past_the_end", _shift_all(4, pad_front=False), r"lie outside the file's \d+ data bytes"),
    ("overlapping_tensors", _with_offsets("b.weight", [B[0] - 2, B[1] - 2]), r"\(tensors overlap\)"),
    ("shared_offsets", _with_offsets("c.ids", list(_offsets("a.weight")[:1]) + [_offsets("a.weight")[0] + 24]),
     r"\(tensors overlap\)"),
    ("data_after_last_tensor", join_safetensors(HEADER, DATA + b"\0" * 4), r"there are 4 bytes after the last tensor"),
    ("gap_between_tensors", join_safetensors({k: v for k, v in HEADER.items() if k != "b.weight"}, DATA),
     r"\(a gap between tensors\)"),
    # The later entry wins in the reference: it aliases b.weight's bytes and hides a's.
    ("duplicate_tensor_name", _duplicate_name({"dtype": "F16", "shape": [8], "data_offsets": B}),
     r"duplicate key \"a\.weight\" in a JSON object"),
    ("json_nested_100000_deep", join_safetensors(None, DATA, header_text=_text({**HEADER, "x": "@"}).replace(
        b'"@"', deep_json(100000))), r"JSON nests deeper than 64 levels"),
    ("non_utf8_tensor_name", join_safetensors(None, DATA, header_text=_text(HEADER).replace(b"a.weight",
                                                                                            b"a.\xffeight")),
     r"invalid JSON: .*ill-formed UTF-8 byte.*\\xff"),
    ("metadata_not_strings", join_safetensors({**HEADER, "__metadata__": {"format": 1}}, DATA),
     r"__metadata__ entry 'format' must be a string, got 1"),
    ("metadata_not_object", join_safetensors({**HEADER, "__metadata__": [1]}, DATA),
     r"__metadata__ must be an object of strings, got \[1\]"),
    ("shape_disagrees_with_offsets", _with_offsets("a.weight", [A[0], A[1] - 4]),
     r"header says 124 bytes but shape \[4, 8\] of F32 needs 128"),
    ("data_cut_short", join_safetensors(HEADER, DATA[:-1]), r"lie outside the file's \d+ data bytes"),
    ("empty_header_with_data", join_safetensors({}, b"\0" * 8), r"the tensors cover 0 of the file's 8 data bytes"),
]


def _reference_refuses(path: pathlib.Path) -> bool:
    """The reference library refuses the file (its header and layout checks run at open)."""
    try:
        if path.stat().st_size < 1 << 20:
            safetensors.deserialize(path.read_bytes())
        else:
            with safetensors.safe_open(str(path), "numpy") as f:
                f.keys()
    except Exception:  # noqa: BLE001 - any refusal of the reference library
        return True
    return False


@pytest.mark.parametrize("data, message", [pytest.param(d, m, id=i) for i, d, m in CASES])
def test_hostile_layouts_are_refused_like_the_reference(tmp_path, data, message):
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    assert _reference_refuses(path), "the case must be one the reference library refuses"
    with pytest.raises(DFlashError, match=message) as info:
        _core.testing.safetensors_read(str(path))
    assert str(path) in str(info.value)


def test_header_beyond_the_format_bound(tmp_path):
    # A sparse file: the header size fits in the file but exceeds the reference's 100 MB bound.
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 100_000_001))
        f.truncate(8 + 100_000_001 + 16)
    assert _reference_refuses(path)
    with pytest.raises(DFlashError, match=r"header size 100000001 exceeds the format's limit of 100000000 bytes"):
        _core.testing.safetensors_read(str(path))


def test_valid_file_reads_like_the_reference(tmp_path):
    path = tmp_path / "ok.safetensors"
    path.write_bytes(SEED)
    ref = dict(safetensors.deserialize(SEED))
    ours = _core.testing.safetensors_read(str(path))
    assert [row[0] for row in ours] == sorted(ref)
    for name, dtype, shape, data in ours:
        assert dtype == ref[name]["dtype"]
        if data is None:  # F64: validated, not readable by dflash
            assert dtype == "F64" and shape is None
        else:
            assert list(shape) == ref[name]["shape"] and data == bytes(ref[name]["data"])


def test_exact_duplicate_entry_is_refused_although_the_reference_accepts_it(tmp_path):
    # Stricter than the reference (which keeps the last of equal entries): a name is one tensor.
    path = tmp_path / "dup.safetensors"
    path.write_bytes(_duplicate_name(HEADER["a.weight"]))
    assert not _reference_refuses(path)
    with pytest.raises(DFlashError, match=r"duplicate key \"a\.weight\""):
        _core.testing.safetensors_read(str(path))


def test_reference_accepts_leading_whitespace_and_so_do_we(tmp_path):
    path = tmp_path / "ws.safetensors"
    path.write_bytes(join_safetensors(None, DATA, header_text=b" \t" + _text(HEADER)))
    assert not _reference_refuses(path)
    assert len(_core.testing.safetensors_read(str(path))) == len(HEADER) - 1


# --- through Session: a hostile shard is refused at load, never computed with --------------


def _model_copy(tiny_model_dirs, tmp_path: pathlib.Path) -> pathlib.Path:
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dirs["llama_gqa"], d)
    return d


def _load(d):
    return Session(d, device="cpu", max_model_len=32, kv_cache_tokens=32, num_threads=1)


def test_session_refuses_a_header_one_byte_short(tiny_model_dirs, tmp_path):
    d = _model_copy(tiny_model_dirs, tmp_path)
    header, data = split_safetensors((d / "model.safetensors").read_bytes())
    text = _text(header) + b"   "
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(text) - 1) + text + data)
    with pytest.raises(DFlashError, match=r"model\.safetensors: the tensors cover \d+ of the file's \d+ data "
                                          r"bytes: there are 1 bytes after the last tensor"):
        _load(d)


def test_session_refuses_tensors_sharing_bytes(tiny_model_dirs, tmp_path):
    # Two tensors of one shape pointing at the same bytes (and the bytes of one left over).
    d = _model_copy(tiny_model_dirs, tmp_path)
    header, data = split_safetensors((d / "model.safetensors").read_bytes())
    header["model.layers.1.input_layernorm.weight"]["data_offsets"] = list(
        header["model.layers.0.input_layernorm.weight"]["data_offsets"])
    (d / "model.safetensors").write_bytes(join_safetensors(header, data))
    with pytest.raises(DFlashError, match=r"\(tensors overlap\)"):
        _load(d)


def test_session_error_quotes_non_utf8_bytes_escaped(tiny_model_dirs, tmp_path):
    d = _model_copy(tiny_model_dirs, tmp_path)
    header, data = split_safetensors((d / "model.safetensors").read_bytes())
    text = _text(header).replace(b"model.norm.weight", b"model.norm.w\xffight")
    (d / "model.safetensors").write_bytes(join_safetensors(None, data, header_text=text))
    with pytest.raises(DFlashError, match=r"ill-formed UTF-8 byte; last read: '\"model\.norm\.w\\xff'"):
        _load(d)
