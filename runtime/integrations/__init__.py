"""Engine integrations for fused-shared checkpoints.

- :mod:`runtime.integrations.transformers`: stock ``from_pretrained`` of a converted folder after ``import runtime``
  (the ``fuse_shared`` quantizer), ``from_fused_pretrained``, and layer-by-layer streaming (``StreamedModel``).
- :mod:`runtime.integrations.vllm`: the vLLM plugin (entry point ``vllm.general_plugins``): ``vllm serve OUT_DIR``.

Each integration imports its engine lazily; ``import runtime`` never needs one.
"""
