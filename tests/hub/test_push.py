"""push_checkpoint against the loopback fake Hub, through the real huggingface_hub client."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from fake_hub import BOB_TOKEN, READ_TOKEN, WRITE_TOKEN

REPO_ROOT = Path(__file__).resolve().parents[2]
from fuse_tool.hub.transfer import NO_TOKEN_MESSAGE, HubError, push_checkpoint
from fuse_tool.verify.integrity import check_output, list_checkpoint_files

pytestmark = pytest.mark.filterwarnings("ignore:Use .content=:DeprecationWarning")

REPO = "alice/tiny-fused"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _front_matter(text: str) -> dict:
    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert m, text[:200]
    return yaml.safe_load(m.group(1))


def _sha256(p: Path) -> str:
    import hashlib

    return hashlib.sha256(p.read_bytes()).hexdigest()


def _assert_remote_equals_local(hub, repo: str, out: Path, rev: str = "main") -> None:
    local = list_checkpoint_files(out)
    remote = hub.files(repo, rev)
    assert set(remote) == set(local) | {".gitattributes"}
    for rel in local:
        assert hub.file_bytes(repo, rel, rev) == (out / rel).read_bytes(), rel


def test_push_uploads_byte_identical_files_and_model_card(hub, converted, capsys, caplog):
    url = push_checkpoint(converted, REPO)
    assert url == f"{hub.url}/{REPO}"

    _assert_remote_equals_local(hub, REPO, converted)
    remote = hub.files(REPO)
    for shard in SHARDS:  # large files took the LFS path: batch, PUT to the "CDN", verify, lfsFile in the commit
        assert remote[shard].lfs_sha256 == _sha256(converted / shard)
        assert hub.puts_of(remote[shard].lfs_sha256) == 1
    assert remote["config.json"].lfs_sha256 is None
    assert "fuse_shared_manifest.json" in remote

    # README.md was written into OUT_DIR first (atomically: no temporary left) and pushed with the rest
    card = (converted / "README.md").read_text()
    assert hub.file_bytes(REPO, "README.md") == card.encode()
    assert not [p for p in os.listdir(converted) if p.startswith(".")]
    meta = _front_matter(card)
    assert meta["base_model"] == ["deepseek-ai/Tiny-MoE"]
    assert meta["base_model_relation"] == "quantized"
    assert "library_name" not in meta  # the Hub's transformers snippet (a stock from_pretrained) would not run
    assert {"fp8", "moe", "fused-shared-experts", "deepseek_v3"} <= set(meta["tags"])
    block = json.loads((converted / "config.json").read_text())["fused_shared_experts"]
    m = re.search(r"```json\n(.*?)\n```", card, re.S)
    assert m and json.loads(m.group(1)) == block
    assert "quantize" in card and "non_expert_linear" in card  # the conversion options from the manifest
    assert "from runtime.integrations.transformers import from_fused_pretrained" in card
    assert "FusedSharedMoE" in card
    assert "Stock `transformers` cannot load this checkpoint" in card
    assert "fuse-shared serve" in card
    assert card in hub.validated_yaml  # huggingface_hub validated the card's metadata against the endpoint

    head = hub.head(REPO)
    assert head.title.startswith("Upload fused-shared checkpoint")
    # weights were committed before config/index/manifest/card: a half-done push never looks loadable
    weights = hub.repos[REPO].commits[head.parent]
    assert weights.title.endswith("(weights)")
    assert set(SHARDS) <= set(weights.files) and "config.json" not in weights.files
    assert "model.safetensors.index.json" not in weights.files
    err = capsys.readouterr().err
    assert "verified: 9 files match" in err
    assert "uploading 9 files" in err
    assert WRITE_TOKEN not in err and WRITE_TOKEN not in caplog.text


def test_push_downloads_back_identically(hub, converted, tmp_path):
    from huggingface_hub import snapshot_download

    push_checkpoint(converted, REPO, progress=False)
    folder = Path(snapshot_download(REPO, cache_dir=tmp_path / "cache"))
    for rel in list_checkpoint_files(converted):
        assert (folder / rel).read_bytes() == (converted / rel).read_bytes(), rel
    check_output(folder)


def test_rerun_after_complete_push_sends_nothing(hub, converted):
    push_checkpoint(converted, REPO, progress=False)
    commits = hub.commit_count(REPO)
    hub.reset_log()
    push_checkpoint(converted, REPO, progress=False)
    assert hub.lfs_put_log == []
    assert hub.commit_count(REPO) == commits  # nothing changed: no empty commit
    assert not [r for r in hub.requests if r.path.endswith("/commit/main")]


def test_push_private_repo_with_message(hub, converted):
    push_checkpoint(converted, REPO, private=True, commit_message="fp8 fused conversion", progress=False)
    assert hub.repos[REPO].private
    assert hub.head(REPO).title == "fp8 fused conversion"


def test_push_to_new_branch_creates_it(hub, converted):
    push_checkpoint(converted, REPO, progress=False)
    main_head = hub.head(REPO).id
    (converted / "tokenizer_config.json").write_text('{"tokenizer_class": "Other"}')
    manifest = json.loads((converted / "fuse_shared_manifest.json").read_text())
    manifest["files"]["tokenizer_config.json"]["size"] = (converted / "tokenizer_config.json").stat().st_size
    (converted / "fuse_shared_manifest.json").write_text(json.dumps(manifest))

    push_checkpoint(converted, REPO, revision="ue8m0", progress=False)
    assert "ue8m0" in hub.repos[REPO].branches
    assert hub.head(REPO).id == main_head  # main untouched
    _assert_remote_equals_local(hub, REPO, converted, rev="ue8m0")
    assert 'revision="ue8m0"' in hub.file_bytes(REPO, "README.md", "ue8m0").decode()


def test_push_namespace_defaults_to_token_owner(hub, converted):
    url = push_checkpoint(converted, "tiny-fused", progress=False)
    assert url.endswith("/alice/tiny-fused") and "alice/tiny-fused" in hub.repos


def test_push_to_an_org_the_user_belongs_to(hub, converted):
    push_checkpoint(converted, "fuse-org/tiny-fused", progress=False)
    _assert_remote_equals_local(hub, "fuse-org/tiny-fused", converted)


# ---------------------------------------------------------------- resumability


def test_upload_cut_off_midway_completes_on_rerun_without_resending(hub, converted):
    """The storage fails from the 2nd LFS PUT on: the push fails with a resumable message and commits
    nothing; the rerun PUTs only the object that did not arrive."""
    hub.fail_lfs_puts_from = 2
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    msg = str(ei.value)
    assert "507" in msg and "rerun the same push" in msg, msg
    assert set(hub.files(REPO)) == {".gitattributes"}  # nothing committed
    stored = [oid for oid, st in hub.lfs_put_log if st == 200]
    failed = [oid for oid, st in hub.lfs_put_log if st == 507]
    assert len(stored) == 1 and len(failed) == 1 and stored != failed

    hub.fail_lfs_puts_from = None
    hub.reset_log()
    push_checkpoint(converted, REPO, progress=False)
    assert hub.lfs_put_log == [(failed[0], 200)]  # the finished shard is not sent again
    sizes = {_sha256(converted / s): (converted / s).stat().st_size for s in SHARDS}
    assert hub.bytes_put() == sizes[failed[0]]
    _assert_remote_equals_local(hub, REPO, converted)


def test_push_killed_mid_transfer_resumes(hub, converted):
    """A real interruption: the pushing process is killed while an LFS body is half sent."""
    hub.stall_lfs_put = 2
    script = textwrap.dedent(
        f"""
        from fuse_tool.hub import push_checkpoint
        push_checkpoint({str(converted)!r}, {REPO!r}, progress=False)
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),  # this checkout's fuse_tool, whatever is installed
        "HF_ENDPOINT": hub.url,
        "HF_TOKEN": WRITE_TOKEN,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(converted.parent / "hf_home_child"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert hub.stalled.wait(timeout=30), proc.communicate(timeout=5)[0].decode()[-2000:]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        hub.release.set()
    cut = [oid for oid, st in hub.lfs_put_log if st == 0]
    done = [oid for oid, st in hub.lfs_put_log if st == 200]
    assert len(cut) == 1 and len(done) == 1
    assert set(hub.files(REPO)) == {".gitattributes"}

    hub.stall_lfs_put = None
    hub.reset_log()
    push_checkpoint(converted, REPO, progress=False)
    assert hub.lfs_put_log == [(cut[0], 200)]
    _assert_remote_equals_local(hub, REPO, converted)


def test_multipart_lfs_upload(hub, converted):
    hub.multipart_threshold = 100_000
    hub.multipart_chunk_size = 64 * 1024
    push_checkpoint(converted, REPO, progress=False)
    assert any("#part" in oid for oid, _ in hub.lfs_put_log)
    _assert_remote_equals_local(hub, REPO, converted)


# ---------------------------------------------------------------- errors


def _no_requests(hub) -> None:
    assert hub.api_requests() == [], [(r.method, r.path) for r in hub.api_requests()]


def test_no_token(hub, converted, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    assert str(ei.value) == NO_TOKEN_MESSAGE
    _no_requests(hub)


def test_invalid_token(hub, converted, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token_42")
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    msg = str(ei.value)
    assert "token was rejected" in msg and "401" in msg and hub.url in msg
    assert "hf_not_a_real_token_42" not in msg


def test_read_only_token(hub, converted, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", READ_TOKEN)
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    assert "read-only" in str(ei.value) and "write access" in str(ei.value)
    assert REPO not in hub.repos
    assert READ_TOKEN not in str(ei.value)


def test_no_write_access_to_namespace(hub, converted, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", BOB_TOKEN)
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    msg = str(ei.value)
    assert "no write access to alice/tiny-fused" in msg and "403" in msg, msg
    assert REPO not in hub.repos


def test_no_write_access_to_existing_public_repo(hub, converted, monkeypatch):
    hub.create_repo_direct(REPO)  # alice's public repo: bob can read it, so create_repo(exist_ok) passes
    monkeypatch.setenv("HF_TOKEN", BOB_TOKEN)
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    msg = str(ei.value)
    assert "no write access to alice/tiny-fused" in msg and "403" in msg, msg
    assert set(hub.files(REPO)) == {".gitattributes"}


@pytest.mark.parametrize(
    "bad", ["alice/bad--name", "alice/a/b", "alice/-x", "alice/x.", "", "al ice/x", "alice/" + "x" * 97]
)
def test_malformed_repo_id(hub, converted, bad):
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, bad, progress=False)
    assert str(ei.value).startswith("malformed repo id")
    _no_requests(hub)


def test_network_unreachable(hub, converted, monkeypatch):
    from huggingface_hub import constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    msg = str(ei.value)
    assert msg.startswith(f"cannot reach the Hub at {dead}"), msg
    assert "ConnectError" in msg


def test_offline_mode(hub, converted, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    assert "HF_HUB_OFFLINE" in str(ei.value)
    _no_requests(hub)


def test_incomplete_out_dir_sends_nothing(hub, converted):
    (converted / SHARDS[1]).unlink()
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    msg = str(ei.value)
    assert "not a complete converted checkpoint" in msg and SHARDS[1] in msg and "missing" in msg
    _no_requests(hub)
    assert not (converted / "README.md").exists()


def test_conversion_in_progress_sends_nothing(hub, converted):
    (converted / ".model-00002-of-00002.safetensors.partial").write_bytes(b"half")
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    assert ".partial" in str(ei.value)
    _no_requests(hub)


def test_a_file_linked_outside_out_dir_is_not_uploaded(hub, converted, tmp_path):
    """upload_folder follows symlinked files: a note linked to a private file would be published (issue 36)."""
    private = tmp_path / "private.txt"
    private.write_text("secret")
    (converted / "notes.txt").symlink_to(private)
    with pytest.raises(HubError) as ei:
        push_checkpoint(converted, REPO, progress=False)
    msg = str(ei.value)
    assert "notes.txt is a symlink to" in msg and "outside OUT_DIR" in msg and "\n" not in msg
    _no_requests(hub)
    assert not (converted / "README.md").exists()


def test_verification_catches_a_corrupted_upload(hub, converted):
    """If what the Hub holds differs from OUT_DIR, the push says so."""
    push_checkpoint(converted, REPO, progress=False)
    entry = hub.files(REPO)[SHARDS[0]]
    data = bytearray(hub.lfs_objects[entry.lfs_sha256])
    data[-1] ^= 0xFF
    from fake_hub import FileEntry, git_blob_sha1, lfs_pointer
    import hashlib

    bad = hashlib.sha256(bytes(data)).hexdigest()
    hub.lfs_objects[bad] = bytes(data)
    head = hub.head(REPO)
    head.files[SHARDS[0]] = FileEntry(len(data), git_blob_sha1(lfs_pointer(bad, len(data))), bad)

    from fuse_tool.hub import verify_remote
    from huggingface_hub import HfApi

    c = check_output(converted)
    problems, extra = verify_remote(
        HfApi(), REPO, converted, c.files, revision=None, manifest=c.manifest, token=WRITE_TOKEN
    )
    assert len(problems) == 1 and SHARDS[0] in problems[0] and "sha256" in problems[0]
    # a rerun repairs it: the preupload oid differs, so the shard is sent again
    push_checkpoint(converted, REPO, progress=False)
    _assert_remote_equals_local(hub, REPO, converted)


@pytest.mark.parametrize("problem", ["malformed_repo_id", "no_token", "read_only_token"])
def test_convert_push_to_checks_the_repo_and_token_before_converting(hub, tmp_path, monkeypatch, problem):
    """`convert --push-to` at real size converts for hours: a bad repo id or token is said first, nothing written."""
    from click.testing import CliRunner

    from builders import build_checkpoint
    from fuse_tool.cli import main

    src = build_checkpoint("deepseek_v3", tmp_path / "src")
    fragments = {"no_token": NO_TOKEN_MESSAGE, "read_only_token": "read-only"}
    repo, fragment = REPO, fragments.get(problem, "malformed repo id")
    if problem == "malformed_repo_id":
        repo = "alice/bad--name"
    elif problem == "no_token":
        monkeypatch.delenv("HF_TOKEN")
    else:
        monkeypatch.setenv("HF_TOKEN", READ_TOKEN)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(src), str(out), "--push-to", repo, "--quiet"])
    assert r.exit_code == 1 and fragment in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    assert not out.exists(), "converted before saying the push could not happen"
