"""vLLM with the fuse-shared plugin on converted tiny checkpoints, against vLLM on the source (issue 31).

Each engine runs in its own process (engine.py). The reference is stock vLLM on the unconverted source, with vLLM's
own shared-expert handling: a ``--precision source`` conversion must give the same greedy tokens and the same
prompt logprobs up to float32 rounding (the fused sum adds the same products in another order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fuse_tool.convert import convert_checkpoint
from fuse_tool.plan import ConvertOptions
from vllm_checkpoints import BUILDERS

ENGINE = Path(__file__).with_name("engine.py")
PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29], [3, 100, 7, 200, 11, 150]]
REQUESTS = [{"prompt": p, "max_tokens": 8} for p in PROMPTS]
NO_PLUGINS = {"VLLM_PLUGINS": "no-such-plugin"}  # an allowlist naming nothing installed: vLLM loads no plugin
ROUNDING = 1e-3  # float32 logprobs of the same sums in another order


def run_engine(model: Path, dtype: str = "float32", env: dict | None = None) -> tuple[int, list | None, str]:
    p = subprocess.run(
        [sys.executable, str(ENGINE), str(model), dtype, json.dumps(REQUESTS)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **(env or {})},
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("ENGINE ")), None)
    return p.returncode, json.loads(line[len("ENGINE ") :]) if line else None, p.stdout + p.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(family, kind)``: the engine's answers on the source (``"source"``, stock vLLM without plugins too:
    ``"source-no-plugin"``) or a conversion (``"fused"``: --precision source, ``"fp8"``: the default), cached."""
    root = tmp_path_factory.mktemp("vllm")
    cache: dict = {}

    def model(family: str, kind: str) -> Path:
        src = root / family / "src"
        if not src.exists():
            BUILDERS[family](src)
        if kind in ("source", "source-no-plugin"):
            return src
        out = root / family / kind
        if kind == "fp8-as-float" and not out.exists():
            write_dequantized(model(family, "fp8"), out)
        elif not out.exists():
            precision = "source" if kind == "fused" else "fp8"
            convert_checkpoint(src, out, ConvertOptions(precision=precision), progress=False)
        return out

    def get(family: str, kind: str):
        if (family, kind) not in cache:
            env = NO_PLUGINS if kind == "source-no-plugin" else None
            code, answers, log = run_engine(model(family, kind), env=env)
            assert code == 0 and answers is not None, failure(log)
            cache[family, kind] = answers
        return cache[family, kind]

    get.model = model
    return get


def failure(log: str) -> str:
    """An engine's log cut to what says why it stopped: vLLM's worker prints the root cause far above the engine
    core's own traceback, so the first lines naming an error come before the log's tail."""
    errors = [x for x in log.splitlines() if "Error:" in x or "Exception:" in x]
    return "\n".join(errors[:10]) + "\n...\n" + log[-3000:]


def write_dequantized(fp8: Path, out: Path) -> None:
    """A copy of conversion ``fp8`` with every FP8 weight and its block scale replaced by the float32 weight they
    stand for, and a quantization_config saying no weight is FP8 (what ``--precision source`` writes)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from runtime.fp8 import dequantize_block_fp8

    shutil.copytree(fp8, out)
    for shard in out.glob("*.safetensors"):
        tensors = load_file(shard)
        for name in [n for n in tensors if n.endswith("_scale_inv")]:
            weight = name.removesuffix("_scale_inv")
            tensors[weight] = dequantize_block_fp8(tensors[weight], tensors.pop(name))
        save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("_scale_inv")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fuse_shared"}
    (out / "config.json").write_text(json.dumps(config))
    (out / "fuse_shared_manifest.json").unlink(missing_ok=True)


def assert_same_greedy(got: list, want: list) -> None:
    """The same tokens; a step may differ only where the reference's two best logprobs tie within rounding."""
    for a, b in zip(got, want):
        for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
            if x != y:
                best, second = b["steps"][i][:2]
                assert best - second < ROUNDING, (i, a["tokens"], b["tokens"])
                break
            assert abs(a["steps"][i][0] - b["steps"][i][0]) < ROUNDING, (i, a["steps"][i], b["steps"][i])


def prompt_gap(got: list, want: list) -> float:
    return max(
        abs(x - y)
        for a, b in zip(got, want)
        for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"])
        if y is not None
    )


@pytest.mark.parametrize("family", list(BUILDERS))
def test_fused_conversion_equals_vllm_on_the_source(family, runs):
    want, got = runs(family, "source"), runs(family, "fused")
    assert_same_greedy(got, want)
    assert prompt_gap(got, want) < ROUNDING
    assert all(len(a["tokens"]) == 8 for a in got)


@pytest.mark.parametrize("family", list(BUILDERS))
def test_fp8_conversion_runs_its_fp8_weights(family, runs):
    """The default FP8 conversion, dequantized at load where vLLM has no FP8 block kernels (every CPU), computes what
    its FP8 weights mean: the same as the conversion with every FP8 weight written out as float32 beforehand. (How
    far FP8 rounding moves a tiny random model from its source is the README's "What accuracy to expect".)"""
    got, want = runs(family, "fp8"), runs(family, "fp8-as-float")
    assert_same_greedy(got, want)
    assert prompt_gap(got, want) < ROUNDING
    assert prompt_gap(got, runs(family, "source")) > 0  # FP8 weights, not the source's


def test_unconverted_checkpoint_is_untouched_by_the_plugin(runs):
    """An unfused checkpoint loads exactly as without the plugin: the same bits."""
    assert runs("glm4_moe", "source") == runs("glm4_moe", "source-no-plugin")


def test_stock_vllm_refuses_a_conversion_naming_its_architecture(runs):
    code, answers, log = run_engine(runs.model("glm4_moe", "fused"), env=NO_PLUGINS)
    assert code != 0 and answers is None
    assert "FusedSharedGlm4MoeForCausalLM" in log, log[-3000:]
