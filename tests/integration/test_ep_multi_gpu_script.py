"""benchmarks/ep_multi_gpu.py (issue 26's script) on the CPU: torchrun, 2 processes over gloo, on a toy DeepSeek-V4
built by bench_load's V4-Flash builder (a hash-routed layer and two score-routed ones). With the shared replica it says
PASS, for the hash layer and the plain ones; without it, FAIL and exit status 1. Every path runs: EP, the one-process
reference and its noise, device_map (over "cpu" alone), the summary table. (Two torchrun starts: about 30 s.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_load
import ep_multi_gpu

TIMEOUT_S = 240


def _run(checkpoint: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "benchmarks" / "ep_multi_gpu.py"), str(checkpoint), "--backend", "gloo", "--device", "cpu"]
    cmd += ["--dtype", "float32", "--batch", "2", "--seq", "16", "--new-tokens", "2", "--repeats", "1"]
    cmd += ["--out", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def v4_toy(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("ep-script-v4")
    args = ["--work", str(work), "--family", "deepseek-v4-flash", "--toy", "--moe-layers", "3"]
    res = bench_load.main([*args, "--build-only", "--device", "cpu"])
    assert not (work / "source").exists()  # --build-only leaves the converted folder alone
    return Path(res["converted"])


def test_v4_hash_layers_pass_with_the_replica_and_fail_without(v4_toy, tmp_path):
    good = _run(v4_toy, tmp_path / "v4.json")
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
    res = json.loads((tmp_path / "v4.json").read_text())
    assert res["hash_layers"] == [0] and res["env"]["NCCL_NVLS_ENABLE"] == "0"
    c = res["correctness"]
    assert c["verdict"] == "PASS" and "PASS: EP on 2" in good.stdout
    assert c["layers_by_routing"]["hash"]["ok"] and c["layers_by_routing"]["plain"]["layers"] == [1, 2]
    assert res["reference"] == "single" and res["device_map"]["devices"] == ["cpu"]
    assert res["ep"]["prefill_tok_s"] > 0 and res["ep"]["per_rank"][1]["all_reduce_calls_per_prefill"] == 3

    bad = _run(v4_toy, tmp_path / "v4-noreplica.json", "--no-shared-replica", "--no-placement")
    assert bad.returncode != 0 and "FAIL: EP on 2 (without the shared replica)" in bad.stdout
    broken = json.loads((tmp_path / "v4-noreplica.json").read_text())["correctness"]
    assert not broken["layers_by_routing"]["hash"]["ok"] and not broken["layers_by_routing"]["plain"]["ok"]
    assert broken["logits"]["rel_rms_diff"] > 100 * broken["logits"]["tolerance"]

    table = ep_multi_gpu.main(["--summary", str(tmp_path / "v4.json"), str(tmp_path / "v4-noreplica.json")])["summary"]
    assert table.count("| deepseek_v4 | 2 |") == 2 and "**PASS**" in table and "**FAIL**" in table
