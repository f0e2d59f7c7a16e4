"""Nothing hangs, nothing is walked that is not the checkpoint, no option sizes an unbounded allocation.

- A FIFO, socket, device or folder where a shard, config.json or the index should be is refused at
  once with one line naming the file (a FIFO would otherwise block the open forever: a watchdog
  thread opens each FIFO for writing and records whether a reader was waiting on it).
- Walks of OUT_DIR (verify, push) never descend into a symlinked folder.
- Every option that sizes an allocation is bounded: one line, exit 2, no traceback.
- ``verify --against`` without transformers names the extra to install.

Every case is a row of docs/reliability.md's table "Hangs, special files and option bounds".
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import shutil
import socket
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from fuse_tool.cli import main
from helpers import REPO, assert_clean_refusal, run_cli

INDEX = "model.safetensors.index.json"


@contextlib.contextmanager
def fifo_watchdog(*fifos: Path):
    """Yields a list that gets a FIFO's name when some reader opened it (and would have blocked).

    While the block runs, each FIFO is opened for writing without blocking every 20 ms: that
    succeeds only when a reader has it open, and then releases that reader (it reads EOF), so a
    regression fails the test instead of hanging it.
    """
    opened: list[str] = []
    stop = threading.Event()

    def watch():
        while not stop.wait(0.02):
            for p in fifos:
                try:
                    fd = os.open(p, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    continue  # ENXIO: no reader
                opened.append(p.name)
                os.close(fd)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield opened
    finally:
        stop.set()
        t.join(timeout=5)


def first_shard(src: Path) -> str:
    return sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))[0]


def _make_fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


def _make_socket(p: Path) -> socket.socket:
    p.unlink()
    s = socket.socket(socket.AF_UNIX)
    cwd = os.getcwd()
    os.chdir(p.parent)  # AF_UNIX paths are limited to ~108 bytes: bind the short relative name
    try:
        s.bind(p.name)
    finally:
        os.chdir(cwd)
    return s


def _replace_with_link(p: Path, target: str) -> None:
    p.unlink()
    p.symlink_to(target)


def _replace_with_zero_device(p: Path) -> None:
    """A character device node (the one /dev/zero is) in the model folder itself: a symlink to /dev/zero would be
    refused earlier, as a file outside the model folder."""
    p.unlink()
    try:
        os.mknod(p, stat.S_IFCHR | 0o444, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("making a device node needs root")


# ----------------------------------------------------------------------------- MODEL: special files

SOURCE_CASES = {
    # name: (what is replaced, how, fragments of the one-line error)
    "shard_is_fifo": (
        "shard",
        _make_fifo,
        ("is a named pipe (FIFO), not a regular file", "expected a safetensors file"),
    ),
    "shard_is_fifo_no_index": ("shard-noindex", _make_fifo, ("is a named pipe (FIFO), not a regular file",)),
    "config_is_fifo": (
        "config.json",
        _make_fifo,
        ("config.json: is a named pipe (FIFO), not a regular file", "expected a JSON config file"),
    ),
    "index_is_fifo": (
        INDEX,
        _make_fifo,
        (f"{INDEX}: is a named pipe (FIFO), not a regular file", "expected a safetensors index"),
    ),
    "shard_is_socket": ("shard", _make_socket, ("is a socket, not a regular file",)),
    "shard_is_char_device": ("shard", _replace_with_zero_device, ("is a character device, not a regular file",)),
    "shard_is_folder": ("shard", lambda p: (p.unlink(), p.mkdir()), ("is a directory, not a regular file",)),
    "config_is_folder": (
        "config.json",
        lambda p: (p.unlink(), p.mkdir()),
        ("config.json: is a directory, not a regular file",),
    ),
}


@pytest.mark.parametrize("case", sorted(SOURCE_CASES))
def test_special_file_in_model_is_refused_at_once(case, src, tmp_path):
    which, make, fragments = SOURCE_CASES[case]
    if which == "shard-noindex":  # the shards are found by *.safetensors, not by the index
        (src / INDEX).unlink()
        name = sorted(p.name for p in src.glob("*.safetensors"))[0]
    else:
        name = first_shard(src) if which == "shard" else which
    target = src / name
    keep = make(target)
    out = tmp_path / "out"
    try:
        with fifo_watchdog(*[p for p in src.iterdir() if p.is_fifo()]) as opened:
            code, _, stderr = run_cli("convert", src, out, "--quiet")
    finally:
        if isinstance(keep, socket.socket):
            keep.close()
    assert opened == [], f"{opened} was opened for reading (a blocking open would hang)"
    assert_clean_refusal(code, stderr, out, str(target), *fragments)
    assert not out.exists()


# ----------------------------------------------------------------------------- OUT_DIR: special files, symlinked folders


@pytest.fixture(scope="module")
def converted_out(tmp_path_factory, tiny_source):
    out = tmp_path_factory.mktemp("conv") / "out"
    code, _, err = run_cli("convert", tiny_source, out, "--quiet", "--max-shard-size", "100KB")
    assert code == 0, err
    return out


@pytest.fixture
def out(tmp_path, converted_out):
    dst = tmp_path / "out"
    shutil.copytree(converted_out, dst)
    return dst


OUT_CASES = {
    "verify_config_is_fifo": ("config.json", "config.json: is a named pipe (FIFO), not a regular file"),
    "verify_index_is_fifo": (INDEX, f"{INDEX}: is a named pipe (FIFO), not a regular file"),
    "verify_shard_is_fifo": ("shard", "is a named pipe (FIFO), not a regular file"),
}


@pytest.mark.parametrize("case", sorted(OUT_CASES))
def test_special_file_in_out_dir_is_refused_by_verify(case, out):
    which, fragment = OUT_CASES[case]
    target = out / (first_shard(out) if which == "shard" else which)
    _make_fifo(target)
    with fifo_watchdog(target) as opened:
        code, stdout, stderr = run_cli("verify", out, "--checksums", "--quiet")
    assert opened == [], f"{opened} was opened for reading (a blocking open would hang)"
    assert code == 1 and stdout == "", (code, stdout, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    assert str(target) in stderr and fragment in stderr, stderr


def test_walks_of_out_dir_do_not_follow_symlinked_folders(out, tmp_path):
    """A link to the folder itself (a loop) and to a private folder outside: neither is walked or hashed."""
    from fuse_tool.verify.integrity import check_output, list_checkpoint_files

    before = list_checkpoint_files(out)
    private = tmp_path / "private"
    private.mkdir()
    (private / "id_rsa").write_text("secret\n")
    (out / "loop").symlink_to(".", target_is_directory=True)
    (out / "elsewhere").symlink_to(private, target_is_directory=True)

    files = list_checkpoint_files(out)
    assert files == before
    assert not any(k.startswith(("loop/", "elsewhere/")) for k in files)
    assert check_output(out, checksums=True).files == before
    code, stdout, stderr = run_cli("verify", out, "--checksums", "--quiet")
    assert code == 0 and stdout.startswith("ok: "), (code, stdout, stderr)


@pytest.mark.parametrize("inside", [True, False], ids=["link_inside", "link_outside"])
def test_shard_behind_a_symlinked_folder_is_not_followed(out, tmp_path, inside):
    """The index names sub/SHARD and sub is a link to a folder that has it: refused, not followed (a link leading out of
    the folder is refused by the resolver before the shard is opened)."""
    shard = first_shard(out)
    elsewhere = (out / "inner") if inside else (tmp_path / "elsewhere")
    elsewhere.mkdir()
    (out / shard).rename(elsewhere / shard)
    (out / "sub").symlink_to(elsewhere, target_is_directory=True)
    index = json.loads((out / INDEX).read_text())
    index["weight_map"] = {k: (f"sub/{v}" if v == shard else v) for k, v in index["weight_map"].items()}
    (out / INDEX).write_text(json.dumps(index))
    code, _, stderr = run_cli("verify", out, "--quiet")
    assert code == 1 and len(stderr.strip().splitlines()) == 1, stderr
    if inside:
        assert f"sub/{shard}: shard named by {INDEX} lies behind a symlinked folder, which is not followed" in stderr
    else:
        assert f"sub/{shard}: is a symlink to {str(elsewhere / shard)!r}, outside the model folder" in stderr


# ----------------------------------------------------------------------------- options that size allocations

BOUND_CASES = {
    # name: (argv after the command, fragments of the one-line error)
    "max_shard_size_bare_number": (
        ["convert", "SRC", "OUT", "--max-shard-size", "5"],
        ("--max-shard-size", "'5' is 5 bytes, expected at least 4KiB", "5GB?"),
    ),
    "max_shard_size_zero": (
        ["convert", "SRC", "OUT", "--max-shard-size", "0GB"],
        ("--max-shard-size", "expected at least 4KiB"),
    ),
    "max_shard_size_over_50GB": (
        ["convert", "SRC", "OUT", "--max-shard-size", "1TB"],
        ("--max-shard-size", "'1TB' is 1000000000000 bytes, expected at most 50GB"),
    ),
    "max_shard_size_400_digits": (
        ["convert", "SRC", "OUT", "--max-shard-size", "9" * 400 + "GB"],
        ("--max-shard-size", "is not a size like 5GB or 512MiB"),
    ),
    "max_shard_size_negative": (
        ["convert", "SRC", "OUT", "--max-shard-size", "-5GB"],
        ("--max-shard-size", "is not a size like 5GB"),
    ),
    "max_shard_size_inspect": (
        ["inspect", "SRC", "--max-shard-size", "2TiB"],
        ("--max-shard-size", "expected at most 50GB"),
    ),
    "tokens_too_many": (
        ["verify", "OUT", "--against", "SRC", "--tokens", "64x4096"],
        ("--tokens", "'64x4096' is 262144 tokens, expected at most 4096"),
    ),
    "tokens_zero": (
        ["verify", "OUT", "--against", "SRC", "--tokens", "0x32"],
        ("--tokens", "batch and sequence length must be at least 1"),
    ),
    "tokens_huge_digits": (
        ["verify", "OUT", "--against", "SRC", "--tokens", "1x" + "9" * 5000],
        ("--tokens", "is not BATCHxSEQ"),
    ),
    "tokens_malformed": (
        ["verify", "OUT", "--against", "SRC", "--tokens", "4by32"],
        ("--tokens", "is not BATCHxSEQ (e.g. 4x32)"),
    ),
    "seed_out_of_range": (
        ["verify", "OUT", "--against", "SRC", "--seed", str(2**70)],
        ("--seed", "is not in the range"),
    ),
    "seed_negative": (["verify", "OUT", "--against", "SRC", "--seed", "-1"], ("--seed", "is not in the range")),
    "min_top1_nan": (
        ["verify", "OUT", "--against", "SRC", "--min-top1", "nan"],
        ("--min-top1", "'nan' is not a number from 0 to 1"),
    ),
    "max_moe_err_negative": (
        ["verify", "OUT", "--against", "SRC", "--max-moe-err", "-0.1"],
        ("--max-moe-err", "from 0 to inf"),
    ),
    "unknown_option": (["convert", "SRC", "OUT", "--max-shard", "5GB"], ("No such option",)),
    "missing_argument": (["convert", "SRC"], ("Missing argument 'OUT_DIR'",)),
}


@pytest.mark.parametrize("case", sorted(BOUND_CASES))
def test_option_out_of_bounds_is_one_line(case, tiny_source, tmp_path):
    argv, fragments = BOUND_CASES[case]
    out = tmp_path / "out"
    out.mkdir()
    argv = [str(tiny_source) if a == "SRC" else str(out) if a == "OUT" else a for a in argv]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr and "Usage:" not in r.stderr
    for f in fragments:
        assert f in r.stderr, (f, r.stderr)
    assert list(out.iterdir()) == []  # nothing planned, nothing written


def test_bounds_of_max_shard_size_are_inclusive(tiny_source, tmp_path):
    """4KiB and 50GB themselves are accepted (the planner runs: --dry-run prints the plan)."""
    for size in ("4KiB", "50GB"):
        code, stdout, stderr = run_cli("convert", tiny_source, tmp_path / "out", "--dry-run", "--max-shard-size", size)
        assert code == 0 and "dry run: nothing written" in stdout, (size, stderr)


def test_default_tokens_and_largest_allowed_parse():
    from fuse_tool.verify.numerics import MAX_VERIFY_TOKENS, parse_tokens

    assert parse_tokens("4x32") == (4, 32)
    assert parse_tokens(f"1x{MAX_VERIFY_TOKENS}") == (1, MAX_VERIFY_TOKENS)


def test_timeout_variable_not_a_number_is_one_line(tmp_path):
    """huggingface_hub parses HF_HUB_DOWNLOAD_TIMEOUT with int() at import: a bad value is named first."""
    import subprocess

    env = {**os.environ, "HF_HUB_DOWNLOAD_TIMEOUT": "1.5", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "fuse_tool.cli", "convert", "alice/some-model", str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert (
        r.stderr.strip() == "error: HF_HUB_DOWNLOAD_TIMEOUT='1.5': expected a whole number of seconds from 1 to 86400"
    ), r.stderr


# ----------------------------------------------------------------------------- verify --against without transformers


def test_verify_against_without_transformers_names_the_extra(monkeypatch, converted_out, tiny_source):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    code, stdout, stderr = run_cli("verify", converted_out, "--against", tiny_source, "--quiet")
    assert code == 1 and stdout == "", (code, stdout, stderr)
    assert stderr.strip() == (
        "error: --against needs transformers >= 5.25, which is not installed: pip install 'fuse-shared[verify]'"
    ), stderr


def test_verify_against_with_old_transformers_names_the_extra(monkeypatch, converted_out, tiny_source):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.24.9")
    code, _, stderr = run_cli("verify", converted_out, "--against", tiny_source, "--quiet")
    assert code == 1
    assert (
        stderr.strip() == "error: --against needs transformers >= 5.25, found 5.24.9: pip install 'fuse-shared[verify]'"
    ), stderr


def test_verify_extra_is_declared():
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert "transformers>=5.25" in extras["verify"] and "transformers>=5.25" in extras["test"]
    from fuse_tool.verify.numerics import TRANSFORMERS_MIN

    assert TRANSFORMERS_MIN == (5, 25), "verify's own check asks for the extra's floor"
    assert not any(d.startswith("transformers") for d in project["dependencies"])


def test_docs_table_lists_every_case():
    doc = (REPO / "docs" / "reliability.md").read_text()
    section = doc.split("### Hangs, special files and option bounds", 1)[1].split("\n## ", 1)[0]
    for case in [*SOURCE_CASES, *OUT_CASES, *BOUND_CASES]:
        assert f"[{case}]`" in section or f"`{case}`" in section, f"docs/reliability.md has no row for {case}"
    for test in (
        "test_walks_of_out_dir_do_not_follow_symlinked_folders",
        "test_shard_behind_a_symlinked_folder_is_not_followed",
        "test_timeout_variable_not_a_number_is_one_line",
        "test_verify_against_without_transformers_names_the_extra",
        "test_verify_against_with_old_transformers_names_the_extra",
    ):
        assert f"`{test}`" in section, test
