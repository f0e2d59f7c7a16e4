"""Expert parallelism over torch.distributed (gloo, 2 and 4 processes) on tiny converted checkpoints:
DeepSeek-V3, DeepSeek-V4 with a hash-routed layer, MiniMax-M3 with two shared slots, Laguna with a softcapped router
(LAYOUT v5: every rank routes with the cap). Logits equal the
one-process model within float32 rounding; a rank without its shared replica gets them wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from fuse_tool.convert import convert_checkpoint
from ig_helpers import tokens
from runtime.expert_parallel import ExpertParallelMoE, expert_range
from runtime.integrations.transformers import from_fused_pretrained

TIMEOUT_S = 120


def _worker(rank: int, world: int, init_file: str, cases: list[tuple[str, str, int]], out_dir: str) -> None:
    import torch.distributed as dist
    import transformers

    from runtime.expert_parallel import expert_parallel

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name, path, vocab in cases:
            ids = tokens(batch=2, seq=16, vocab=vocab)
            if rank == 0:  # the one-process run, on the same thread count (float32 GEMMs sum in its order)
                with torch.no_grad():
                    torch.save(
                        from_fused_pretrained(path, dtype=torch.float32)(ids).logits,
                        os.path.join(out_dir, f"{name}-{world}-one.pt"),
                    )
            for replica in (True, False):
                model = from_fused_pretrained(path, dtype=torch.float32)
                expert_parallel(model, shared_replica=replica)
                with torch.no_grad():
                    logits = model(ids).logits
                if rank == 0:
                    torch.save(logits, os.path.join(out_dir, f"{name}-{world}-{replica}.pt"))
            # the loader's own EP (each block split as it loads) gives the same logits
            with torch.no_grad():
                logits = from_fused_pretrained(path, dtype=torch.float32, expert_parallel=True)(ids).logits
            if rank == 0:
                torch.save(logits, os.path.join(out_dir, f"{name}-{world}-load.pt"))
        dist.barrier()  # no rank tears the group down while another still uses it
    except BaseException:
        import traceback

        Path(out_dir, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def models(converted, tmp_path_factory):
    """(name, converted folder, vocab) for the four kinds: S = 1, V4 hash layers, MiniMax S = 2, a softcapped router."""
    from builders import build_checkpoint
    from v4_checkpoint import VOCAB, build_v4_checkpoint

    root = tmp_path_factory.mktemp("ep-v4")
    v4 = root / "out"
    convert_checkpoint(build_v4_checkpoint(root / "src", "flash"), v4, progress=False)
    cases = [
        ("deepseek_v3", converted("deepseek_v3", "fp8"), 96),
        ("deepseek_v4", v4, VOCAB),
        ("minimax_m3_text", converted("minimax_m3_text", "source"), 96),
    ]
    capped = root / "laguna-softcap"  # 8 routed experts: they split over 2 and 4 ranks
    convert_checkpoint(build_checkpoint("laguna_softcap", root / "laguna-src", experts=8), capped, progress=False)
    assert json.loads((capped / "config.json").read_text())["fused_shared_experts"]["routing"]["logit_softcap"] == 0.4
    cases.append(("laguna_softcap", capped, 96))
    block = json.loads((Path(cases[2][1]) / "config.json").read_text())["fused_shared_experts"]
    assert block["num_fused_shared_experts"] == 2
    assert json.loads((v4 / "config.json").read_text())["fused_shared_experts"]["routing"]["hash_layers"]
    return [(n, str(p), v) for n, p, v in cases]


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_logits_equal_one_process(world, models, tmp_path):
    ctx = mp.start_processes(
        _worker,
        args=(world, str(tmp_path / "init"), models, str(tmp_path)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    import time

    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"expert-parallel workers still running after {TIMEOUT_S} s")
    for name, _, _ in models:
        want = torch.load(tmp_path / f"{name}-{world}-one.pt")
        got = torch.load(tmp_path / f"{name}-{world}-True.pt")
        scale = want.abs().max()
        assert (got - want).abs().max() <= 1e-5 * scale, name
        assert torch.equal(torch.load(tmp_path / f"{name}-{world}-load.pt"), got), name
        broken = torch.load(tmp_path / f"{name}-{world}-False.pt")
        assert (broken - want).abs().max() > 1e-2 * scale, f"{name}: the shared replica made no difference"


def test_expert_range_refuses_uneven_split():
    assert expert_range(8, 3, 4) == (6, 8)
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        expert_range(8, 0, 3)


def test_needs_a_process_group(converted):
    from runtime.expert_parallel import expert_parallel

    model = from_fused_pretrained(converted("deepseek_v3", "fp8"), dtype=torch.float32)
    with pytest.raises(RuntimeError, match="init_process_group"):
        expert_parallel(model)
    assert not any(isinstance(m, ExpertParallelMoE) for m in model.modules())
