"""OpenAI-compatible gateway: chat template and tagger, conversation leases, router, metrics."""
