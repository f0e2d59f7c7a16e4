from __future__ import annotations

import pytest
import transformers

from fuse_tool.convert import convert_checkpoint
from fuse_tool.plan import ConvertOptions
from ig_helpers import CASES, build_source

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    """Tiny transformers-built source checkpoint of every family (bf16, built lazily, once)."""
    root = tmp_path_factory.mktemp("integration-src")
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = build_source(family, root / family)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def converted(sources, tmp_path_factory):
    """``converted(family, precision="source"|"fp8", other_linear="fp8"|"keep")``: a converted folder, cached per session."""
    root = tmp_path_factory.mktemp("integration-out")
    cache = {}

    def get(family, precision, other_linear="fp8"):
        key = (family, precision, other_linear)
        if key not in cache:
            out = root / f"{family}-{precision}-{other_linear}"
            convert_checkpoint(
                sources(family), out, ConvertOptions(precision=precision, other_linear=other_linear), progress=False
            )
            cache[key] = out
        return cache[key]

    return get


FAMILY_PARAMS = list(CASES)
