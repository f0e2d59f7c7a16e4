import subprocess
import sys


def test_runtime_imports_and_routes_without_triton_click_tqdm_hub():
    code = (
        "import sys\n"
        "for m in ('triton', 'click', 'tqdm', 'huggingface_hub'): sys.modules[m] = None\n"
        "import torch, runtime\n"
        "from runtime import RoutingConfig, route, fused_moe, ExpertWeights, FusedSharedMoE\n"
        "ids, w = route(torch.randn(3, 16), None, RoutingConfig(16, 2, 1))\n"
        "assert ids.shape == (3, 3) and not runtime._backend.triton_available()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
