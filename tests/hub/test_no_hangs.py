"""Nothing hangs on the Hub: every request has connect and read timeouts, retries are bounded, a cut
download resumes, and push never walks into a symlinked folder.

The stalled endpoint is a loopback server that accepts every connection and never answers. The
timeouts are set short through huggingface_hub's own variables (HF_HUB_ETAG_TIMEOUT,
HF_HUB_DOWNLOAD_TIMEOUT) so each test takes seconds; the defaults are checked separately.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fake_hub import WRITE_TOKEN
from fuse_tool.hub import push_checkpoint, resolve_model_source

pytestmark = pytest.mark.filterwarnings("ignore:Use .content=:DeprecationWarning")

REPO_ROOT = Path(__file__).resolve().parents[2]
SRC = "alice/tiny-src"


class StalledEndpoint:
    """Accepts every TCP connection on loopback and never sends a byte."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.held: list[socket.socket] = []
        self.accepted = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self):
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.held.append(c)
            self.accepted += 1

    def close(self):
        self._stop = True
        self._thread.join(timeout=5)
        for c in self.held:
            c.close()
        self.sock.close()


@pytest.fixture
def stalled():
    s = StalledEndpoint()
    try:
        yield s
    finally:
        s.close()


def _cli(args, env_extra, tmp_path, timeout=90):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(
        {
            "HF_HOME": str(tmp_path / "hf_home"),
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_ETAG_TIMEOUT": "1",
            "HF_HUB_DOWNLOAD_TIMEOUT": "1",
            **env_extra,
        }
    )
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "fuse_tool.cli", *map(str, args)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r, time.monotonic() - t0


def _one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_stalled_endpoint_download_ends_in_one_line(stalled, tmp_path):
    r, took = _cli(["convert", SRC, tmp_path / "out", "--quiet"], {"HF_ENDPOINT": stalled.url}, tmp_path)
    assert r.returncode == 1
    line = _one_line(r)
    assert line == (
        f"error: the Hub at {stalled.url} did not answer within 1 s (read timeout) to download {SRC}; "
        "check the network and HF_ENDPOINT, or raise HF_HUB_DOWNLOAD_TIMEOUT"
    ), line
    assert stalled.accepted >= 1  # it did connect: the read timed out, not the connect
    assert took < 60, took
    assert not (tmp_path / "out").exists()


def test_stalled_endpoint_push_ends_in_one_line(stalled, tmp_path, converted):
    r, took = _cli(
        ["push", converted, "alice/fused", "--quiet"], {"HF_ENDPOINT": stalled.url, "HF_TOKEN": WRITE_TOKEN}, tmp_path
    )
    assert r.returncode == 1
    line = _one_line(r)
    assert line.startswith(
        f"error: the Hub at {stalled.url} did not answer within 1 s (read timeout) to check the token"
    ), line
    assert WRITE_TOKEN not in r.stderr
    assert took < 60, took


def test_stalled_lfs_upload_is_abandoned_and_retried(hub, converted, monkeypatch):
    """One LFS PUT stalls (the server reads half the body, then nothing): the read timeout ends it and
    huggingface_hub's bounded retry sends it again; the push completes."""
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "1")
    hub.stall_lfs_put = 1
    t0 = time.monotonic()
    push_checkpoint(converted, "alice/stall-once", progress=False)
    took = time.monotonic() - t0
    assert hub.stalled.is_set()
    statuses = [st for _, st in hub.lfs_put_log]
    assert statuses.count(0) == 1 and statuses.count(200) >= 2, hub.lfs_put_log
    for name in ("config.json", "model.safetensors.index.json"):
        assert hub.file_bytes("alice/stall-once", name) == (converted / name).read_bytes()
    assert took < 30, took


def test_every_hub_request_has_connect_and_read_timeouts(hub, converted, tmp_path, monkeypatch):
    """Download and push against the fake Hub, recording every request as it reaches the transport."""
    from huggingface_hub import HfApi, get_session

    from fuse_tool.hub.timeouts import bound_hub_requests

    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "7")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "9")
    HfApi().create_repo(SRC)
    HfApi().upload_folder(repo_id=SRC, folder_path=converted)
    bound_hub_requests()
    seen: list[tuple[str, str, dict]] = []
    get_session().event_hooks["request"].append(
        lambda req: seen.append((req.method, req.url.path, dict(req.extensions["timeout"])))
    )

    resolve_model_source(SRC, progress=False)
    push_checkpoint(converted, "alice/every-request", progress=False)

    assert len(seen) > 10
    unbounded = [(m, p, t) for m, p, t in seen if any(t.get(k) is None for k in ("connect", "read", "write", "pool"))]
    assert unbounded == []
    # what huggingface_hub itself left unbounded got the configured bounds (repo info, whoami, commits, uploads):
    filled = [t for _, _, t in seen if t == {"connect": 7.0, "read": 9.0, "write": 9.0, "pool": 9.0}]
    assert len(filled) >= 3, seen
    assert any(p.endswith("/api/whoami-v2") for _, p, _ in seen)


def test_default_bounds_end_a_stall_within_two_minutes(monkeypatch):
    """Without the variables: connect 10 s, read 10 s. The longest path, an LFS upload retried 5 times with
    1-8 s backoff, then ends within 6 x 10 + 23 = 83 s."""
    from fuse_tool.hub.timeouts import hub_timeouts

    monkeypatch.delenv("HF_HUB_ETAG_TIMEOUT", raising=False)
    monkeypatch.delenv("HF_HUB_DOWNLOAD_TIMEOUT", raising=False)
    t = hub_timeouts()
    assert t == {"connect": 10.0, "read": 10.0, "write": 10.0, "pool": 10.0}
    assert 6 * t["read"] + (1 + 2 + 4 + 8 + 8) < 120


def test_a_cut_download_resumes_where_it_stopped(hub, converted, monkeypatch):
    """The connection drops after 1000 bytes of a file: huggingface_hub asks for the rest with a Range
    request from the last whole chunk it wrote, and the file in the cache is whole. (It writes in
    chunks of DOWNLOAD_CHUNK_SIZE, 10 MB; 256 bytes here so that a small file has several.)"""
    from huggingface_hub import HfApi, constants

    HfApi().create_repo(SRC)
    HfApi().upload_folder(repo_id=SRC, folder_path=converted)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 256)
    hub.range_log.clear()
    hub.cut_body_after = 1000
    path = resolve_model_source(SRC, progress=False)
    assert hub.cut_body_after is None  # the cut happened
    assert "bytes=768-" in hub.range_log, hub.range_log  # 3 whole chunks kept, the rest asked for
    for p in converted.iterdir():
        if p.is_file() and p.name != "README.md":
            assert (path / p.name).read_bytes() == p.read_bytes(), p.name


def test_push_does_not_follow_symlinked_folders(hub, converted, tmp_path):
    private = tmp_path / "private"
    private.mkdir()
    (private / "id_rsa").write_text("secret\n")
    (converted / "elsewhere").symlink_to(private, target_is_directory=True)
    (converted / "loop").symlink_to(".", target_is_directory=True)
    push_checkpoint(converted, "alice/no-follow", progress=False)
    remote = set(hub.files("alice/no-follow"))
    assert not any(f.startswith(("elsewhere/", "loop/")) for f in remote), remote
    assert "config.json" in remote
