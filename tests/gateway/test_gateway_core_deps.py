"""The gateway's template, tagger, identity and detokenizer run without
transformers or torch (the gateway image need not carry them)."""

from __future__ import annotations

import os
import subprocess
import sys

MODULES = (
    "prompt.chat_template",
    "prompt.tagger",
    "prompt.tag_markers",
    "prompt.tag_spans",
    "prompt.tokenizer",
    "prompt.token_prefixes",
    "prompt.turn_render",
    "conversations",
    "identity",
    "exact_history",
    "detokenize",
    "errors",
)


def test_core_modules_import_neither_transformers_nor_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import kvserving.gateway.{m}\n" for m in MODULES)
        + "print(sorted(m for m in ('transformers', 'torch', 'numpy', 'triton') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONSAFEPATH": "1"}, check=True
    )
    assert out.stdout.strip() == "[]"
