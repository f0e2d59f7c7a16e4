"""``fuse-shared verify OUT_DIR [--checksums]``: headers against the index and the layout, sha256 against the manifest."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fuse_tool.files import JOURNAL_NAME

from helpers import run_cli

MANIFEST = "fuse_shared_manifest.json"
INDEX = "model.safetensors.index.json"
X = "model.layers.1.mlp.experts"


def verify(out, *extra):
    return run_cli("verify", out, "--quiet", *extra)


def shard_of(out, tensor):
    return out / json.loads((out / INDEX).read_text())["weight_map"][tensor]


def rewrite_tensors(out, fn):
    """Change tensors of a converted folder and keep index and manifest consistent with the new files,
    so that only the layout check can object."""
    index = json.loads((out / INDEX).read_text())
    wm = index["weight_map"]
    tensors = {}
    for shard in sorted(set(wm.values())):
        with safe_open(out / shard, "pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    fn(tensors, wm)
    manifest = json.loads((out / MANIFEST).read_text())
    total = 0
    for shard in sorted(set(wm.values())):
        part = {k: tensors[k].contiguous() for k, s in wm.items() if s == shard}
        save_file(part, str(out / shard), metadata={"format": "pt"})
        data = (out / shard).read_bytes()
        manifest["files"][shard] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        total += sum(t.numel() * t.element_size() for t in part.values())
    index["metadata"]["total_size"] = total
    (out / INDEX).write_text(json.dumps(index))
    data = (out / INDEX).read_bytes()
    manifest["files"][INDEX] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (out / MANIFEST).write_text(json.dumps(manifest))


def test_verify_passes_on_a_fresh_conversion(out):
    code, stdout, err = verify(out, "--checksums")
    assert code == 0, err
    assert "matches the manifest" in stdout
    code, stdout, err = verify(out)
    assert code == 0 and "pass --checksums" in stdout


def test_flipped_data_byte_is_found_by_checksums_only(out):
    f = shard_of(out, f"{X}.3.down_proj.weight")
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    assert verify(out)[0] == 0  # headers and sizes are still right
    code, _, err = verify(out, "--checksums")
    assert code == 1 and f.name in err and "sha256" in err and "damaged" in err


def _damage(kind):
    def truncated(out):
        f = shard_of(out, f"{X}.2.up_proj.weight")
        f.write_bytes(f.read_bytes()[:-100])
        return f.name, "truncated"

    def header(out):
        f = shard_of(out, f"{X}.2.up_proj.weight")
        data = bytearray(f.read_bytes())
        data[10:14] = b"!!!!"
        f.write_bytes(bytes(data))
        return f.name, "header"

    def missing(out):
        f = shard_of(out, f"{X}.2.up_proj.weight")
        f.unlink()
        return f.name, "missing"

    def no_manifest(out):
        (out / MANIFEST).unlink()
        return MANIFEST, "no fuse_shared_manifest.json"

    def manifest_size(out):
        m = json.loads((out / MANIFEST).read_text())
        name = sorted(m["files"])[0]
        m["files"][name]["size"] += 1
        (out / MANIFEST).write_text(json.dumps(m))
        return name, "differs from"

    def leftover_partial(out):
        (out / ".model-00003-of-00016.safetensors.partial").write_bytes(b"x")
        return ".partial", "did not finish"

    def journal(out):
        (out / JOURNAL_NAME).write_text("{}")
        return JOURNAL_NAME, "--resume"

    def no_config(out):
        (out / "config.json").unlink()
        return "config.json", "missing"

    def header_length(out):
        f = shard_of(out, f"{X}.2.up_proj.weight")
        data = bytearray(f.read_bytes())
        data[:8] = struct.pack("<Q", len(data) + 5)
        f.write_bytes(bytes(data))
        return f.name, "header"

    def header_length_short(out):  # the JSON still parses (padding spaces); every tensor would be read 4 bytes off
        f = shard_of(out, f"{X}.2.up_proj.weight")
        data = f.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        raw = data[8 : 8 + n].rstrip() + b" " * 8
        f.write_bytes(struct.pack("<Q", len(raw) - 4) + raw + data[8 + n :])
        return f.name, "of the data section"

    return locals()[kind]


@pytest.mark.parametrize(
    "kind",
    [
        "truncated",
        "header",
        "missing",
        "no_manifest",
        "manifest_size",
        "leftover_partial",
        "journal",
        "no_config",
        "header_length",
        "header_length_short",
    ],
)
def test_damaged_output_fails_verify(out, kind):
    where, what = _damage(kind)(out)
    code, _, err = verify(out, "--checksums")
    assert code == 1, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert where in err and what in err, err


@pytest.mark.parametrize(
    "edit,fragments",
    [
        (
            lambda t, wm: t.__setitem__(f"{X}.8.gate_proj.weight", t[f"{X}.8.gate_proj.weight"][:16].contiguous()),
            (f"{X}.8.gate_proj.weight", "has shape [16, 64], expected [32, 64]", "fused shared expert 8"),
        ),
        (
            lambda t, wm: t.__setitem__(f"{X}.0.down_proj.weight_scale_inv", torch.ones(2, 1)),
            (f"{X}.0.down_proj.weight_scale_inv", "has shape [2, 1], expected [1, 1]"),
        ),
        (
            lambda t, wm: t.__setitem__(f"{X}.0.down_proj.weight_scale_inv", torch.ones(1, 1, dtype=torch.bfloat16)),
            (f"{X}.0.down_proj.weight_scale_inv", "has dtype BF16, expected F32"),
        ),
        (lambda t, wm: t.__setitem__(f"{X}.gemm1_alpha", torch.ones(8)), (f"{X}.gemm1_alpha", "[9]")),
        (
            lambda t, wm: t.__setitem__(
                "model.layers.1.mlp.gate.weight", t["model.layers.1.mlp.gate.weight"].bfloat16()
            ),
            ("model.layers.1.mlp.gate.weight", "expected F32"),
        ),
        (
            lambda t, wm: t.__setitem__(f"{X}.4.up_proj.weight", t[f"{X}.4.up_proj.weight"].float() * 0),
            (f"{X}.4.up_proj.weight", "_scale_inv"),
        ),
    ],
)
def test_layout_violations_fail_verify(out, edit, fragments):
    rewrite_tensors(out, edit)
    code, _, err = verify(out, "--checksums")
    assert code == 1, err
    for f in fragments:
        assert f in err, err


def test_verify_against_is_not_swallowed(out):
    """--against belongs to the numerical check (issue 4); the structural part runs first either way."""
    (out / MANIFEST).unlink()
    code, _, err = verify(out, "--against", str(out))
    assert code == 1 and "no fuse_shared_manifest.json" in err


def test_verify_against_a_source_whose_index_omits_a_stored_tensor_fails(out, tiny_source, tmp_path):
    """The runtime's reader refuses a stored tensor the index leaves out, as convert does: loaders would drop it."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_source, src)
    index = json.loads((src / INDEX).read_text())
    gone = f"{X}.3.gate_proj.weight"
    shard = index["weight_map"].pop(gone)
    (src / INDEX).write_text(json.dumps(index))
    code, _, err = verify(out, "--against", src)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert shard in err and gone in err and "does not list it" in err, err


def _edit_config_keeping_manifest(out, fn):
    """Edit config.json as a hand-written checkpoint would, with its manifest entry updated: only the content checks
    can object."""
    cfg = json.loads((out / "config.json").read_text())
    fn(cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    data = (out / "config.json").read_bytes()
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"]["config.json"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (out / MANIFEST).write_text(json.dumps(manifest))


def _block(fn):
    return lambda c: fn(c["fused_shared_experts"])


@pytest.mark.parametrize(
    "edit,fragments",
    [
        (lambda c: c.update(hidden_size=48), ("field 'hidden_size'", "is 48", "the tensors are 64 wide")),
        (lambda c: c.update(hidden_size=64.5), ("field 'hidden_size'", "is 64.5, expected an integer")),
        (lambda c: c.update(n_routed_experts=8.0), ("field 'n_routed_experts'", "is 8.0", "without a decimal point")),
        (_block(lambda b: b["routing"].update(top_k=b["routing"]["top_k"] + 1)), ("routing.top_k is 3", "give 2")),
        (_block(lambda b: b["routing"].update(scoring="softmax")), ("routing.scoring is 'softmax'", "give 'sigmoid'")),
        (_block(lambda b: b["routing"].update(renormalize=not b["routing"]["renormalize"])), ("routing.renormalize",)),
        (
            _block(lambda b: b["routing"].update(routed_scaling_factor=b["routing"]["routed_scaling_factor"] * 2)),
            ("routing.routed_scaling_factor",),
        ),
        (_block(lambda b: b.update(weight_block_size=[64, 64])), ("weight_block_size is [64, 64]", "128x128")),
        (_block(lambda b: b.update(weight_block_size=None)), ("weight_block_size is", "null")),
    ],
    ids=[
        "hidden_size_not_the_width",
        "hidden_size_not_integer",
        "expert_count_float",
        "block_top_k",
        "block_scoring",
        "block_renormalize",
        "block_routed_scaling_factor",
        "block_weight_block_size",
        "block_weight_block_size_null",
    ],
)
def test_config_damage_fails_verify_even_when_written_by_hand(out, edit, fragments):
    _edit_config_keeping_manifest(out, edit)
    code, _, err = verify(out)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "config.json" in err, err
    for f in fragments:
        assert f in err, err
