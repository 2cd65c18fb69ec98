"""``kvserving calibrate``: a model's KV sensitivity per token class, measured on
calibration text and written as the calibration file the engine config names."""

# D_k(b): "kl", the next-token KL with class k at b bits through every layer (kvserving.calibrate.kl), or
# "attn", DESIGN.md's per-layer attention-output MSE (max over heads, summed over layers)
METRICS = ("kl", "attn")
# The KL metric prefills each prompt in chunks of this many tokens, as the engine does (SchedulerConfig.chunk_size)
DEFAULT_CHUNK = 512
