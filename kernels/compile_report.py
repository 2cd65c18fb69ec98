"""Compile a Triton (or Gluon) kernel for an H100 (sm_90) without a GPU and report its resources: a development tool.

What the device machine would tell us at no device time: registers, spills
(local memory), shared memory, and a histogram of SASS instructions (are the
loads 16 bytes wide, how many integer / half ops per value, any LDS/STS
layout round trips). Run it with the Triton the device has (3.6.0), not the
one the project pins for CI (tests/kernels/test_gluon_decode.py uses the pinned one)::

    python3 -m pip download --no-deps --only-binary=:all: -d /tmp/t36whl triton==3.6.0
    python3 -m pip install --no-deps --target /tmp/t36 /tmp/t36whl/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36 .venv/bin/python -c "from kvserving.kernels.compile_report import report; ..."

``report(fn, signature, constexprs, num_warps=4)`` returns a dict; the SASS
text is in ``["sass"]`` for a closer look.
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import tempfile
from typing import Any


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def report(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], *, num_warps: int = 4,
           maxnreg: int | None = None, gluon: bool = False, sm: int = 90, aligned: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """Compile ``fn`` for sm_``sm`` and return {regs, stack, shared, local, ops: Counter, sass, ttgir}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    # as the JIT does for 16-byte aligned tensors: pointers (and ints named in `aligned`) divisible by 16
    names = list(inspect.signature(fn.fn).parameters)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*") or n in aligned}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        src: Any = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    else:
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options: dict[str, Any] = {"num_warps": num_warps}
    if maxnreg:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", sm, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        path = f.name
    try:
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res))
    ops: collections.Counter[str] = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1)] += 1
    return {
        "regs": int(usage.get("REG", 0)),
        "stack": int(usage.get("STACK", 0)),
        "shared": int(compiled.metadata.shared),
        "local": int(usage.get("LOCAL", 0)),
        "ops": ops,
        "sass": sass,
        "ttgir": compiled.asm["ttgir"],
    }


def summary(r: dict[str, Any], top: int = 25) -> str:
    """One paragraph: resources and the most frequent SASS opcodes."""
    ops = r["ops"]
    head = f"regs {r['regs']} stack {r['stack']} local {r['local']} shared {r['shared']} B, {sum(ops.values())} SASS instructions"
    return head + "\n" + " ".join(f"{k}:{v}" for k, v in ops.most_common(top))


def loop_ops(sass: str) -> collections.Counter[str]:
    """Opcodes inside the kernel's longest loop (from a backward branch's target to the branch)."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2), m.group(3)))
    best = (0, 0)
    for addr, op, rest in lines:
        t = re.match(r"\s*(?:`\()?[^0-9]*0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr and addr - int(t.group(1), 16) > best[1] - best[0]:
            best = (int(t.group(1), 16), addr)
    return collections.Counter(op for addr, op, _ in lines if best[0] <= addr <= best[1])


def loops(sass: str) -> list[collections.Counter[str]]:
    """Opcodes of each innermost loop (a backward branch's target to the branch, holding no other such loop)."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2), m.group(3)))
    spans = []
    for addr, op, rest in lines:
        t = re.match(r"\s*(?:`\()?[^0-9]*0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr:
            spans.append((int(t.group(1), 16), addr))
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return [collections.Counter(op for addr, op, _ in lines if a <= addr <= b) for a, b in sorted(set(inner))]
