"""Any failure mid-run leaves a state the next command understands (issue 10, class 5).

An unexpected error (an unreadable dtype, an OSError, a KeyError from a bug) is one line naming
the source file and tensor and what was expected, never ``error: 'U16'``. Completed shards are
kept with advice that fits the error (a transient one: --resume; one that would repeat: fix the
cause first); with nothing complete OUT_DIR is left as it was, so a plain rerun is not blocked.
"""

from __future__ import annotations

import errno
import json

import fuse_tool.convert as convert_module
import fuse_tool.write.execute as execute_module
from helpers import assert_clean_refusal, assert_identical, final_named, run_cli
from test_hostile_inputs import ROUTER, edit_header, shard_of
from test_resume import SHARD, reference  # noqa: F401 - reference is a fixture


def _raising(error):
    def fail(*a, **kw):
        raise error

    return fail


def _failing_writer(monkeypatch, error, after: int):
    """ShardWriter whose data writes raise ``error`` once ``after`` shards were started."""
    real = execute_module.ShardWriter
    started = [0]

    class Failing(real):
        def __init__(self, *a, **kw):
            started[0] += 1
            super().__init__(*a, **kw)

        def write(self, *a, **kw):
            if started[0] > after:
                raise error
            return super().write(*a, **kw)

        def copy(self, *a, **kw):
            if started[0] > after:
                raise error
            return super().copy(*a, **kw)

    monkeypatch.setattr(execute_module, "ShardWriter", Failing)


def _fault_gone_then_resume(src, out, reference, monkeypatch):
    """With the fault removed, --resume finishes byte-identical to an uninterrupted run."""
    monkeypatch.undo()
    code, _, done = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--resume")
    assert code == 0, done
    assert_identical(out, reference)


def _one_line(code, err):
    assert code == 1, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err


def test_unreadable_dtype_in_a_router_is_one_line_naming_file_and_tensor(src, tmp_path):
    f = shard_of(src, ROUTER)
    edit_header(f, lambda h: h[ROUTER].__setitem__("dtype", "U16"))
    out = tmp_path / "out"
    code, _, err = run_cli("convert", src, out, "--quiet")
    assert_clean_refusal(code, err, out, f.name, repr(ROUTER), "U16", "expected")
    assert err.strip() != "error: 'U16'"
    assert not out.exists()
    again = run_cli("convert", src, out, "--quiet")  # a plain rerun meets the same error, not a leftover journal
    assert again[2] == err


def test_bug_mid_run_keeps_shards_and_says_what_to_do(src, tmp_path, reference, monkeypatch):
    out = tmp_path / "out"
    _failing_writer(monkeypatch, KeyError("U16"), after=3)
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD)
    assert_clean_refusal(
        code,
        err,
        out,
        "unexpected failure (KeyError: 'U16')",
        "tensor '",
        "expected",
        "3 of",
        "once the cause is fixed",
        "--overwrite",
    )
    assert ".safetensors" in err.split(": tensor '")[0]  # the source shard, or the output shard being written
    # a plain rerun is told what to do; --resume with the fault still there fails the same way, keeping the shards
    code, _, again = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD)
    assert_clean_refusal(code, again, out, "interrupted conversion (3 of", "--resume", "--overwrite")
    code, _, again = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--resume")
    assert_clean_refusal(code, again, out, "unexpected failure (KeyError: 'U16')", "3 of")
    _fault_gone_then_resume(src, out, reference, monkeypatch)


def test_io_error_mid_run_names_the_tensor_and_resumes(src, tmp_path, reference, monkeypatch):
    out = tmp_path / "out"
    _failing_writer(monkeypatch, OSError(errno.EIO, "Input/output error"), after=2)
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD)
    assert_clean_refusal(
        code, err, out, "I/O error: Input/output error", "tensor '", "2 of", "rerun with --resume to continue"
    )
    _fault_gone_then_resume(src, out, reference, monkeypatch)


def test_failure_before_any_shard_completes_leaves_out_dir_as_it_was(src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    _failing_writer(monkeypatch, KeyError("boom"), after=0)
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD)
    _one_line(code, err)
    assert "unexpected failure (KeyError: 'boom')" in err and "shards are complete" not in err
    assert list(out.iterdir()) == []  # no journal: a plain rerun is not blocked
    monkeypatch.undo()
    assert run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD)[0] == 0


def test_unexpected_error_in_the_final_phase_keeps_every_shard(src, tmp_path, reference, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(execute_module, "stage_copy", _raising(ValueError("no such codec")))
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD)
    assert_clean_refusal(code, err, out, f"{out}: unexpected failure (ValueError: no such codec)")
    n = len(list(out.glob(".*.done")))
    assert n > 3 and f"{n} of {n} shards are complete" in err
    _fault_gone_then_resume(src, out, reference, monkeypatch)


def test_os_error_while_preparing_out_dir_names_it(src, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setattr(convert_module, "check_free_space", _raising(OSError(errno.EIO, "Input/output error")))
    code, _, err = run_cli("convert", src, out, "--quiet")
    assert_clean_refusal(code, err, out, f"{out}: I/O error: Input/output error")
    assert not out.exists()


def test_journal_keeps_its_list_of_outputs_while_unfinished(src, tmp_path, monkeypatch):
    """What an unfinished run will write is in its journal, so --overwrite can delete exactly that later."""
    out = tmp_path / "out"
    _failing_writer(monkeypatch, KeyError("x"), after=2)
    run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD)
    journal = json.loads((out / ".fuse-shared-journal.json").read_text())
    assert {"config.json", "model.safetensors.index.json", "fuse_shared_manifest.json", "tokenizer.json"} <= set(
        journal["outputs"]
    )
    assert final_named(out) == []
