"""check_output: every incompleteness gives a one-line message naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from checkpoints import E, S, write_converted_checkpoint
from fuse_tool.verify.integrity import (
    MANIFEST_NAME,
    VerifyError,
    check_output,
    read_safetensors_header,
)

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


def _edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _rewrite_header(path: Path, fn) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    fn(header)
    data, body = raw[8 + n :], bytearray()  # repack: the tensors must still cover the data section exactly
    for entry in sorted((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0]):
        b, e = entry["data_offsets"]
        entry["data_offsets"] = [len(body), len(body) + e - b]
        body += data[b:e]
    new = json.dumps(header).encode()
    new += b" " * ((8 - len(new) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + bytes(body))


def _expect(out: Path, *needles: str) -> str:
    with pytest.raises(VerifyError) as ei:
        check_output(out)
    msg = str(ei.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_complete_checkpoint(converted):
    c = check_output(converted)
    assert c.shards == (SHARD1, SHARD2)
    assert c.block.num_expert_slots == E + S
    assert set(c.moe_layers) == {1}
    assert c.total_size == json.loads((converted / INDEX).read_text())["metadata"]["total_size"]
    assert c.manifest.source == "deepseek-ai/Tiny-MoE"
    assert SHARD1 in c.files and MANIFEST_NAME in c.files
    assert c.weight_map["lm_head.weight"] == SHARD2
    # verify_checksums recomputes sha256 against the manifest
    check_output(converted, checksums=True)


def test_reads_headers_only(converted, monkeypatch):
    """The shards' tensor data is never read: only 8 bytes + the header of each."""
    import builtins

    reads: dict[str, int] = {}
    real_open = builtins.open

    class Counting:
        def __init__(self, f, name):
            self._f, self._name = f, name

        def read(self, n=-1):
            data = self._f.read(n)
            reads[self._name] = reads.get(self._name, 0) + len(data)
            return data

        def __getattr__(self, a):
            return getattr(self._f, a)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self._f.close()

    def fake_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        return Counting(f, Path(file).name) if str(file).endswith(".safetensors") else f

    monkeypatch.setattr(builtins, "open", fake_open)
    check_output(converted)
    for shard in (SHARD1, SHARD2):
        size = (converted / shard).stat().st_size
        assert 0 < reads[shard] < size / 4, (shard, reads[shard], size)


def test_no_config(converted):
    (converted / "config.json").unlink()
    _expect(converted, "config.json", "missing")


def test_no_fused_block(converted):
    _edit_json(converted / "config.json", lambda d: d.pop("fused_shared_experts"))
    _expect(converted, "config.json", "fused_shared_experts")


def test_bad_fused_block(converted):
    _edit_json(converted / "config.json", lambda d: d["fused_shared_experts"].update(num_fused_shared_experts=3))
    _expect(converted, "config.json", "num_fused_shared_experts=3")


def test_no_index(converted):
    (converted / INDEX).unlink()
    _expect(converted, INDEX, "model.safetensors")


def test_shard_missing(converted):
    (converted / SHARD2).unlink()
    _expect(converted, SHARD2, "missing")


def test_shard_header_unreadable(converted):
    (converted / SHARD1).write_bytes(b"\x00\x01garbage")
    _expect(converted, SHARD1, "header unreadable")
    (converted / SHARD1).write_bytes(struct.pack("<Q", 40) + b"{not json" + b" " * 31)
    _expect(converted, SHARD1, "header unreadable")


def test_shard_truncated(converted):
    p = converted / SHARD2
    p.write_bytes(p.read_bytes()[:-100])
    _expect(converted, SHARD2, "truncated")


def test_shard_lacks_indexed_tensor(converted):
    _edit_json(converted / INDEX, lambda d: d["weight_map"].update({"model.extra.weight": SHARD1}))
    _expect(converted, SHARD1, "model.extra.weight")


def test_shard_holds_unindexed_tensor(converted):
    _edit_json(converted / INDEX, lambda d: d["weight_map"].pop("model.norm.weight"))
    _expect(converted, SHARD1, "model.norm.weight", "does not assign")


def test_total_size_mismatch(converted):
    _edit_json(converted / INDEX, lambda d: d["metadata"].update(total_size=d["metadata"]["total_size"] + 2))
    _expect(converted, INDEX, "total_size")


@pytest.mark.parametrize(
    "name",
    [
        ".model-00002-of-00002.safetensors.tmp.1234",
        ".model-00002-of-00002.safetensors.partial",
        ".config.json.partial",
        ".tokenizer.json.0123456789abcdef.partial",
    ],
)
def test_leftover_temporary_file(converted, name):
    (converted / name).write_bytes(b"partial")
    _expect(converted, name, "temporary")


def test_conversion_still_running(converted):
    (converted / ".fuse-shared.lock").write_bytes(b"")
    _expect(converted, ".fuse-shared.lock", "still running")


def test_moe_layer_missing(converted):
    _edit_json(converted / "config.json", lambda d: d["fused_shared_experts"].update(moe_layers=[1, 3]))
    _expect(converted, "MoE layer 3", "moe_layers")


def test_shared_slot_missing(converted):
    """A layer whose fused shared slot (expert E) is absent is incomplete."""
    name = f"model.layers.1.mlp.experts.{E}.up_proj.weight"

    def drop(h):
        h.pop(name)

    _rewrite_header(converted / SHARD2, drop)
    _edit_json(converted / INDEX, lambda d: d["weight_map"].pop(name))
    # total_size now disagrees too, fix it so that the layer check is what fails
    tensors, _ = read_safetensors_header(converted / SHARD1)
    t2, _ = read_safetensors_header(converted / SHARD2)
    total = sum(t.nbytes for t in {**tensors, **t2}.values())
    _edit_json(converted / INDEX, lambda d: d["metadata"].update(total_size=total))
    _expect(converted, name, "fused shared expert 4")


def test_manifest_size_mismatch(converted):
    p = converted / "tokenizer.json"
    p.write_text(p.read_text() + " ")
    _expect(converted, "tokenizer.json", MANIFEST_NAME)


def test_manifest_lists_missing_file(converted):
    (converted / "tokenizer.json").unlink()
    _expect(converted, "tokenizer.json", "missing")


def test_single_file_checkpoint(tmp_path):
    out = write_converted_checkpoint(tmp_path / "single")
    from safetensors.torch import load_file, save_file

    merged = {**load_file(str(out / SHARD1)), **load_file(str(out / SHARD2))}
    for f in (SHARD1, SHARD2, INDEX, MANIFEST_NAME):
        (out / f).unlink()
    save_file(merged, str(out / "model.safetensors"), metadata={"format": "pt"})
    c = check_output(out, require_manifest=False)  # a hand-assembled single-file folder: no manifest
    assert c.shards == ("model.safetensors",) and c.index_file is None


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda c: c.update(architectures=["DeepseekV3ForCausalLM"]), "architectures names 'DeepseekV3ForCausalLM'"),
        (lambda c: c["quantization_config"].update(quant_method="fp8"), 'quant_method is "fp8"'),
        (lambda c: c.pop("quantization_config"), "quant_method is null"),
    ],
)
def test_a_config_that_a_stock_engine_would_load_as_the_source_is_refused(converted, edit, words):
    """A converted config under the source's names would be run by a stock engine without its shared slots (vLLM 0.32
    skips a GLM-4.5's experts.12): the check refuses it, naming config.json and the field."""
    _edit_json(converted / "config.json", edit)
    with pytest.raises(VerifyError) as e:
        check_output(converted)
    assert "config.json" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)
