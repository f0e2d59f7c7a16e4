"""FP8 block quantization is exact IEEE math: equal, bit for bit, to an independent float64 reference,
the same on every path through the converter, and the same on CUDA as on the CPU.

The reference rounds with float64 arithmetic and a table of the e4m3 grid, not with torch's cast:
a float32 division rounded through float64 is the correctly rounded float32 quotient (53 >= 2*24 + 2
bits, so the double rounding is harmless), and the e4m3 code is the nearest grid value, ties to the
even code.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fuse_tool.write.transform as transform
from fuse_tool.write.writer import tensor_bytes
from runtime.fp8 import FLOAT32_TINY, FP8_MAX, quantize_block_fp8
from runtime.safetensors_io import SAFETENSORS_DTYPES, build_header

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()

# Every finite non-negative e4m3 value, by code (0x00 .. 0x7E).
E4M3_GRID = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


def _tricky(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random float32 weights whose blocks hold exact e4m3 ties (normal and subnormal), values that fall
    into e4m3's subnormal range, float32 subnormals, zeros, negative zeros and all-zero blocks."""
    g = torch.Generator().manual_seed(seed)
    w = (
        torch.randn(rows, cols, generator=g)
        * torch.exp2(torch.randint(-20, 20, (rows // 128 + 1, 1), generator=g).float()).repeat_interleave(128, 0)[:rows]
    )
    # Blocks of exact ties: amax 448 * 2^k gives the scale 2^k, and the midpoints of the e4m3 grid times 2^k are exact.
    mids = (E4M3_GRID[1:] + E4M3_GRID[:-1]) / 2
    n = min(rows, 128) * min(cols, 128)
    pick = mids[torch.randint(0, len(mids), (n,), generator=g)] * torch.where(
        torch.rand(n, generator=g) < 0.5, -1.0, 1.0
    )
    tie = pick.reshape(min(rows, 128), min(cols, 128)).float() * 2.0**-3
    tie[0, 0] = 448 * 2.0**-3
    w[: tie.shape[0], : tie.shape[1]] = tie
    if rows > 128 and cols > 128:
        w[128:256, 128:256] = 0.0  # a zero block: scale tiny / 448
        w[128, 129] = -0.0
        sub = torch.randn(128, 128, generator=g) * 1e-40  # float32 subnormal inputs
        w[128 : 128 + sub.shape[0], : min(cols, 128)] = sub[: min(rows - 128, 128), : min(cols, 128)]
    w[-1, : cols // 2] *= 1e-4  # quotients in e4m3's subnormal range inside otherwise normal blocks
    return w


def _reference(w: torch.Tensor, scale_fmt: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, scales float32) by float64 arithmetic and the e4m3 grid."""
    rows, cols = w.shape
    R, C = -(-rows // 128), -(-cols // 128)
    wp = torch.zeros(R * 128, C * 128, dtype=torch.float64)
    wp[:rows, :cols] = w.double()
    amax = wp.abs().reshape(R, 128, C, 128).amax(dim=(1, 3))
    scale = (torch.clamp(amax, min=FLOAT32_TINY) / FP8_MAX).float()  # float64 quotient rounded once more: exact
    if scale_fmt == "ue8m0":
        m, e = torch.frexp(scale.double())
        scale = torch.ldexp(torch.ones_like(scale, dtype=torch.float64), torch.where(m == 0.5, e - 1, e)).float()
    s = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    qf = (wp / s).float().double().clamp(-FP8_MAX, FP8_MAX)  # the float32 quotient, exactly
    mag = qf.abs()
    hi = torch.searchsorted(E4M3_GRID, mag).clamp(max=len(E4M3_GRID) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = mag - E4M3_GRID[lo], E4M3_GRID[hi] - mag
    code = torch.where(dlo < dhi, lo, torch.where(dhi < dlo, hi, torch.where(lo % 2 == 0, lo, hi)))
    code = code | torch.where(torch.signbit(qf), 0x80, 0)
    return code.to(torch.uint8)[:rows, :cols], scale


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (128, 7168 // 8), (1, 1)])
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_quantizer_equals_float64_reference_bit_for_bit(shape, scale_fmt):
    w = _tricky(*shape, seed=sum(shape))
    q, s = quantize_block_fp8(w, scale_fmt=scale_fmt)
    ref_q, ref_s = _reference(w, scale_fmt)
    assert torch.equal(s.view(torch.int32), ref_s.view(torch.int32))
    assert torch.equal(q.view(torch.uint8), ref_q)
    assert torch.equal(
        quantize_block_fp8(w.bfloat16(), scale_fmt=scale_fmt)[0].view(torch.uint8),
        _reference(w.bfloat16().float(), scale_fmt)[0],
    )


def test_quantizer_leaves_its_input_alone():
    w = torch.randn(256, 256)
    before = w.clone()
    quantize_block_fp8(w)
    assert torch.equal(w, before)


def _synth_bf16(path: Path, experts: int = 6, H: int = 384, I: int = 256, seed: int = 0) -> Path:
    """A small DeepSeek-V3-shaped BF16 checkpoint with distinct random experts (no transformers needed)."""
    path.mkdir(parents=True)
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": H,
        "moe_intermediate_size": I,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "num_hidden_layers": 1,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 0,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    P = "model.layers.0.mlp"
    tensors = {}
    for i, prefix in enumerate([f"{P}.experts.{e}" for e in range(experts)] + [f"{P}.shared_experts"]):
        for j, (p, shape) in enumerate({"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items()):
            tensors[f"{prefix}.{p}.weight"] = _tricky(*shape, seed=seed + 10 * i + j).bfloat16()
    g = torch.Generator().manual_seed(seed)
    tensors[f"{P}.gate.weight"] = torch.randn(experts, H, generator=g).bfloat16()
    tensors[f"{P}.gate.e_score_correction_bias"] = torch.zeros(experts)
    header, _ = build_header(
        [(k, SAFETENSORS_DTYPES[t.dtype], tuple(t.shape)) for k, t in tensors.items()], {"format": "pt"}
    )
    with open(path / "model.safetensors", "wb") as f:
        f.write(header)
        for t in tensors.values():
            f.write(tensor_bytes(t))
    return path


def _convert(src: Path, out: Path, *extra: str) -> dict[str, str]:
    """sha256 of every output file; the manifest's inputs_fingerprint is left out (it covers the options, --device included)."""
    r = subprocess.run(
        [sys.executable, "-m", "fuse_tool.cli", "convert", str(src), str(out), "--quiet", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}
    manifest = json.loads((out / "fuse_shared_manifest.json").read_text())
    assert manifest.pop("inputs_fingerprint")
    digests["fuse_shared_manifest.json"] = json.dumps(manifest, sort_keys=True)
    return digests


def test_strip_quantizer_equals_whole_tensor_quantizer(tmp_path, monkeypatch):
    """The threaded 128-row strip path (float sources on the CPU) and the generic path give the same bytes."""
    from fuse_tool.convert import convert_checkpoint
    from fuse_tool.plan import ConvertOptions

    src = _synth_bf16(tmp_path / "src", H=300, I=200)  # edge blocks in both directions
    convert_checkpoint(src, tmp_path / "strips", ConvertOptions(), progress=False)
    monkeypatch.setattr(transform, "_PLAIN", set())
    convert_checkpoint(src, tmp_path / "whole", ConvertOptions(), progress=False)
    names = sorted(f.name for f in (tmp_path / "strips").iterdir())
    assert names == sorted(f.name for f in (tmp_path / "whole").iterdir())
    for name in names:
        assert (tmp_path / "strips" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_quantizer_cuda_equals_cpu_bit_for_bit():
    for shape, fmt in [((1024, 7168), "float"), ((7168, 2048), "float"), ((300, 200), "ue8m0")]:
        w = _tricky(*shape, seed=shape[0])
        qc, sc = quantize_block_fp8(w, scale_fmt=fmt)
        qg, sg = quantize_block_fp8(w.cuda(), scale_fmt=fmt)
        assert torch.equal(sg.cpu().view(torch.int32), sc.view(torch.int32))
        assert torch.equal(qg.cpu().view(torch.uint8), qc.view(torch.uint8))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_convert_device_cuda_equals_device_cpu(tmp_path):
    src = _synth_bf16(tmp_path / "src", experts=8, H=512, I=384)
    cpu = _convert(src, tmp_path / "cpu", "--device", "cpu")
    gpu = _convert(src, tmp_path / "cuda", "--device", "cuda")
    assert gpu == cpu
