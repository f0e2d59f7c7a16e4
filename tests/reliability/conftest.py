"""Shared sources for the reliability tests: built once per session, copied per test."""

from __future__ import annotations

import shutil

import pytest

from builders import build_checkpoint, load_all, rewrite


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint (BF16) in 2 shards with an index, and a tokenizer file to copy."""
    src = build_checkpoint("deepseek_v3", tmp_path_factory.mktemp("tiny") / "src")
    rewrite(src, load_all(src), shards=2)
    (src / "tokenizer.json").write_text('{"model": "tiny"}\n')
    return src


@pytest.fixture(scope="session")
def tiny_fp8_source(tmp_path_factory, tiny_source):
    from builders import to_fp8_block

    src = tmp_path_factory.mktemp("tiny_fp8") / "src"
    shutil.copytree(tiny_source, src)
    to_fp8_block(src)
    return src


@pytest.fixture(scope="session")
def big_source(tmp_path_factory):
    """Large enough (40 MB of output) that a conversion takes most of a second: room for kill points."""
    src = build_checkpoint(
        "deepseek_v3", tmp_path_factory.mktemp("big") / "src", hidden=512, inter=256, experts=32, layers=4
    )
    rewrite(src, load_all(src), shards=3)
    (src / "tokenizer.json").write_text('{"model": "big"}\n')
    return src


@pytest.fixture()
def src(tmp_path, tiny_source):
    """A private copy of the tiny source, free to damage."""
    dst = tmp_path / "src"
    shutil.copytree(tiny_source, dst)
    return dst
