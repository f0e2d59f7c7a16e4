"""Hostile file names fuzzed with hypothesis (issue 36, item 4): nothing outside the folder is opened or removed.

Each example puts one generated name (absolute, ``..``, a symlink or a symlinked folder leading out, NUL,
thousands of bytes, a lone surrogate as undecodable bytes become, any other text) where a checkpoint
names a file: the source's index (then convert, inspect or ``verify --against`` reads it), the converted
index (verify, ``ModelFolder``, ``from_fused_pretrained``), the manifest (``verify --checksums``,
``convert --overwrite``), or an unfinished run's journal (``--overwrite``, ``--resume``). Next to the
folders lies ``outside/``, holding a real shard and a file to lose. An audit hook records every open and
every removal or rename under ``outside/``: there must be none, the files there keep their bytes, and each
command either succeeds or ends in one line naming a file, never "internal error ... a bug".

Deterministic (``derandomize``) and kept small (80 examples, a few seconds each at most).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuse_tool.files import JOURNAL_NAME, MANIFEST_NAME
from fuse_tool.plan import ConvertOptions
from runtime.errors import FuseSharedError

from helpers import Accesses, interrupted_conversion, run_cli

INDEX = "model.safetensors.index.json"
OPTS = ConvertOptions(max_shard_size=20_000)
FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
OPS = {
    "source_index": ("convert", "inspect", "verify_against"),
    "output_index": ("verify", "load_folder", "from_fused_pretrained"),
    "manifest": ("verify_checksums", "overwrite"),
    "journal": ("overwrite", "resume"),
}

# (name, links to make in the folder first: {relative name: "outside/<file>" or "outside"})
HOSTILE = st.one_of(
    st.just(("{outside}/secret.safetensors", {})),
    st.sampled_from(
        ["../outside/secret.safetensors", "sub/../../outside/victim.txt", "../../outside/secret.safetensors", ".."]
    ).map(lambda n: (n, {})),
    st.just(("link.safetensors", {"link.safetensors": "outside/secret.safetensors"})),
    st.just(("victim.txt", {"victim.txt": "outside/victim.txt"})),
    st.just(("d/secret.safetensors", {"d": "outside"})),
    st.text(max_size=8).map(lambda t: (t + "\0x.safetensors", {})),
    st.integers(256, 6000).map(lambda n: ("a" * n + ".safetensors", {})),
    st.text(max_size=8).map(lambda t: (t + "\udcff.safetensors", {})),
    st.text(max_size=24).map(lambda t: (t, {})),
)


@pytest.fixture(scope="module")
def material(tiny_source, tiny_converted, tmp_path_factory):
    """A finished conversion and an interrupted one of ``tiny_source``, built once, copied per example."""
    unfinished = tmp_path_factory.mktemp("fuzz-paths") / "unfinished"
    interrupted_conversion(tiny_source, unfinished, OPTS)
    return tiny_source, tiny_converted, unfinished


def _place(target: str, name: str, folder: Path) -> None:
    """Write ``name`` where ``target`` names files in ``folder``."""
    if target in ("source_index", "output_index"):
        index = json.loads((folder / INDEX).read_text())
        first = sorted(index["weight_map"])[0]
        index["weight_map"][first] = name
        (folder / INDEX).write_text(json.dumps(index))
    elif target == "manifest":
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        manifest["files"][name] = {"size": 8, "sha256": "0" * 64}
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    else:
        journal = json.loads((folder / JOURNAL_NAME).read_text())
        journal["outputs"].append(name)
        journal["completed"][name] = {"size": 8, "sha256": "0" * 64}
        (folder / JOURNAL_NAME).write_text(json.dumps(journal))


def _run(op: str, src: Path, out: Path) -> None:
    """One command; a refusal must be one line naming a file (never a bug report)."""
    if op in ("load_folder", "from_fused_pretrained"):
        from runtime.checkpoint import ModelFolder
        from runtime.integrations.transformers import from_fused_pretrained

        try:
            (ModelFolder if op == "load_folder" else from_fused_pretrained)(out)
        except FuseSharedError as e:
            assert "\n" not in str(e) and "a bug" not in str(e), str(e)
        return
    args = {
        "convert": ("convert", src, out.parent / "new", "--quiet"),
        "inspect": ("inspect", src),
        "verify_against": ("verify", out, "--against", src, "--quiet"),
        "verify": ("verify", out, "--quiet"),
        "verify_checksums": ("verify", out, "--checksums", "--quiet"),
        "overwrite": ("convert", src, out, "--quiet", "--max-shard-size", "20KB", "--overwrite"),
        "resume": ("convert", src, out, "--quiet", "--max-shard-size", "20KB", "--resume"),
    }[op]
    code, _, err = run_cli(*args)
    if code != 0:
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
        assert "internal error" not in err and "a bug" not in err and "Traceback" not in err, err


@FUZZ
@given(hostile=HOSTILE, target_op=st.sampled_from([(t, op) for t, ops in OPS.items() for op in ops]))
def test_no_path_outside_the_folder_is_opened_or_removed(material, hostile, target_op):
    name_template, links = hostile
    target, op = target_op
    base_src, done, unfinished = material
    with tempfile.TemporaryDirectory(prefix="fuzz-paths-") as tmp:
        tmp = Path(tmp)
        src, outside = tmp / "src", tmp / "outside"
        shutil.copytree(base_src, src)
        out = tmp / "out"
        shutil.copytree(unfinished if target == "journal" else done, out)
        outside.mkdir()
        shutil.copy(sorted(base_src.glob("*.safetensors"))[0], outside / "secret.safetensors")
        (outside / "victim.txt").write_text("precious")
        before = {p.name: p.read_bytes() for p in outside.iterdir()}
        folder = src if target == "source_index" else out
        for rel, where in links.items():
            (folder / rel).unlink(missing_ok=True)
            (folder / rel).symlink_to(tmp / where, target_is_directory=where == "outside")
        _place(target, name_template.replace("{outside}", str(outside)), folder)
        with Accesses(outside) as seen:
            _run(op, src, out)
        assert seen.opened == [], seen.opened
        assert seen.removed == [], seen.removed
        assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
