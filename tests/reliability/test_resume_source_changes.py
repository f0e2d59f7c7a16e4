"""--resume refuses a source that changed since the journal was written (issue 10, class 6).

Detected from what is cheap: sizes, modification times, header hashes, and a sample of data
pages (``SAMPLE_PAGES`` pages of 4 KiB at fixed offsets per file), so a rewrite that keeps the
size, the header and the modification time still shows. The message names the changed file.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

from fuse_tool.write.journal import PAGE, SAMPLE_PAGES

from helpers import assert_clean_refusal, run_cli, tree_bytes
from test_resume import SHARD, _interrupted


def _resume(src, out):
    return run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--resume")


def _keeping_mtime(path, edit):
    st = path.stat()
    edit(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _flip(offset):
    def edit(path):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))

    return edit


def _data_start(path):
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _refused(src, out, *fragments):
    before = tree_bytes(out)
    code, _, err = _resume(src, out)
    assert_clean_refusal(code, err, out, "cannot resume", *fragments)
    assert tree_bytes(out) == before


@pytest.mark.parametrize("page", [0, SAMPLE_PAGES // 2, SAMPLE_PAGES - 1])
def test_shard_data_rewritten_with_size_header_and_mtime_kept_is_refused(src, tmp_path, page):
    out = tmp_path / "out"
    _interrupted(src, out)
    f = sorted(src.glob("*.safetensors"))[0]
    start, size = _data_start(f), f.stat().st_size
    step = (size - start - PAGE) // (SAMPLE_PAGES - 1)
    _keeping_mtime(f, _flip(start + page * step + 100))
    _refused(src, out, f"source shard {f.name} changed (data)", "--overwrite")


def test_tokenizer_rewritten_with_size_and_mtime_kept_is_refused(src, tmp_path):
    out = tmp_path / "out"
    _interrupted(src, out)
    _keeping_mtime(src / "tokenizer.json", lambda p: p.write_text('{"model": "tinz"}\n'))
    _refused(src, out, "source file tokenizer.json changed (data)")


def test_tokenizer_touched_is_refused_naming_it(src, tmp_path):
    out = tmp_path / "out"
    _interrupted(src, out)
    st = (src / "tokenizer.json").stat()
    os.utime(src / "tokenizer.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _refused(src, out, "source file tokenizer.json changed (modification time)")


def test_file_to_copy_added_since_is_refused(src, tmp_path):
    out = tmp_path / "out"
    _interrupted(src, out)
    (src / "chat_template.jinja").write_text("{{ x }}")
    _refused(src, out, "source file chat_template.jinja is new")


def test_file_to_copy_removed_since_is_refused(src, tmp_path):
    out = tmp_path / "out"
    _interrupted(src, out)
    (src / "tokenizer.json").unlink()
    _refused(src, out, "source file tokenizer.json is gone")


def test_journal_of_an_older_converter_is_refused_clearly(src, tmp_path):
    out = tmp_path / "out"
    _interrupted(src, out)
    j = out / ".fuse-shared-journal.json"
    raw = json.loads(j.read_text())
    raw["journal_version"] = 1
    j.write_text(json.dumps(raw))
    _refused(src, out, "written by an older fuse-shared", "--overwrite")
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--overwrite")
    assert code == 0, err
