"""A Triton driver for compiling without a GPU: it reports a target's capability to the JIT, and
the launch after each compile does nothing (compile_offline.py, compile_watch_child.py)."""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import GPUTarget


class OfflineDriver:
    """What the JIT asks a driver before it compiles: a device key, a stream, the target."""

    def __init__(self, sm: int) -> None:
        self.sm = sm

    def get_current_device(self) -> str:
        return f"offline-sm{self.sm}"

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.sm, 32)


class NotLaunched:
    """Stands in for the compiled kernel: the JIT's launch becomes a no-op."""

    function = None
    packed_metadata = None

    def launch_metadata(self, *args: Any) -> None:
        return None

    def run(self, *args: Any, **kwargs: Any) -> None:
        return None
