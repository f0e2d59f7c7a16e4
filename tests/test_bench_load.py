"""benchmarks/bench_load.py at toy size on the CPU: the whole flow (write, convert, plain read, three loads) runs, the
placements give the same tokens, and keep_fp8 holds fewer bytes than the dequantized load."""

from __future__ import annotations

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
