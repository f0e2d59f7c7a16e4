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
    return shutil.copytree(tiny_source, tmp_path / "src")


@pytest.fixture(scope="session")
def tiny_converted(tiny_source, tmp_path_factory):
    """``tiny_source`` converted in shards of at most 20 KB (16 of them)."""
    from fuse_tool.convert import convert_checkpoint
    from fuse_tool.plan import ConvertOptions

    out = tmp_path_factory.mktemp("tiny_converted") / "out"
    convert_checkpoint(tiny_source, out, ConvertOptions(max_shard_size=20_000), progress=False)
    return out


@pytest.fixture()
def out(tiny_converted, tmp_path):
    """A private copy of ``tiny_converted``, free to damage."""
    return shutil.copytree(tiny_converted, tmp_path / "out")
