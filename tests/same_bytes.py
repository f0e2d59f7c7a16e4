"""Do two trees of fuse-shared convert every test checkpoint to the same bytes?

    python tests/same_bytes.py /work/main .            # build the sources once, convert with both trees, compare

A refactor that must not change behaviour is checked here: the bundled example, a tiny checkpoint of every
supported family (BF16), and one of every source format (FP8 128x128 with float and ue8m0 scales, compressed-tensors
FP8 per channel, DeepSeek-V4's MXFP4 + E8M0 FP8, Kimi-K2.5's INT4 pack-quantized), each under the options that
reach its paths (--precision source, --other-linear keep), are converted by each tree in a process of its own; the
sha256 of every file written (every shard, config.json, the index, the manifest) must match. Exit status 0 when they
all do. Takes a few minutes on two cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "tiny-deepseek-v3"

# (source name, options): options are ConvertOptions fields.
RUNS = [("example", {}), ("example", {"precision": "source"}), ("example", {"other_linear": "keep"})]


def build_sources(root: Path) -> list[tuple[str, dict]]:
    """Every source under ``root/<name>``, and the conversions to run over them."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE / "integration"))
    from builders import build_checkpoint, to_compressed_tensors_channel, to_fp8_block
    from ig_helpers import CASES
    from kimi_k25_checkpoint import build_int4
    from v4_checkpoint import build_v4_checkpoint

    runs = list(RUNS)
    for family, kw in CASES.items():
        build_checkpoint(family, root / family, **kw)
        runs += [(family, {}), (family, {"precision": "source"})]
    for family in ("deepseek_v3", "deepseek_v2", "glm4_moe", "minimax_m3_text", "step3p7"):
        for fmt in ("float", "ue8m0"):
            name = f"{family}-fp8-{fmt}"
            build_checkpoint(family, root / name, **CASES[family])
            to_fp8_block(root / name, scale_fmt=fmt)
            runs += [(name, {}), (name, {"scale_fmt": "ue8m0" if fmt == "float" else "float"})]
    for family in ("glm4_moe", "glm4v_moe"):
        name = f"{family}-ct-channel"
        build_checkpoint(family, root / name, **CASES[family])
        to_compressed_tensors_channel(root / name)
        runs.append((name, {}))
    for style in ("flash", "0731"):
        build_v4_checkpoint(root / f"v4-{style}", style=style)
        runs.append((f"v4-{style}", {}))
    build_int4(root / "kimi-int4")
    runs += [("kimi-int4", {}), ("kimi-int4", {"other_linear": "keep"})]
    return runs


CONVERT = r"""
import hashlib, json, sys
from pathlib import Path
from fuse_tool.convert import convert_checkpoint
from fuse_tool.plan import ConvertOptions
root, example, out_root, runs = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4])
digests = {}
for i, (name, opts) in enumerate(runs):
    src = example if name == "example" else root / name
    out = out_root / f"{i}-{name}"
    key = f"{name} {json.dumps(opts, sort_keys=True)}"
    try:
        convert_checkpoint(src, out, ConvertOptions(**opts), progress=False)
    except Exception as e:
        digests[key] = {"error": f"{type(e).__name__}: {e}".replace(str(out_root), "OUT")}
        continue
    digests[key] = {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in sorted(out.rglob("*")) if p.is_file()}
print(json.dumps(digests))
"""


def convert_all(tree: Path, root: Path, runs: list, out_root: Path) -> dict:
    """sha256 of every file each conversion writes, converting with the code of ``tree`` (its own process)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CONVERT, str(root), str(EXAMPLE), str(out_root), json.dumps(runs)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"{tree}: conversions failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    a, b = (Path(p).resolve() for p in argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "sources"
        runs = build_sources(root)
        got = {tree: convert_all(tree, root, runs, Path(tmp) / f"out-{i}") for i, tree in enumerate((a, b))}
    differ = 0
    for key in got[a]:
        x, y = got[a][key], got[b].get(key)
        if x != y:
            differ += 1
            files = sorted(f for f in set(x) | set(y or {}) if (y or {}).get(f) != x.get(f))
            print(f"DIFFERENT {key}: {', '.join(files)}")
    for key, d in got[a].items():
        if "error" in d:
            print(f"refused: {key}: {d['error'][:200]}")
    files = sum(len(d) for d in got[a].values())
    errors = sum("error" in d for d in got[a].values())
    print(
        f"{len(runs)} conversions ({errors} refused the same way in both), {files} files: "
        + ("all the same bytes" if not differ else f"{differ} conversion(s) differ")
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
