"""kvserving: agent-aware LLM serving with compressed, reusable KV caches.

Subpackages (DESIGN.md, Repository layout): ``kernels`` (KV formats and
kernels), ``worker`` (engine and worker server), ``gateway`` (OpenAI API and
routing), ``operator`` (Kubernetes operator), then the applications built on
them: ``agents`` (agent traffic), ``calibrate``, ``sim`` (cluster simulator),
``local`` (``kvserving up`` and the demo). The root modules are the base every
part reads: ``config`` the one engine-config schema, ``cli`` the ``kvserving``
command, ``tags``, ``model_dir``, ``bits`` and ``calibration``.
"""

__version__ = "0.1.0"
