"""Making the output: FP8 math on tensors (transform), shard files (writer), the resume journal, and the output folder's safety."""
