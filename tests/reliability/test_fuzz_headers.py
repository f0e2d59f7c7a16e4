"""Header parsing fuzzed with hypothesis: whatever the bytes, a ConversionError (one line, naming the
file) or a header whose every tensor lies inside the file, never another exception.

Three levels: raw bytes into ``read_header``; structured headers with hostile field values;
and real shards of a tiny checkpoint with bytes of their header overwritten, through the whole
``convert`` (plan and write), which must either succeed or refuse with no final-named file.
"""

from __future__ import annotations

import json
import math
import shutil
import struct

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fuse_tool.convert import convert_checkpoint
from fuse_tool.errors import FuseSharedError
from fuse_tool.verify.integrity import VerifyError
from runtime.safetensors_io import DTYPE_SIZES, read_header
from fuse_tool.verify.integrity import check_output

from helpers import final_named

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


def _check_parsed(path, tensors):
    size = path.stat().st_size
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    spans = []
    for t in tensors.values():
        assert t.dtype in DTYPE_SIZES
        assert t.nbytes == math.prod(t.shape) * DTYPE_SIZES[t.dtype]
        assert 8 + n <= t.offset and t.offset + t.nbytes <= size
        spans.append((t.offset, t.offset + t.nbytes))
    spans.sort()
    assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))


def _parse(path):
    try:
        tensors, _ = read_header(path)
    except FuseSharedError as e:
        assert str(path) in str(e) and "\n" not in str(e)
        return None
    _check_parsed(path, tensors)
    return tensors


@FUZZ
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes(tmp_path, data):
    p = tmp_path / "f.safetensors"
    p.write_bytes(data)
    _parse(p)


@FUZZ
@given(
    header=st.binary(max_size=300),
    body=st.binary(max_size=300),
    fake_len=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
def test_length_prefix_and_header_bytes(tmp_path, header, body, fake_len):
    p = tmp_path / "f.safetensors"
    n = len(header) if fake_len is None else fake_len
    p.write_bytes(struct.pack("<Q", n) + header + body)
    _parse(p)


_json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=8)
)
_json_values = st.recursive(
    _json_scalars,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c, max_size=4)),
    max_leaves=12,
)
_dtypes = st.one_of(st.sampled_from(sorted(DTYPE_SIZES)), st.text(max_size=6), _json_values)
_shape = st.one_of(st.lists(st.integers(-2, 70), max_size=4), st.lists(st.integers(0, 2**40), max_size=3), _json_values)
_offsets = st.one_of(
    st.lists(st.integers(-10, 5000), min_size=2, max_size=2),
    st.lists(st.integers(0, 2**66), min_size=0, max_size=3),
    _json_values,
)
_entry = st.one_of(st.fixed_dictionaries({"dtype": _dtypes, "shape": _shape, "data_offsets": _offsets}), _json_values)


@FUZZ
@given(
    entries=st.dictionaries(st.text(max_size=10), _entry, max_size=6),
    metadata=st.one_of(st.none(), _json_values),
    body=st.integers(0, 4096),
    pad=st.integers(0, 7),
)
def test_structured_hostile_headers(tmp_path, entries, metadata, body, pad):
    header = dict(entries)
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode() + b" " * pad
    p = tmp_path / "f.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(body))
    _parse(p)


def test_deeply_nested_header_is_refused(tmp_path):
    raw = b"[" * 100_000 + b"]" * 100_000
    p = tmp_path / "f.safetensors"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(FuseSharedError, match="nested too deeply|not valid JSON"):
        read_header(p)


@pytest.fixture(scope="module")
def one_shard_source(tiny_source, tmp_path_factory):
    from builders import load_all, rewrite

    src = tmp_path_factory.mktemp("fuzzsrc") / "src"
    shutil.copytree(tiny_source, src)
    rewrite(src, load_all(src), shards=1)
    return src


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    edits=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=6)), min_size=1, max_size=4
    )
)
def test_damaged_real_header_through_convert(one_shard_source, tmp_path_factory, edits):
    """Bytes inside a real shard's header overwritten: convert refuses cleanly or, if the header is still valid, converts."""
    work = tmp_path_factory.mktemp("fz")
    src = work / "src"
    shutil.copytree(one_shard_source, src)
    shard = next(src.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    for where, new in edits:
        i = 8 + int(where * n)
        data[i : i + len(new)] = new[: max(0, 8 + n - i)]
    assume(bytes(data) != shard.read_bytes())
    shard.write_bytes(bytes(data))
    out = work / "out"
    try:
        convert_checkpoint(src, out, progress=False)
    except FuseSharedError as e:
        assert "\n" not in str(e)
        assert final_named(out) == []
        return
    assert (out / "config.json").exists()
    check_output(out, checksums=True)


_field_edit = st.tuples(
    st.integers(0, 10_000),  # which tensor (modulo the count)
    st.sampled_from(["dtype", "shape", "data_offsets", "rename", "delete", "entry"]),
    st.one_of(_dtypes, _shape, _offsets, _json_values),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(edits=st.lists(_field_edit, min_size=1, max_size=3))
def test_hostile_fields_in_a_real_header_through_convert(one_shard_source, tmp_path_factory, edits):
    """Valid JSON with hostile values (dtypes, shapes, offsets, names, missing entries) in a real shard: the plan
    and the writer refuse cleanly or convert; never another exception, never a final-named file on refusal."""
    work = tmp_path_factory.mktemp("fh")
    src = work / "src"
    shutil.copytree(one_shard_source, src)
    shard = next(src.glob("*.safetensors"))
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    for which, field, value in edits:
        name = names[which % len(names)]
        if name not in header:
            continue
        if field == "delete":
            header.pop(name)
        elif field == "rename":
            header[str(value)[:40]] = header.pop(name)
        elif field == "entry":
            header[name] = value
        elif isinstance(header[name], dict):
            header[name][field] = value
    raw = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    out = work / "out"
    try:
        convert_checkpoint(src, out, progress=False)
    except FuseSharedError as e:
        assert "\n" not in str(e)
        assert final_named(out) == []
        return
    check_output(out, checksums=True)


@pytest.fixture(scope="module")
def converted(tiny_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzzout") / "out"
    convert_checkpoint(tiny_source, out, progress=False)
    return out


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    edits=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=6)), min_size=1, max_size=4
    )
)
def test_damaged_output_header_through_verify(converted, tmp_path_factory, edits):
    """verify on an output whose shard header was damaged: a clean VerifyError (never another exception) unless the header is intact."""
    out = tmp_path_factory.mktemp("fv") / "out"
    shutil.copytree(converted, out)
    shard = sorted(out.glob("*.safetensors"))[0]
    original = shard.read_bytes()
    data = bytearray(original)
    (n,) = struct.unpack("<Q", data[:8])
    for where, new in edits:
        i = int(where * (8 + n))
        data[i : i + len(new)] = new[: max(0, 8 + n - i)]
    shard.write_bytes(bytes(data))
    try:
        check_output(out, checksums=True)
    except (FuseSharedError, VerifyError) as e:
        assert "\n" not in str(e)
        return
    assert bytes(data) == original
