from __future__ import annotations

from pathlib import Path

import pytest
from fake_hub import BOB_TOKEN, READ_TOKEN, WRITE_TOKEN, FakeHub  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A running fake Hub, with huggingface_hub pointed at it (endpoint, cache, token, no Xet)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    fake = FakeHub().start()
    fake.add_token(WRITE_TOKEN, "alice", role="write", orgs=("fuse-org",))
    fake.add_token(READ_TOKEN, "alice", role="read", orgs=("fuse-org",))
    fake.add_token(BOB_TOKEN, "bob", role="write")

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    # huggingface_hub reads these at import time: patch the module constants it reads at call time.
    monkeypatch.setattr(constants, "ENDPOINT", fake.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the fake speaks LFS, not Xet
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(home / ".agent_harnesses.json"))
    try:
        yield fake
    finally:
        fake.stop()
        _http.close_session()


@pytest.fixture
def converted(tmp_path):
    from checkpoints import write_converted_checkpoint

    return write_converted_checkpoint(tmp_path / "out")
