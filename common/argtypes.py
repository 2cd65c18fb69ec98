"""argparse value types that refuse out-of-range numbers with a message naming the bound, and the
checks a command makes on its output files, device, listen address and worker URLs before its work starts."""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (no upper bound when ``high`` is None)."""
    bound = f">= {low}" if high is None else f"in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    return parse


def float_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite float in [low, high] (or (low, high] with ``low_open``)."""
    bound = f"in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or value > high:
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text}")
        return value

    return parse


def decode_shapes(text: str) -> list[tuple[int, int]]:
    """``"8x4096,24x32768"`` -> [(8, 4096), (24, 32768)]: decode shapes, batch x context, both positive."""
    shapes = []
    for item in text.split(","):
        found = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if found is None or 0 in (batch := int(found[1]), context := int(found[2])):
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not BATCHxCONTEXT with both positive, e.g. 16x4096")
        shapes.append((batch, context))
    return shapes


def path_arg(text: str) -> Path:
    """A path given on the command line; an empty one is refused (``Path("")`` would mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a path, got an empty string")
    return Path(text)


def read_json_file(path: str | Path, label: str, *, missing: str) -> Any:
    """The JSON in ``path``; a ValueError that starts with ``label`` and the path when the file is
    not there (``missing``: what belongs there, in parentheses) or is not JSON."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{label} {path}: no such file ({missing})")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{label} {path} is not valid JSON: {exc}") from exc


def check_output_file(path: Path, flag: str) -> None:
    """Refuse (ValueError naming ``flag``) a file that cannot be written, before the work that produces it."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory, not a file")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a directory")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: permission denied")


def check_device(device: str | None, flag: str = "--device") -> None:
    """Refuse (ValueError naming ``flag``) a torch device this machine does not have, before any work."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{flag} {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{flag} {device}: no CUDA device is visible (torch {torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"{flag} {device}: only {count} CUDA device(s) are visible")


def check_memory_bytes(nbytes: int, flag: str, *, given: str | None = None) -> None:
    """Refuse (ValueError naming ``flag``) a memory budget larger than the whole device the
    engine puts it on (the GPU when one is visible, else this machine's RAM): one line, not
    an allocator's traceback. ``given``: the value as the user wrote it (default: ``nbytes``)."""
    import torch

    if torch.cuda.is_available():
        total, where = torch.cuda.mem_get_info()[1], "the GPU's memory"
    else:
        total, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
    if nbytes > total:
        raise ValueError(f"{flag} {given or nbytes} is more than {where} ({total / 2**30:.1f} GiB)")


def check_listen_address(host: str, port: int, *, host_flag: str = "--host", port_flag: str = "--port") -> None:
    """Refuse (ValueError naming the flag) an address this machine cannot listen on, or a port taken
    there, before the work that precedes the server's own bind (a model load, other processes).
    Port 0 (any free port) checks the address only."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: a closed port's TIME_WAIT is free
            sock.bind(address)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            raise ValueError(f"{port_flag} {port}: already in use on {host}") from None
        raise ValueError(f"{host_flag} {host}: cannot listen on that address ({reason})") from None


def check_base_url(url: str, where: str) -> None:
    """Refuse (ValueError naming ``where``) anything but ``http://HOST[:PORT]``: the base URL of a
    worker, which peers and the gateway extend with their own paths."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if (
        parts is None
        or parts.scheme != "http"
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username
        or port == 0
    ):
        raise ValueError(f"{where}: {url!r} is not a worker URL; give http://HOST:PORT")
