"""Expert parallel over NCCL on several GPUs (issue 26): correctness against one GPU, speed, all_reduce time apart.

The command script (a machine with 2+ GPUs; 4 or 8 only where the result needs them):

    export NCCL_NVLS_ENABLE=0 NCCL_NVLSTREE_ENABLE=0     # NVLink multicast off (device README)
    W=/scratch/ep; mkdir -p $W
    # a DeepSeek-V3-shaped FP8 checkpoint at real widths cut to 4 MoE layers (~52 GB), converted
    python benchmarks/bench_load.py --work $W/v3 --moe-layers 4 --new-tokens 2
    # (V4-Flash shapes: convert a cut V4 release the same way; tests/v4_checkpoint.py has the names)
    for n in 2 4; do
      torchrun --standalone --nproc-per-node $n benchmarks/ep_multi_gpu.py $W/v3/converted --out $W/ep-v3-$n.json
      torchrun --standalone --nproc-per-node $n benchmarks/ep_multi_gpu.py $W/v3/converted --no-shared-replica \\
          --out $W/ep-v3-$n-noreplica.json                                   # must report a large difference
    done

Each rank loads ``from_fused_pretrained(path, device=cuda:rank, keep_fp8=True, expert_parallel=True)`` (its E/world
routed experts and the S shared slots). Rank 0 also loads the whole model on its own GPU (when it fits) and compares
logits of the same tokens; prefill and decode tokens/s are timed for both, and the ``all_reduce`` of the routed
partial outputs is timed apart (CUDA events around it in every ExpertParallelMoE). On a CPU the same script runs
with ``--backend gloo --device cpu`` (a toy checkpoint), which is how it is checked here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off, whoever launches this
os.environ.setdefault("NCCL_NVLSTREE_ENABLE", "0")


class CollectiveTimer:
    """Wall time of every ``dist.all_reduce`` issued by the MoE blocks (synchronized before and after)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.calls = device, 0.0, 0
        self._orig = dist.all_reduce

    def __enter__(self):
        def timed(tensor, *args, **kwargs):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            out = self._orig(tensor, *args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            return out

        dist.all_reduce = timed
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, ids, device, new_tokens: int) -> dict:
    """Logits of ``ids``, prefill tokens/s, decode tokens/s (greedy, ``new_tokens``), tokens."""
    with torch.no_grad():
        model(ids)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        logits = model(ids).logits
        _sync(device)
        prefill = ids.numel() / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        _sync(device)
        decode = new_tokens * ids.shape[0] / (time.perf_counter() - t0)
    return {
        "logits": logits.float().cpu(),
        "prefill_tok_s": round(prefill, 2),
        "decode_tok_s": round(decode, 2),
        "tokens": out[:, ids.shape[1] :].tolist(),
    }


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description="expert parallel over torch.distributed (run under torchrun)")
    ap.add_argument("checkpoint", type=Path, help="a converted folder")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-shared-replica", action="store_true", help="drop the shared slots on every rank (must fail)")
    ap.add_argument("--skip-single", action="store_true", help="no one-GPU reference (the model does not fit one GPU)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    from runtime.expert_parallel import ExpertParallelMoE
    from runtime.integrations.transformers import from_fused_pretrained

    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}") if a.device == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, a.dtype)
    vocab = json.loads((a.checkpoint / "config.json").read_text()).get("vocab_size", 32000)
    ids = torch.randint(0, vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)).to(device)
    res: dict = {
        "world": world,
        "backend": a.backend,
        "device": str(device),
        "shared_replica": not a.no_shared_replica,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_NVLSTREE_ENABLE")},
    }

    t0 = time.perf_counter()
    model = from_fused_pretrained(a.checkpoint, device=device, dtype=dtype, keep_fp8=True, expert_parallel=True)
    if a.no_shared_replica:
        for name, m in list(model.named_modules()):
            if isinstance(m, ExpertParallelMoE):
                m.experts = m.experts.subset(0, m.num_local_routed)
                m.num_shared = 0
    _sync(device)
    res["ep_load_s"] = round(time.perf_counter() - t0, 2)
    if device.type == "cuda":
        res["ep_gpu_allocated_gb"] = round(torch.cuda.memory_allocated(device) / 1e9, 2)
    with CollectiveTimer(device) as timer:
        ep = measure(model, ids, device, a.new_tokens)
    res.update(
        ep_prefill_tok_s=ep["prefill_tok_s"],
        ep_decode_tok_s=ep["decode_tok_s"],
        all_reduce_s=round(timer.seconds, 4),
        all_reduce_calls=timer.calls,
    )
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()
    if rank == 0 and not a.skip_single:
        single = from_fused_pretrained(a.checkpoint, device=device, dtype=dtype, keep_fp8=True)
        one = measure(single, ids, device, a.new_tokens)
        diff = (ep["logits"] - one["logits"]).abs().max().item()
        res.update(
            single_prefill_tok_s=one["prefill_tok_s"],
            single_decode_tok_s=one["decode_tok_s"],
            max_abs_logit_diff=diff,
            max_abs_logit=one["logits"].abs().max().item(),
            same_greedy_tokens=ep["tokens"] == one["tokens"],
        )
        del single
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        text = json.dumps(res, indent=1)
        print(text)
        if a.out:
            a.out.write_text(text)
        return res
    return None


if __name__ == "__main__":
    main()
