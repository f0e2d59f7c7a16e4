"""Damaged and hostile inputs: one line ``error: <file>: tensor '<name>': <what was expected>``, exit 1,
no traceback, and no final-named file in OUT_DIR.

Every case here is a row of the table in docs/reliability.md (``test_docs_table_lists_every_case``
keeps the two in step). Full-disk cases are in test_disk_full.py, resume refusals in
test_resume.py; they are rows of the same table.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch

from builders import load_all, rewrite, to_fp8_block

from helpers import REPO, assert_clean_refusal, run_cli

INDEX = "model.safetensors.index.json"
EXPERT = "model.layers.1.mlp.experts.3.gate_proj.weight"
ROUTER = "model.layers.2.mlp.gate.weight"
NORM = "model.layers.0.input_layernorm.weight"
SHARED_DOWN = "model.layers.1.mlp.shared_experts.down_proj.weight"


# ----------------------------------------------------------------------------- editing helpers


def shard_of(src: Path, tensor: str) -> Path:
    return src / json.loads((src / INDEX).read_text())["weight_map"][tensor]


def read_raw(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw(path: Path, header: dict | bytes, body: bytes) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def edit_header(path: Path, fn) -> None:
    header, body = read_raw(path)
    fn(header)
    write_raw(path, header, body)


def mutate(src: Path, fn, shards: int = 2) -> None:
    t = load_all(src)
    fn(t)
    rewrite(src, t, shards=shards)


def edit_config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def edit_index(src: Path, fn) -> None:
    idx = json.loads((src / INDEX).read_text())
    fn(idx)
    (src / INDEX).write_text(json.dumps(idx))


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


def _poison(name, value, index=5):
    def fn(t):
        x = t[name].clone()
        x.view(-1)[index] = value
        t[name] = x

    return fn


def _poison_fp8_byte(name, byte=0x7F):
    def fn(t):
        x = t[name].clone().view(torch.uint8)
        x.view(-1)[7] = byte
        t[name] = x.view(torch.float8_e4m3fn)

    return fn


def _duplicate_across_shards(src):
    """The same tensor in both shards (the index points at one of them)."""
    t = load_all(src)
    weight_map = json.loads((src / INDEX).read_text())["weight_map"]
    other = sorted(set(weight_map.values()) - {weight_map[EXPERT]})[0]
    from safetensors.torch import load_file, save_file

    mine = load_file(str(src / other))
    mine[EXPERT] = t[EXPERT]
    save_file(mine, str(src / other), metadata={"format": "pt"})


def _duplicate_no_index(src):
    _duplicate_across_shards(src)
    (src / INDEX).unlink()


def _offsets_overlap(path: Path):
    def fn(h):
        names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        a, b = names[0], names[1]
        size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        start = h[a]["data_offsets"][0]
        h[b]["data_offsets"] = [start, start + size]

    edit_header(path, fn)


def _offsets_out_of_range(path: Path):
    def fn(h):
        _, body_len = None, None
        last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
        b, e = h[last]["data_offsets"]
        h[last]["data_offsets"] = [b + 4096, e + 4096]

    edit_header(path, fn)


def _offsets_wrong_size(path: Path, tensor: str):
    def fn(h):
        b, e = h[tensor]["data_offsets"]
        h[tensor]["data_offsets"] = [b, e - 2]

    edit_header(path, fn)


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _header_length(path: Path, n: int):
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", n)
    path.write_bytes(bytes(data))


def _header_length_short(path: Path, by: int):
    """The header padded with spaces (as writers do) and its length ``by`` bytes short: the JSON still parses, and
    every tensor would be read ``by`` bytes early."""
    header, body = read_raw(path)
    raw = json.dumps(header).encode() + b" " * 8
    path.write_bytes(struct.pack("<Q", len(raw) - by) + raw + body)


def _corrupt_json(path: Path):
    data = bytearray(path.read_bytes())
    data[8:20] = b'{"oops": [1,'
    path.write_bytes(bytes(data))


def _header_not_object(path: Path):
    _, body = read_raw(path)
    write_raw(path, b"[1, 2, 3]", body)


def _duplicate_key(path: Path, tensor: str):
    header, body = read_raw(path)
    raw = json.dumps(header)
    entry = json.dumps(header[tensor])
    raw = raw[:-1] + f', "{tensor}": {entry}' + "}"
    write_raw(path, raw.encode(), body)


def _unknown_dtype(path: Path, tensor: str):
    edit_header(path, lambda h: h[tensor].__setitem__("dtype", "F7_E9"))


def _hub_cache_dangling(src: Path):
    """A Hub-cache snapshot whose blob is gone: the snapshot's symlink dangles."""
    f = shard_of(src, EXPERT)
    blobs = src.parent / "blobs"
    blobs.mkdir(exist_ok=True)
    blob = blobs / "deadbeef"
    f.rename(blob)
    f.symlink_to(blob)
    blob.unlink()


# ----------------------------------------------------------------------------- the cases


def _fp8(fn):
    def both(src):
        to_fp8_block(src)
        fn(src)

    return both


# id -> (what the table says, how to make it, fragments of the message, extra CLI args)
CASES: dict[str, tuple[str, object, tuple[str, ...], tuple[str, ...]]] = {
    "truncated_shard": (
        "shard cut in half (data section truncated)",
        lambda s: _truncate(shard_of(s, EXPERT)),
        ("run past the end of the data", "truncated file"),
        (),
    ),
    "file_shorter_than_8_bytes": (
        "a shard of 5 bytes",
        lambda s: shard_of(s, EXPERT).write_bytes(b"\x01\x02\x03\x04\x05"),
        ("shorter than the 8-byte header length",),
        (),
    ),
    "header_length_past_eof": (
        "header length runs past the end of the file",
        lambda s: _header_length(shard_of(s, EXPERT), shard_of(s, EXPERT).stat().st_size),
        ("runs past the end of the file",),
        (),
    ),
    "header_length_absurd": (
        "header length of 2**62",
        lambda s: _header_length(shard_of(s, EXPERT), 2**62),
        ("over the safetensors limit",),
        (),
    ),
    "header_length_4_bytes_short": (
        "header length 4 bytes short (the JSON ends in padding spaces)",
        lambda s: _header_length_short(shard_of(s, EXPERT), 4),
        ("cover", "of the data section", "header length"),
        (),
    ),
    "header_length_1_byte_short": (
        "header length 1 byte short (the JSON ends in padding spaces)",
        lambda s: _header_length_short(shard_of(s, EXPERT), 1),
        ("cover", "of the data section", "header length"),
        (),
    ),
    "header_json_corrupt": (
        "header JSON corrupt",
        lambda s: _corrupt_json(shard_of(s, EXPERT)),
        ("header is not valid JSON",),
        (),
    ),
    "header_not_an_object": (
        "header JSON is a list, not an object",
        lambda s: _header_not_object(shard_of(s, EXPERT)),
        ("header is not a JSON object",),
        (),
    ),
    "header_names_tensor_twice": (
        "one header names a tensor twice",
        lambda s: _duplicate_key(shard_of(s, EXPERT), EXPERT),
        (EXPERT, "names this tensor twice"),
        (),
    ),
    "unknown_dtype": (
        "a dtype safetensors does not have",
        lambda s: _unknown_dtype(shard_of(s, EXPERT), EXPERT),
        (EXPERT, "unknown dtype 'F7_E9'"),
        (),
    ),
    "data_offsets_overlap": (
        "two tensors' data_offsets overlap",
        lambda s: _offsets_overlap(shard_of(s, EXPERT)),
        ("overlap",),
        (),
    ),
    "data_offsets_out_of_range": (
        "data_offsets past the end of the data",
        lambda s: _offsets_out_of_range(shard_of(s, EXPERT)),
        ("run past the end of the data",),
        (),
    ),
    "data_offsets_wrong_size": (
        "data_offsets hold fewer bytes than dtype x shape",
        lambda s: _offsets_wrong_size(shard_of(s, EXPERT), EXPERT),
        (EXPERT, "expected 4096 for BF16 [32, 64]"),
        (),
    ),
    "weight_shape_mismatch": (
        "an expert weight of the wrong shape",
        lambda s: mutate(s, _set(EXPERT, torch.zeros(32, 48, dtype=torch.bfloat16))),
        (EXPERT, "has shape [32, 48], expected [32, 64]"),
        (),
    ),
    "weight_dtype_mismatch": (
        "an expert weight stored as int32",
        lambda s: mutate(s, _set(EXPERT, torch.zeros(32, 64, dtype=torch.int32))),
        (EXPERT, "has dtype I32"),
        (),
    ),
    "scale_shape_mismatch": (
        "an FP8 weight whose _scale_inv has the wrong grid",
        _fp8(lambda s: mutate(s, _set(EXPERT + "_scale_inv", torch.ones(2, 2)))),
        (EXPERT + "_scale_inv", "has shape [2, 2], expected [1, 1]"),
        (),
    ),
    "scale_dtype_mismatch": (
        "an FP8 weight whose _scale_inv is BF16",
        _fp8(lambda s: mutate(s, _set(EXPERT + "_scale_inv", torch.ones(1, 1, dtype=torch.bfloat16)))),
        (EXPERT + "_scale_inv", "has dtype BF16, expected F32"),
        (),
    ),
    "scale_without_weight": (
        "a _scale_inv with no weight beside it",
        lambda s: mutate(s, _set("model.layers.0.mlp.extra_proj.weight_scale_inv", torch.ones(1, 1))),
        ("model.layers.0.mlp.extra_proj.weight_scale_inv", "scale with no weight"),
        (),
    ),
    "scale_beside_float_weight": (
        "a BF16 weight with a _scale_inv",
        lambda s: mutate(s, _set(EXPERT + "_scale_inv", torch.ones(1, 1))),
        (EXPERT + "_scale_inv", f"the weight it belongs to, {EXPERT!r}, is BF16"),
        (),
    ),
    "fp8_weight_without_scale": (
        "an FP8 weight without its _scale_inv",
        _fp8(lambda s: mutate(s, lambda t: t.pop(EXPERT + "_scale_inv"))),
        (EXPERT, "FP8 weight without its scale"),
        (),
    ),
    "duplicate_tensor_across_shards": (
        "one tensor in two shards (with an index)",
        _duplicate_across_shards,
        (EXPERT, "duplicate tensor names across shards"),
        (),
    ),
    "duplicate_tensor_no_index": (
        "one tensor in two shards (no index)",
        _duplicate_no_index,
        (EXPERT, "stored twice"),
        (),
    ),
    "index_names_missing_file": (
        "the index names a shard that does not exist",
        lambda s: shard_of(s, EXPERT).unlink(),
        (INDEX, "but the file does not exist"),
        (),
    ),
    "index_names_missing_tensor": (
        "the index names a tensor its shard lacks",
        lambda s: edit_index(
            s,
            lambda i: i["weight_map"].__setitem__(
                "model.layers.1.mlp.experts.99.up_proj.weight", i["weight_map"][EXPERT]
            ),
        ),
        ("model.layers.1.mlp.experts.99.up_proj.weight", "whose header does not have it"),
        (),
    ),
    "index_omits_a_stored_tensor": (
        "the index leaves out a tensor that is in a shard",
        lambda s: edit_index(s, lambda i: i["weight_map"].pop(EXPERT)),
        ("model-00001-of-00002.safetensors", EXPERT, f"but {INDEX} does not list it"),
        (),
    ),
    "index_corrupt": (
        "the index is not JSON",
        lambda s: (s / INDEX).write_text("{ nope"),
        (INDEX, "is not valid JSON", "expected a safetensors index"),
        (),
    ),
    "index_points_outside": (
        "the index names ../elsewhere.safetensors",
        lambda s: edit_index(s, lambda i: i["weight_map"].__setitem__(EXPERT, "../elsewhere.safetensors")),
        (EXPERT, "outside the model folder"),
        (),
    ),
    "index_file_not_a_string": (
        "the index gives a number as a tensor's file",
        lambda s: edit_index(s, lambda i: i["weight_map"].__setitem__(EXPERT, 7)),
        (EXPERT, "weight_map names 7, which is not a file name but a number"),
        (),
    ),
    "hub_blob_missing": (
        "a Hub-cache snapshot symlink whose blob is gone",
        _hub_cache_dangling,
        ("which does not exist", "Hub cache blob missing"),
        (),
    ),
    "config_missing": ("no config.json", lambda s: (s / "config.json").unlink(), ("no config.json",), ()),
    "config_corrupt": (
        "config.json not JSON",
        lambda s: (s / "config.json").write_text("{"),
        ("config.json", "is not valid JSON", "expected a JSON config file"),
        (),
    ),
    "config_more_experts": (
        "config says 16 routed experts, the checkpoint has 8",
        lambda s: edit_config(s, n_routed_experts=16),
        ("model.layers.1.mlp.gate.weight", "expected [16, H]"),
        (),
    ),
    "config_fewer_experts": (
        "config says 6 routed experts, the checkpoint has 8",
        lambda s: edit_config(s, n_routed_experts=6),
        ("model.layers.1.mlp.gate.weight", "expected [6, H]"),
        (),
    ),
    "config_wrong_expert_width": (
        "config's moe_intermediate_size contradicts the tensors",
        lambda s: edit_config(s, moe_intermediate_size=48),
        ("has shape [32, 64], expected [48, 64]",),
        (),
    ),
    "config_dense_layer_has_experts": (
        "config makes a layer dense that has experts",
        lambda s: edit_config(s, first_k_dense_replace=2),
        ("layer 1 dense", "but it has expert tensors"),
        (),
    ),
    "config_hidden_size_not_the_width": (
        "config's hidden_size is not the tensors' width",
        lambda s: edit_config(s, hidden_size=48),
        ("config.json", "field 'hidden_size'", "is 48", "the tensors are 64 wide"),
        (),
    ),
    "config_hidden_size_not_an_integer": (
        "config's hidden_size is 64.5",
        lambda s: edit_config(s, hidden_size=64.5),
        ("config.json", "field 'hidden_size'", "is 64.5, expected an integer"),
        (),
    ),
    "config_expert_count_written_as_float": (
        "config's expert count written 8.0",
        lambda s: edit_config(s, n_routed_experts=8.0),
        ("config.json", "field 'n_routed_experts'", "is 8.0", "without a decimal point"),
        (),
    ),
    "nan_in_expert": (
        "NaN in a BF16 expert weight (quantized)",
        lambda s: mutate(s, _poison(EXPERT, float("nan"))),
        (EXPERT, "non-finite values", "--allow-non-finite"),
        (),
    ),
    "inf_in_router": (
        "Inf in the router (upcast to float32)",
        lambda s: mutate(s, _poison(ROUTER, float("inf"))),
        (ROUTER, "non-finite values"),
        (),
    ),
    "nan_in_copied_tensor": (
        "NaN in a norm weight (copied unchanged)",
        lambda s: mutate(s, _poison(NORM, float("nan"))),
        (NORM, "non-finite values"),
        (),
    ),
    "nan_in_fp8_expert": (
        "NaN byte (0x7F) in an FP8 expert (bytes copied unchanged)",
        _fp8(lambda s: mutate(s, _poison_fp8_byte(EXPERT))),
        (EXPERT, "non-finite values"),
        (),
    ),
    "inf_in_fp8_scale": (
        "Inf in an FP8 weight's _scale_inv",
        _fp8(lambda s: mutate(s, _poison(EXPERT + "_scale_inv", float("inf"), 0))),
        (EXPERT + "_scale_inv", "non-finite values"),
        (),
    ),
    "zero_fp8_scale": (
        "a 0 in an FP8 weight's _scale_inv (copied unchanged)",
        _fp8(lambda s: mutate(s, _poison(EXPERT + "_scale_inv", 0.0, 0))),
        (EXPERT + "_scale_inv", "1 FP8 block scales that are 0 or negative"),
        (),
    ),
    "negative_fp8_scale": (
        "a negative FP8 _scale_inv (copied unchanged)",
        _fp8(lambda s: mutate(s, _poison(EXPERT + "_scale_inv", -0.01, 0))),
        (EXPERT + "_scale_inv", "0 or negative"),
        (),
    ),
    "negative_fp8_scale_in_a_cut": (
        "a negative _scale_inv of the shared expert (cut into slots)",
        _fp8(lambda s: mutate(s, _poison(SHARED_DOWN + "_scale_inv", -0.01, 0))),
        (SHARED_DOWN + "_scale_inv", "0 or negative"),
        (),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_input_is_refused_cleanly(case, src, tmp_path):
    _, make, fragments, extra = CASES[case]
    make(src)
    out = tmp_path / "out"
    code, stdout, stderr = run_cli("convert", src, out, "--quiet", *extra)
    assert_clean_refusal(code, stderr, out, *fragments)
    assert not out.exists(), f"OUT_DIR was created and left: {list(out.iterdir())}"


@pytest.mark.parametrize(
    "case", ["nan_in_expert", "inf_in_router", "nan_in_copied_tensor", "nan_in_fp8_expert", "inf_in_fp8_scale"]
)
def test_non_finite_values_convert_when_allowed(case, src, tmp_path):
    CASES[case][1](src)
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", src, out, "--quiet", "--allow-non-finite")
    assert code == 0, stderr
    assert (out / "config.json").exists()


def test_non_finite_mid_run_keeps_completed_shards_and_resumes(src, tmp_path):
    """NaN found after some shards are done: they are kept, nothing final-named; --resume --allow-non-finite finishes."""
    last_layer = "model.layers.2.mlp.experts.7.down_proj.weight"
    mutate(src, _poison(last_layer, float("nan")))
    out = tmp_path / "out"
    code, _, stderr = run_cli("convert", src, out, "--quiet", "--max-shard-size", "20KB")
    assert_clean_refusal(
        code, stderr, out, last_layer, "non-finite", "shards are complete and kept: rerun with --resume"
    )
    kept = int(re.search(r"\((\d+) of (\d+) shards", stderr).group(1))
    assert kept > 0 and len(list(out.glob(".*.done"))) == kept
    code, stdout, stderr = run_cli("convert", src, out, "--quiet", "--max-shard-size", "20KB", "--resume")
    assert code == 1 and last_layer in stderr  # still refused without the flag
    code, stdout, stderr = run_cli(
        "convert", src, out, "--quiet", "--max-shard-size", "20KB", "--resume", "--allow-non-finite"
    )
    assert code == 0, stderr
    assert f"resumed        {kept} of" in stdout
    ref = tmp_path / "ref"
    assert run_cli("convert", src, ref, "--quiet", "--max-shard-size", "20KB", "--allow-non-finite")[0] == 0
    from helpers import assert_identical

    assert_identical(out, ref)


def test_docs_table_lists_every_case():
    doc = (REPO / "docs" / "reliability.md").read_text()
    for case in CASES:
        assert f"`{case}`" in doc, f"docs/reliability.md has no row for {case}"
