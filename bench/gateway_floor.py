"""The floor under the gateway's overhead: the least any Python gateway must do per chat turn.

    PYTHONSAFEPATH=1 .venv/bin/python bench/gateway_floor.py --port P --worker URL [--model-dir DIR]

A process that serves ``POST /v1/chat/completions`` on the same server as
``kvserving gateway`` (uvicorn, httptools, uvloop)
and does only the steps no OpenAI-compatible gateway in front of a token-level
worker can skip, each with the product's own code:

    read and parse the JSON body                         json.loads
    check the messages, render the model's chat template chat_template.normalize_messages, ChatTemplate.render
    tokenize the prompt                                  TokenPrefixes.encode (a turn tokenizes only its new text)
    write the worker request                             WorkerClient.generate (the gateway's client, aiohttp)
    relay the reply as OpenAI chunks                     SSEEvents, IncrementalDetokenizer, ChatFrames

and nothing else: no tags (every token gets the same tag, no marked render), no
conversation identity, exact history, leases, routing, metrics,
disconnect watch or request checks beyond the JSON. `bench/gateway_overhead.py`
runs it as its "floor" column: TTFT through this process minus TTFT straight to
the worker is what a gateway costs before it does anything kvserving adds, on
the same machine at the same moment. Not a product path: nothing imports it.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import uuid
from pathlib import Path
from typing import Any

import uvicorn

from kvserving.config import GatewayConfig
from kvserving.gateway.prompt.chat_template import normalize_messages
from kvserving.gateway.model import ModelInfo
from kvserving.gateway.relay import SSE_DONE, ChatFrames
from kvserving.gateway.detokenize import IncrementalDetokenizer
from kvserving.gateway.conversations import Conversations
from kvserving.gateway.prompt.token_prefixes import TokenPrefixes
from kvserving.gateway.workers import WorkerClient
from kvserving.tags import encode_tag

USER_TAG = encode_tag("current", "text", "user")
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class Floor:
    """Raw ASGI app: chat completions (streamed) straight through to one worker."""

    def __init__(self, model_dir: Path, worker_url: str, *, served_name: str) -> None:
        # what the gateway loads: tokenizer, template, EOS ids (its kept caches unused here)
        model = ModelInfo.load(model_dir, served_name=served_name, max_kept_tokens=GatewayConfig().max_kept_tokens)
        self.tokenizer = model.tokenizer
        self.template = model.tagger.template
        self.kept = Conversations()
        self.prefixes = TokenPrefixes(self.tokenizer, self.kept)
        self.client = WorkerClient(request_timeout_s=30.0, connect_timeout_s=5.0)
        self.worker_url = worker_url
        self.served_name = served_name
        self.stop_ids = list(model.stop_token_ids)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] != "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        message = await receive()
        body = message.get("body", b"")
        while message.get("more_body", False):
            message = await receive()
            body += message.get("body", b"")
        request = json.loads(body)
        messages = normalize_messages(request["messages"])
        text = self.template.render(messages, add_generation_prompt=True)
        got = self.prefixes.encode_prefixed(text)
        # kept on the record of the conversation its first messages name (the floor has no identity stage)
        self.kept.keep_prefixes(self.kept.open(repr(request["messages"][:2]), scope=""), got.filed)
        ids = got.ids
        worker_body = {
            "request_id": f"floor-{uuid.uuid4().hex}",
            "input_ids": ids,
            "tags": [USER_TAG] * len(ids),
            "sampling": {
                "max_tokens": int(request.get("max_tokens") or 16),
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "seed": None,
                "stop_token_ids": self.stop_ids,
                "ignore_eos": False,
            },
        }
        frames = ChatFrames(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.served_name, include_usage=False)
        detok = IncrementalDetokenizer(self.tokenizer, skip_ids=self.stop_ids)
        first = True
        finish = "stop"
        async for batch in self.client.generate(self.worker_url, worker_body):
            out: list[bytes] = []
            for event in batch:
                if first:
                    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                    out.append(frames.chunk({"role": "assistant", "content": ""}))
                    first = False
                text = detok.add(event.get("token_ids") or [])
                if text:
                    out.append(frames.chunk({"content": text}))
                if event.get("finish_reason"):
                    finish = event["finish_reason"]
            if out:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        tail = detok.flush()
        last = (frames.chunk({"content": tail}) if tail else b"") + frames.chunk({}, finish) + SSE_DONE
        await send({"type": "http.response.body", "body": last, "more_body": False})


def main() -> int:
    from kvserving.config import ServingConfig
    from kvserving.model_dir import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker", required=True, help="the worker's base URL")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the built-in tiny model")
    parser.add_argument("--served-name", default="kvserving-tiny")
    args = parser.parse_args()
    model_dir = args.model_dir or resolve_model_dir(ServingConfig().model)
    app = Floor(model_dir, args.worker, served_name=args.served_name)
    gc.collect()  # the gateway's own GC settings (gateway/main.py), so neither pays more for collections
    gc.freeze()
    gc.set_threshold(5_000, 80, 20)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
