"""One HTTP client library in the package: every outbound call (gateway -> worker streams,
worker -> worker pulls, the local stack's readiness polls, the operator's sampler and its
Kubernetes calls) goes through aiohttp. No second client library, no HTTP/1.1 spoken on a
socket by our own code. One exception: `make demo` plays an agent, a user of the OpenAI API,
through the official SDK (that it needs no other is what the demo shows). Tests and
benchmarks may use what they like."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = (
    "common",
    "gateway",
    "worker",
    "operator",
    "kernels",
    "agents",
    "calibrate",
    "sim",
    "local",
)  # the package (pyproject's package-dir)
CLIENT = "aiohttp"
# client libraries and HTTP protocol code other than CLIENT
OTHERS = (
    "httpx",
    "httpcore",
    "requests",
    "urllib3",
    "urllib.request",
    "http.client",
    "httptools",
    "h11",
    "h2",
    "pycurl",
    "tornado",
    "treq",
    "niquests",
    "openai",
)
USERS_OF_THE_API = {"local/agent_demo.py": ["openai", "openai.OpenAI"]}  # the demo's agent: a client of the OpenAI API, as users are


def imports_and_http_literals(source: str) -> tuple[set[str], list[str]]:
    """Every module a source imports, and its string constants that hold an HTTP/1.x message head."""
    names: set[str] = set()
    heads: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            text = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
            if "HTTP/1." in text and "\r\n" in text:
                heads.append(text[:60])
    return names, heads


def offenders(source: str) -> list[str]:
    names, heads = imports_and_http_literals(source)
    bad = sorted(n for n in names for other in OTHERS if n == other or n.startswith(other + "."))
    return bad + [f"HTTP head literal {h!r}" for h in heads]


def test_the_package_uses_one_http_client_library() -> None:
    found: dict[str, list[str]] = {}
    users: set[str] = set()
    for folder in SOURCE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            bad = offenders(text)
            if bad and bad != USERS_OF_THE_API.get(str(path.relative_to(ROOT))):
                found[str(path.relative_to(ROOT))] = bad
            names, _ = imports_and_http_literals(text)
            if any(n == CLIENT or n.startswith(CLIENT + ".") for n in names):
                users.add(str(path.relative_to(ROOT)))
    assert found == {}
    # every outbound caller is on the one library
    assert {"gateway/workers.py", "worker/kv/protocol.py", "local/stack.py", "operator/kv_sampler.py"} <= users


def test_the_check_sees_a_second_client_and_hand_written_http() -> None:
    assert offenders("import httpx\nfrom urllib.request import urlopen\nimport httptools\n") == [
        "httptools",
        "httpx",
        "urllib.request",
        "urllib.request.urlopen",
    ]
    assert offenders('head = b"POST /x HTTP/1.1\\r\\nhost: w\\r\\n"') == ["HTTP head literal 'POST /x HTTP/1.1\\r\\nhost: w\\r\\n'"]
    assert offenders("import aiohttp\nimport socket\nfrom urllib.parse import urlsplit\n") == []
