"""benchmarks/bench_load.py at toy size on the CPU: the whole flow (write, convert, plain read, three loads) runs, the
placements give the same tokens, and keep_fp8 holds fewer bytes than the dequantized load."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_load  # noqa: E402


def test_bench_load_toy_on_cpu(tmp_path):
    res = bench_load.main(
        [
            "--work",
            str(tmp_path),
            "--toy",
            "--device",
            "cpu",
            "--moe-layers",
            "1",
            "--new-tokens",
            "2",
            "--out",
            str(tmp_path / "res.json"),
        ]
    )
    assert (tmp_path / "res.json").is_file() and res["same_tokens"] and len(res["runs"]) == 3
    before, after, _ = (r["bytes_by_device"]["cpu"] for r in res["runs"])
    assert after < before and res["plain_read_gbps"] > 0 and res["shard_bytes"] > 0


def test_release_names_at_real_widths_match_the_inventory():
    cfg = bench_load.base_config(False)
    tensors = bench_load.release_tensors(cfg, 5)
    assert bench_load.fixture_dir() is None or bench_load.check_against_inventory(tensors, 5)


def test_v4_flash_release_at_real_widths_matches_the_inventory():
    """3 hash-routed + 2 score-routed layers of DeepSeek-V4-Flash: names, dtypes and shapes (no data is made)."""
    cfg = bench_load.cut_config(bench_load.base_config(False, "deepseek-v4-flash"), "deepseek-v4-flash", 5)
    tensors = bench_load.family_tensors(cfg, "deepseek-v4-flash")
    assert ("layers.0.ffn.gate.tid2eid", "I64", (129280, 6)) in tensors
    assert ("layers.4.ffn.experts.255.w2.weight", "I8", (4096, 1024)) in tensors
    assert not any(n.startswith("layers.3.ffn.gate.tid2eid") for n, _, _ in tensors)
    fx = bench_load.fixture_dir("deepseek-v4-flash")
    assert fx is None or bench_load.check_against_inventory(tensors, 5, "deepseek-v4-flash")
    if fx is not None:  # the embedded config is the release's
        release = json.loads((fx / "config.json").read_text())
        assert {k: v for k, v in release.items() if k != "transformers_version"} == cfg | {
            "num_hidden_layers": 43,
            "num_nextn_predict_layers": 1,
            "compress_ratios": bench_load.V4_FLASH_WIDTHS["compress_ratios"],
        }


def test_v4_toy_build_converts_and_runs_in_bfloat16(tmp_path):
    """--build-only writes, converts (FP8 routed experts) and drops the source; the model runs in bfloat16 (its
    compressor projections stay bfloat16: transformers' non-strict fp32 list applies to float16 only)."""
    import torch

    from runtime.integrations.transformers import from_fused_pretrained

    res = bench_load.main(
        ["--work", str(tmp_path), "--family", "deepseek-v4-flash", "--toy", "--moe-layers", "3", "--build-only"]
        + ["--device", "cpu", "--out", str(tmp_path / "build.json")]
    )
    assert not (tmp_path / "source").exists() and json.loads((tmp_path / "build.json").read_text()) == res
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert config["fused_shared_experts"]["routing"]["hash_layers"] == [0]
    model = from_fused_pretrained(res["converted"], dtype=torch.bfloat16, keep_fp8=True)
    logits = model(torch.randint(0, config["vocab_size"], (2, 8))).logits
    assert logits.dtype == torch.bfloat16 and logits.isfinite().all() and logits.float().std() > 0
