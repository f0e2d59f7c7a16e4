"""Engine integrations for fused-shared checkpoints.

- :mod:`runtime.integrations.transformers`: build the source architecture's transformers
  model from a converted folder with every MoE block served by :class:`runtime.FusedSharedMoE`
  (``from_fused_pretrained``), and stream models layer by layer (``StreamedModel``).

Each integration imports its engine lazily; ``import runtime`` never needs one.
"""
