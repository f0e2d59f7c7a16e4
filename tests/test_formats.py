"""runtime.formats: every stored layout is claimed by exactly one weight format, and each reads as float exactly.

One safetensors file holds one weight of every format the registry knows (and the refused and unknown cases); each is
recognised, checked and read through the registry, and compared with the format's definition written out here.
"""

from __future__ import annotations

import pytest
import torch

from kimi_k25_checkpoint import pack_int4, quantize_int4
from runtime.formats import REGISTRY, FormatError, recognise, stored_weight
from runtime.fp8 import dequantize_block_fp8, quantize_block_fp8
from runtime.integrations.transformers import ShardReader
from runtime.layout import LayoutError
from runtime.mxfp4 import dequantize_mxfp4
from test_fp8_tile32 import quantize_tile32, tile32_value
from test_nvfp4 import nvfp4_value, quantize_nvfp4
from v4_checkpoint import quantize_fp8_e8m0, quantize_mxfp4, write_safetensors

OUT, IN = 256, 192  # two row blocks, one and a half column blocks


def _weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(OUT, IN, generator=g) * 0.05
    t: dict[str, tuple[str, torch.Tensor]] = {"plain.weight": ("BF16", w.to(torch.bfloat16))}
    q, s = quantize_block_fp8(w)
    t["block.weight"], t["block.weight_scale_inv"] = ("F8_E4M3", q), ("F32", s)
    q, s = quantize_fp8_e8m0(w)
    t["e8m0.weight"], t["e8m0.scale"] = ("F8_E4M3", q), ("F8_E8M0", s)
    s = w.abs().amax(1, keepdim=True) / 448
    t["channel.weight"], t["channel.weight_scale"] = ("F8_E4M3", (w / s).to(torch.float8_e4m3fn)), ("F32", s)
    t["tensor.weight"], t["tensor.weight_scale"] = (
        ("F8_E4M3", (w / 0.01).to(torch.float8_e4m3fn)),
        ("F32", torch.tensor([0.01])),
    )
    codes = torch.randint(100, 140, (OUT, IN // 32), generator=g, dtype=torch.uint8)
    t["mxfp8.weight"], t["mxfp8.weight_scale_inv"] = ("F8_E4M3", (w * 20).to(torch.float8_e4m3fn)), ("U8", codes)
    packed, scales = quantize_mxfp4(w)
    t["mxfp4.weight"], t["mxfp4.scale"] = ("I8", packed), ("F8_E8M0", scales)
    iq, isc = quantize_int4(w, 32)
    t["int4.weight_packed"], t["int4.weight_scale"] = ("I32", pack_int4(iq)), ("BF16", isc)
    t["int4.weight_shape"] = ("I32", torch.tensor([OUT, IN], dtype=torch.int32))
    for part, v in quantize_nvfp4(w).items():
        t["nvfp4." + part] = v
    codes, tiles = quantize_tile32(w)
    t["tile32.weight"], t["tile32.scale"] = ("F8_E4M3", codes), ("F8_E8M0", tiles)
    t["bare.weight"] = ("F8_E4M3", q)  # FP8 without a scale: no format
    return w, t


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("formats")
    w, tensors = _weights()
    write_safetensors(d / "model.safetensors", tensors)
    (d / "config.json").write_text("{}")
    return ShardReader(d), tensors


EXPECTED = {
    "plain.weight": "float",
    "block.weight": "fp8-block",
    "e8m0.weight": "fp8-block",
    "channel.weight": "fp8-channel",
    "tensor.weight": "fp8-tensor",
    "mxfp8.weight": "mxfp8",
    "mxfp4.weight": "mxfp4",
    "int4.weight": "int4",
    "nvfp4.weight": "nvfp4",
    "tile32.weight": "fp8-tile32",
}


def test_every_format_is_exercised_and_claims_only_its_own(folder):
    reader, _ = folder
    assert {f.name for f in REGISTRY} == set(EXPECTED.values())
    for name, fmt in EXPECTED.items():
        claims = [f.name for f in REGISTRY if f.matches(reader.tensors, name)]
        assert claims == [fmt], (name, claims)
    assert recognise(reader.tensors, "bare.weight") is None
    with pytest.raises(FormatError, match="FP8 weight without its scale"):
        stored_weight(reader.tensors, "bare.weight")


def _defined(tensors, name):
    """The float32 value of each stored weight, from its format's definition."""
    dt, t = tensors[name]
    f32 = lambda n: tensors[n][1].float()  # noqa: E731
    base = name[: -len(".weight")]
    if base == "plain":
        return t.float()
    if base == "block":
        return dequantize_block_fp8(t, f32(name + "_scale_inv"))
    if base == "e8m0":
        return dequantize_block_fp8(t, torch.exp2(tensors["e8m0.scale"][1].float() - 127))
    if base in ("channel", "tensor"):
        return t.float() * f32(name + "_scale")
    if base == "mxfp8":
        return t.float() * torch.exp2(tensors[name + "_scale_inv"][1].float() - 127).repeat_interleave(32, 1)
    if base == "mxfp4":
        return dequantize_mxfp4(t, tensors["mxfp4.scale"][1])
    if base == "tile32":
        return tile32_value(t, tensors["tile32.scale"][1]).float()
    if base == "nvfp4":
        return nvfp4_value({k[len("nvfp4.") :]: v for k, v in tensors.items() if k.startswith("nvfp4.")})
    raise AssertionError(name)


@pytest.mark.parametrize("name", [n for n in EXPECTED if n != "int4.weight"])
def test_read_float_is_the_definition(folder, name):
    reader, tensors = folder
    assert torch.equal(reader.read_float(name, torch.float32, "cpu"), _defined(tensors, name))


def test_int4_reads_as_codes_times_group_scales(folder):
    reader, tensors = folder
    codes = (
        torch.stack([(tensors["int4.weight_packed"][1] >> (4 * i)) & 0xF for i in range(8)], -1).reshape(OUT, IN) - 8
    )
    want = codes.float() * tensors["int4.weight_scale"][1].float().repeat_interleave(32, 1)
    assert torch.equal(reader.read_float("int4.weight", torch.float32, "cpu"), want)
    assert "int4.weight" in reader.names() and "int4.weight_packed" not in reader.names()


def test_mxfp8_is_stored_with_its_group_scales(folder):
    reader, _ = folder
    stored = stored_weight(reader.tensors, "mxfp8.weight")
    got = (stored.format.name, stored.scale.name, stored.cols, stored.group)
    assert got == ("mxfp8", "mxfp8.weight_scale_inv", IN, 32)


def test_reader_names_the_folder_on_a_bad_int4_shape(tmp_path):
    _, t = _weights()
    t["int4.weight_shape"] = ("I32", torch.tensor([OUT + 1, IN], dtype=torch.int32))
    write_safetensors(tmp_path / "model.safetensors", t)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(LayoutError, match=f"int4.weight_shape says \\[{OUT + 1}, {IN}\\]"):
        ShardReader(tmp_path).read_float("int4.weight", torch.float32, "cpu")
