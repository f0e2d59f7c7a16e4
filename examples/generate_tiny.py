"""Convert the bundled tiny DeepSeek-V3 checkpoint and generate with the original and the converted model.

    python examples/generate_tiny.py [--model examples/tiny-deepseek-v3] [--new-tokens 12]

The original runs through transformers' own ``from_pretrained``; the converted ones through
``runtime.integrations.transformers.from_fused_pretrained`` (transformers' DeepSeek-V3 model
with every MoE block a ``FusedSharedMoE`` that serves the shared expert as trailing expert
slots). Greedy decoding from a fixed prompt of token ids, float32 compute: the no-FP8
conversion reproduces the original's tokens exactly. The FP8 ones round weights and activations
to e4m3 (2^-4 relative); this random tiny model's logits are flat (top-2 gap ~0.36 at the first
step) and its greedy continuation is chaotic, so FP8 tokens drift from the original's early:
that is rounding, not the fusion (``fuse-shared verify`` shows ~6% per MoE layer, as expected).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]


def ensure_checkpoint(path: Path) -> Path:
    """The bundled checkpoint, or (when missing) one built the same way by examples/make_tiny.py."""
    if (path / "config.json").exists():
        return path
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny", HERE / "make_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(path)
    return path


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[1] :].tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=HERE / "tiny-deepseek-v3")
    ap.add_argument("--new-tokens", type=int, default=12)
    args = ap.parse_args(argv)

    from runtime.integrations.transformers.requires import import_transformers

    try:
        transformers = import_transformers("examples/generate_tiny.py")
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from fuse_tool.convert import convert_checkpoint
    from fuse_tool.plan import ConvertOptions
    from runtime.integrations.transformers import build_config, from_fused_pretrained, transformers_classes_for

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    src = ensure_checkpoint(args.model)
    config = json.loads((src / "config.json").read_text())
    _, model_cls = transformers_classes_for(config).classes()
    prompt = torch.tensor([PROMPT])

    original = model_cls.from_pretrained(src, config=build_config(config), dtype=torch.float32).eval()
    results = {"original (transformers)": greedy(original, prompt, args.new_tokens)}
    del original
    with tempfile.TemporaryDirectory() as tmp:
        variants = {
            "converted, no FP8": ConvertOptions(precision="source"),
            "converted, FP8 experts": ConvertOptions(precision="fp8", other_linear="keep"),
            "converted, FP8 experts and linears": ConvertOptions(precision="fp8"),  # the converter's default
        }
        for i, (label, options) in enumerate(variants.items()):
            out = Path(tmp) / str(i)
            convert_checkpoint(src, out, options, progress=False)
            model = from_fused_pretrained(out, dtype=torch.float32)
            results[label] = greedy(model, prompt, args.new_tokens)
            del model

    print(f"prompt token ids: {PROMPT}")
    width = max(map(len, results))
    for label, toks in results.items():
        print(f"{label:<{width}}  {toks}")
    ref = results["original (transformers)"]
    for label, toks in results.items():
        if label.startswith("converted"):
            same = sum(a == b for a, b in zip(toks, ref))
            print(f"{label:<{width}}  {same}/{len(ref)} tokens equal to the original")
    exact = results["converted, no FP8"] == ref
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
