"""KV formats: reference codecs (torch, the spec), Triton kernels and the attention-op dispatch."""
