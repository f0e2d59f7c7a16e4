"""Nothing of the user's is deleted (issue 36, item 1).

The converter deletes only what OUT_DIR proves it wrote: its journal, and temporaries named
``.NAME.TAG.partial`` / ``.NAME.TAG.done`` whose TAG (16 hex digits of the inputs fingerprint) this
run's fingerprint, OUT_DIR's journal or its manifest records. Every other dot-file (``.thesis.pdf.partial``,
``.notes.done``) is the user's: left alone by --overwrite and --resume, and a reason to refuse a plain
convert into a non-empty folder. A name only an unfinished conversion leaves that nothing proves is
refused, named, and kept.
"""

from __future__ import annotations

import json

import pytest

from fuse_tool.convert import convert_checkpoint
from fuse_tool.files import JOURNAL_NAME, done_name, partial_name, temporary_parts
from fuse_tool.plan import ConvertOptions
from fuse_tool.write.journal import Journal, conversion_inputs, fingerprint
from fuse_tool.write.writer import planned_header

from helpers import assert_clean_refusal, interrupted_conversion, run_cli, tree_bytes

SHARD = "20KB"
OPTS = ConvertOptions(max_shard_size=20_000)
FOREIGN_TAG = "0123456789abcdef"


def _convert(src, out, *extra):
    return run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, *extra)


def _verify_ok(out):
    code, _, err = run_cli("verify", out, "--quiet")
    assert code == 0, err


def test_plain_convert_into_a_folder_holding_a_users_partial_file_is_refused(src, tmp_path):
    """Before: exit 0 and .thesis.pdf.partial deleted, although a non-empty OUT_DIR is refused."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".thesis.pdf.partial").write_text("two years of work")
    code, _, err = _convert(src, out)
    assert_clean_refusal(code, err, out, "OUT_DIR is not empty", ".thesis.pdf.partial", "--overwrite")
    assert (out / ".thesis.pdf.partial").read_text() == "two years of work"


def test_overwrite_leaves_a_users_done_file_alone(src, tmp_path):
    """Before: --overwrite deleted .notes.done (any dot-file ending in .done was taken for a shard)."""
    out = tmp_path / "out"
    assert _convert(src, out)[0] == 0
    (out / ".notes.done").write_text("my notes")
    (out / ".thesis.pdf.partial").write_text("mine too")
    code, _, err = _convert(src, out, "--overwrite")
    assert code == 0, err
    assert (out / ".notes.done").read_text() == "my notes"
    assert (out / ".thesis.pdf.partial").read_text() == "mine too"
    _verify_ok(out)  # the user's dot-files are not taken for leftovers of the conversion either


def test_resume_leaves_a_users_partial_file_alone(src, tmp_path):
    """Before: --resume deleted .draft.partial with the stale temporaries."""
    ref = tmp_path / "ref"
    convert_checkpoint(src, ref, OPTS, progress=False)
    out = tmp_path / "out"
    interrupted_conversion(src, out, OPTS)
    (out / ".draft.partial").write_text("draft")
    code, _, err = _convert(src, out, "--resume")
    assert code == 0, err
    assert (out / ".draft.partial").read_text() == "draft"
    got = tree_bytes(out)
    del got[".draft.partial"]
    assert got == tree_bytes(ref)
    _verify_ok(out)


@pytest.mark.parametrize("mode", ["--resume", "--overwrite"])
def test_temporary_of_another_run_is_refused_and_kept(src, tmp_path, mode):
    """A tagged temporary whose tag neither the journal nor this run gives: not provably ours, so named and kept
    (before: deleted by either mode)."""
    out = tmp_path / "out"
    interrupted_conversion(src, out, OPTS)
    stray = out / f".model-00002-of-00016.safetensors.{FOREIGN_TAG}.partial"
    stray.write_bytes(b"someone else's")
    code, _, err = _convert(src, out, mode)
    assert_clean_refusal(code, err, out, stray.name, "no journal or manifest in OUT_DIR shows", "move or delete it")
    assert stray.read_bytes() == b"someone else's"


def test_untagged_temporary_in_a_folder_without_a_journal_is_kept(src, tmp_path):
    """An old-style .NAME.partial with nothing proving who wrote it (before: a plain convert deleted it and exit 0)."""
    out = tmp_path / "out"
    out.mkdir()
    stray = out / ".model-00001-of-00002.safetensors.partial"
    stray.write_bytes(b"whose?")
    code, _, err = _convert(src, out)
    assert_clean_refusal(code, err, out, "OUT_DIR is not empty", stray.name)
    code, _, err = _convert(src, out, "--overwrite")
    assert_clean_refusal(code, err, out, stray.name, "is named like a temporary file of a fuse-shared conversion")
    assert stray.read_bytes() == b"whose?"


def test_overwrite_deletes_the_temporaries_an_older_journal_lists(src, tmp_path):
    """A journal of fuse-shared before tags (version 2) proves its untagged temporaries, and only those of the names
    it lists: they go, the user's .notes.done stays."""
    out = tmp_path / "out"
    out.mkdir()
    names = ["model-00001-of-00016.safetensors", "tokenizer.json"]
    (out / JOURNAL_NAME).write_text(json.dumps({"journal_version": 2, "outputs": names, "completed": {}}))
    (out / ".model-00001-of-00016.safetensors.done").write_bytes(b"old shard")
    (out / ".tokenizer.json.partial").write_bytes(b"old staged copy")
    (out / f".{JOURNAL_NAME}.partial").write_bytes(b"old journal update")  # the journal's own staged update
    (out / ".notes.done").write_text("mine")
    code, _, err = _convert(src, out, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.glob(".*")) == [".notes.done"]
    _verify_ok(out)


def test_every_temporary_carries_the_journals_tag(src, tmp_path):
    """What proves a temporary is ours: an interrupted run's dot-files are its journal and names tagged with the
    journal's fingerprint, nothing else."""
    out = tmp_path / "out"
    interrupted_conversion(src, out, OPTS)
    journal = Journal.load(out / JOURNAL_NAME)
    dot = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
    assert JOURNAL_NAME in dot and len(dot) == 4, dot  # the journal and 3 completed shards
    for name in dot:
        assert name == JOURNAL_NAME or temporary_parts(name)[1] == journal.tag, name
    assert all((out / done_name(name, journal.tag)).is_file() for name in journal.completed)


def test_a_run_killed_before_its_first_journal_is_rerun_in_place(src, tmp_path):
    """Killed while staging the first journal: only that temporary is left, tagged with the inputs' own fingerprint,
    so a plain rerun can prove it wrote it and deletes it (control: the one deletion without a journal)."""
    from fuse_tool.plan import build_plan
    from fuse_tool.source.checkpoint import SourceCheckpoint

    plan = build_plan(SourceCheckpoint.open(src), OPTS)
    headers = {s.filename: planned_header(s) for s in plan.shards}
    tag = Journal(tmp_path / JOURNAL_NAME, conversion_inputs(plan, headers, "cpu"), 0).tag
    assert tag == fingerprint(conversion_inputs(plan, headers, "cpu"))[:16]
    out = tmp_path / "out"
    out.mkdir()
    (out / partial_name(JOURNAL_NAME, tag)).write_text("{ half a journal")
    code, _, err = _convert(src, out)
    assert code == 0, err
    assert not list(out.glob(".*"))
    _verify_ok(out)
