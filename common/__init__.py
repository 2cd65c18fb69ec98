"""kvserving: agent-aware LLM serving with compressed, reusable KV caches.

Subpackages (DESIGN.md, Repository layout): ``kernels`` (KV formats and
kernels), ``worker`` (engine and worker server), ``gateway`` (OpenAI API and
routing), ``operator`` (Kubernetes operator). ``config`` holds the one
engine-config schema every part reads; ``cli`` the ``kvserving`` command.
"""

__version__ = "0.1.0"
