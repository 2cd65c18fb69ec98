"""Where a gateway request's time goes: the gateway run with a timestamp at each
stage of every completion request, and a table of the stages' percentiles; or
the gateway sampled in CPU time, and where its CPU goes.

    python bench/gateway_timeline.py run OUT.jsonl gateway --config ...     # the gateway, stamped (what the bench spawns)
    python bench/gateway_timeline.py report OUT.jsonl                       # the table
    python bench/gateway_timeline.py sample OUT.txt gateway --config ...    # the gateway under a CPU-time sampler
    python bench/gateway_timeline.py report-samples OUT.txt                 # self and inclusive shares per function
    python bench/gateway_timeline.py garbage OUT.json gateway --config ...  # what the cyclic collector finds, by kind
    python bench/gateway_timeline.py report-garbage OUT.json                # per request, and what the young objects are

`bench/gateway_overhead.py --timeline OUT.jsonl` (or `--cpu-samples OUT.txt`, `--garbage OUT.json`)
spawns the gateway this way and prints the table after its rows.

The stamped run also records each young collection (its start, wall and CPU time, what it freed,
how many objects it scanned), the event-loop stalls over 5 ms and each request's arrival on the
monotonic clock, and the table ends with the slowest 1 % of requests: each gap's median among
them against all requests', and how many overlapped a collection, a loop stall, or opened a new
connection to the worker. The stall watchdog is a thread that wakes every millisecond and a loop
callback as often: the stamped gateway spends more CPU than the plain one (read its shares, not
its CPU per request).

The sampler: a SIGPROF timer (``ITIMER_PROF``, every 0.5 ms of the process's
user + system CPU) records the Python stack it interrupts; signals that arrive
while one is pending merge, so it gives shares, not times. Unlike cProfile it
costs the same per sample whatever the call count, so many small calls are not
inflated; unlike a wall-clock sampler (py-spy) it does not count the time the
process waits for a core on a loaded machine. A signal handler runs between
bytecodes, so the time of a long C call (a tokenizer call) lands on its caller. Stages, in milliseconds after uvicorn
parsed the request's headers (``arrive``):

    serve         the request reaches the gateway's middleware (app.Requests): the event loop's queue
    body          the body is read and parsed (json.loads)
    prompt_start  ChatTagger.build called (request checks before it)
    prompt        ChatTagger.build returned (render, render with markers, tokenize, tag)
    worker_write  the worker request is sent (workers.WorkerClient._post)
    worker_first  the worker's response headers arrived
    client_first  the first body frame went to the client (TTFT, gateway side)
    end           the response ended

and ``prompt_cpu``, the prompt stage's own CPU time (thread time): the rest of
``prompt_only`` is time the gateway was runnable but not running (the other
processes on the cores) or blocked.

Also the gaps the gateway adds around the worker: ``prompt_to_write`` (identity, routing,
worker body) and ``worker_to_client`` (first worker bytes to the first frame:
parsing, detokenizing, framing and the loop's queue). The stamps are taken
with `time.perf_counter` by wrappers installed before the gateway starts; the
wrappers cost ~1 us each, so the table describes the gateway as benchmarked,
not a different program. A development tool: nothing in the product imports it.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextvars
import gc
import json
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

STAGES = ("serve", "body", "prompt_start", "prompt", "worker_write", "worker_first", "client_first", "end")
GAPS = (
    ("body_to_prompt", "body", "prompt_start"),
    ("prompt_only", "prompt_start", "prompt"),
    ("prompt_to_write", "prompt", "worker_write"),
    ("worker_to_client", "worker_first", "client_first"),
    ("worker_leg", "worker_write", "worker_first"),
)

_now = time.perf_counter
_stamps: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("gateway_timeline", default=None)


def _stamp(name: str) -> None:
    got = _stamps.get()
    if got is not None and name not in got:
        got[name] = _now()


def install(out: Path) -> None:
    """Wrap the gateway's stage functions; write one JSON line per completion request at exit."""
    from uvicorn.protocols.http import httptools_impl

    from kvserving.gateway import app, openai_types, workers
    from kvserving.gateway.prompt import tagger

    records: list[dict[str, float]] = []
    gc_time = [0.0, 0.0, 0.0]  # seconds in the cyclic collector per generation
    gc_count = [0, 0, 0]
    gc_start = [0.0]
    serving = [False]  # from the first request on: the start-up collection (gateway/main.py) is not counted
    # per collection: generation, wall ms, CPU ms, objects collected, start (perf_counter s)
    gc_each: list[tuple[int, float, float, int, float]] = []
    gc_cpu = [0.0]
    gc_young: list[tuple[int, int]] = []  # per young collection: objects it scans, references they hold

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if not serving[0]:
            return
        if phase == "start":
            if info["generation"] == 0:
                # what the collection scans, and the largest of it by references held (its traversal)
                young = gc.get_objects(0)
                gc_young.append((len(young), sum(len(gc.get_referents(o)) for o in young)))
                del young
            gc_start[0] = _now()
            gc_cpu[0] = time.thread_time()
        else:
            wall = _now() - gc_start[0]
            gc_time[info["generation"]] += wall
            gc_count[info["generation"]] += 1
            cpu = 1e3 * (time.thread_time() - gc_cpu[0])
            gc_each.append((info["generation"], 1e3 * wall, cpu, info["collected"], gc_start[0]))

    gc.callbacks.append(on_gc)

    def write() -> None:
        lines = [json.dumps(r) + "\n" for r in records]
        lines.append(json.dumps({"gc_seconds": gc_time, "gc_collections": gc_count, "gc_each": gc_each, "gc_young": gc_young}) + "\n")
        lines.append(json.dumps({"stalls": stalls.gaps, "stall_ends": stalls.ends, "stall_stacks": stalls.stacks}) + "\n")
        out.write_text("".join(lines))

    atexit.register(write)

    cycle_init = httptools_impl.RequestResponseCycle.__init__

    def init(self: Any, scope: Any, *args: Any, **kwargs: Any) -> None:
        scope["timeline_arrive"] = _now()
        cycle_init(self, scope, *args, **kwargs)

    httptools_impl.RequestResponseCycle.__init__ = init  # type: ignore[method-assign]

    cycle_send = httptools_impl.RequestResponseCycle.send

    async def send(self: Any, message: Any) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            _stamp("client_first")
        await cycle_send(self, message)

    httptools_impl.RequestResponseCycle.send = send  # type: ignore[method-assign]

    decode_json = openai_types.decode_json

    def body_stamped(raw: bytes) -> Any:
        out = decode_json(raw)
        _stamp("body")
        return out

    openai_types.decode_json = body_stamped

    stalls = _Stalls()
    serve = app.Requests.__call__

    async def serve_stamped(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not scope["path"].endswith("completions"):
            await serve(self, scope, receive, send)
            return
        if not serving[0]:
            serving[0] = True
            stalls.start(asyncio.get_running_loop())
        got = {"arrive": scope.get("timeline_arrive", _now()), "serve": _now()}
        _stamps.set(got)
        try:
            await serve(self, scope, receive, send)
        finally:
            got["end"] = _now()
            record = {k: 1e3 * (v - got["arrive"]) for k, v in got.items() if k != "arrive"}
            record["at"] = got["arrive"]  # perf_counter seconds: placed against collections and stalls
            records.append(record)

    app.Requests.__call__ = serve_stamped  # type: ignore[method-assign]

    build = tagger.ChatTagger.build

    def build_stamped(self: Any, *args: Any, **kwargs: Any) -> Any:
        _stamp("prompt_start")
        cpu = time.thread_time()
        out = build(self, *args, **kwargs)
        _stamp("prompt")
        got = _stamps.get()
        if got is not None:  # a duration, not a stage: "prompt_cpu" minus "prompt_only" is time without the CPU
            got["prompt_cpu"] = got["arrive"] + (time.thread_time() - cpu)
        return out

    tagger.ChatTagger.build = build_stamped  # type: ignore[method-assign]

    post = workers.WorkerClient._post

    async def post_stamped(self: Any, url: str, payload: bytes, stream: Any, **kwargs: Any) -> Any:
        _stamp("worker_write")  # just before the request: the wrapper's own cost is not the worker's
        response = await post(self, url, payload, stream, **kwargs)
        _stamp("worker_first")
        return response

    workers.WorkerClient._post = post_stamped  # type: ignore[method-assign]

    import aiohttp

    create = aiohttp.TCPConnector._create_connection

    async def create_stamped(self: Any, *args: Any, **kwargs: Any) -> Any:
        _stamp("connect")  # a new connection to the worker (none: a pooled one was reused)
        out = await create(self, *args, **kwargs)
        _stamp("connected")
        return out

    aiohttp.TCPConnector._create_connection = create_stamped  # type: ignore[method-assign]


class _Stalls:
    """Event-loop stalls: a callback every millisecond stamps the loop; a watchdog thread that
    sees no stamp for ``STALL_S`` records what the loop's thread is running (once per stall),
    and the next stamp records how long the stall lasted."""

    STALL_S = 0.005

    def __init__(self) -> None:
        self.gaps: list[float] = []  # ms between two stamps, for gaps over STALL_S
        self.ends: list[float] = []  # perf_counter seconds at each such gap's end
        self.stacks: list[str] = []  # the loop thread's stack, innermost last, during each stall caught
        self._last = 0.0
        self._caught = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._last = _now()
        thread = threading.get_ident()

        def beat() -> None:
            now = _now()
            if now - self._last > self.STALL_S:
                self.gaps.append(1e3 * (now - self._last))
                self.ends.append(now)
            self._last, self._caught = now, False
            loop.call_later(0.001, beat)

        def watch() -> None:
            while True:
                time.sleep(0.001)
                if not self._caught and _now() - self._last > self.STALL_S:
                    frame = sys._current_frames().get(thread)
                    stack = []
                    while frame is not None:
                        code = frame.f_code
                        where = "/".join(code.co_filename.rsplit("/", 2)[-2:])
                        stack.append(f"{code.co_name} ({where}:{frame.f_lineno})")
                        frame = frame.f_back
                    self.stacks.append(" <- ".join(stack[:8]))
                    self._caught = True

        loop.call_later(0.001, beat)
        threading.Thread(target=watch, name="stall-watchdog", daemon=True).start()


def sample(out: Path, *, interval_s: float = 0.0005) -> None:
    """Sample the Python stack every ``interval_s`` of CPU time; collapsed stacks to ``out`` at exit."""

    counts: collections.Counter[str] = collections.Counter()

    def name(frame: Any) -> str:
        code = frame.f_code
        where = code.co_filename
        for marker in ("/site-packages/", "/kvserving/"):
            if marker in where:
                where = where.split(marker, 1)[1]
                break
        return f"{code.co_name} ({where})"

    def handler(signum: int, frame: Any) -> None:
        stack = []
        while frame is not None:
            stack.append(name(frame))
            frame = frame.f_back
        counts[";".join(reversed(stack))] += 1

    def write() -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        out.write_text("".join(f"{stack} {n}\n" for stack, n in counts.items()))

    signal.signal(signal.SIGPROF, handler)
    signal.setitimer(signal.ITIMER_PROF, interval_s, interval_s)
    atexit.register(write)


def garbage(out: Path, *, every_s: float = 1.0) -> None:
    """Count what the cyclic collector frees: automatic collections off, and every ``every_s``
    one collection of the young generation whose garbage is kept (``gc.DEBUG_SAVEALL``),
    counted by kind (the code of a frame, coroutine or function; an exception's class;
    otherwise the type), then freed. Written to ``out`` at exit, with the number of completion
    requests served, so the counts read per request. A development tool: it changes when
    garbage is freed, so its run measures nothing else."""

    found: collections.Counter[str] = collections.Counter()
    tracked: collections.Counter[str] = collections.Counter()  # every young object, freed or not
    tuple_holders: collections.Counter[str] = collections.Counter()  # young tuples by the kind of object holding them
    requests = [0]
    rounds = [0]

    def kind(obj: Any) -> str:
        name = type(obj).__name__
        code = None
        if isinstance(obj, (types.FrameType, types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType, types.FunctionType)):
            code = getattr(obj, "f_code", None) or getattr(obj, "cr_code", None) or getattr(obj, "gi_code", None)
            code = code or getattr(obj, "ag_code", None) or getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType):
            return f"{name} {code.co_qualname} ({'/'.join(code.co_filename.rsplit('/', 2)[-2:])})"
        if isinstance(obj, BaseException):
            return f"exception {name}"
        if name == "method":
            return f"method {getattr(obj, '__qualname__', '?')}"
        return name

    def tick() -> None:
        gc.disable()
        while True:
            time.sleep(every_s)
            young = gc.get_objects(0)
            tracked.update(kind(o) for o in young)
            # who holds the young tuples (the most numerous young objects): their holders' kinds
            ids = {id(o) for o in young if type(o) is tuple}
            for o in young:
                if type(o) is not tuple:
                    held = sum(1 for r in gc.get_referents(o) if id(r) in ids)
                    if held:
                        tuple_holders[kind(o)] += held
            del young, ids
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect(0)
            gc.set_debug(0)
            found.update(kind(o) for o in gc.garbage)
            gc.garbage.clear()
            gc.collect(1)  # what was kept is unreachable again: freed now
            rounds[0] += 1

    from kvserving.gateway import app

    serve = app.Requests.__call__

    async def serve_counted(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and scope["path"].endswith("completions"):
            requests[0] += 1
        await serve(self, scope, receive, send)

    app.Requests.__call__ = serve_counted  # type: ignore[method-assign]

    def write() -> None:
        out.write_text(
            json.dumps(
                {
                    "requests": requests[0],
                    "collections": rounds[0],
                    "garbage": found.most_common(),
                    "young": tracked.most_common(60),
                    "tuple_holders": tuple_holders.most_common(30),
                },
                indent=0,
            )
        )

    atexit.register(write)
    threading.Thread(target=tick, name="garbage-count", daemon=True).start()


def report_garbage(path: Path, *, top: int = 40) -> str:
    """The garbage per request by kind (``garbage``'s file)."""
    got = json.loads(path.read_text())
    n = max(got["requests"], 1)
    total = sum(c for _, c in got["garbage"])
    lines = [
        f"cyclic garbage: {total} objects over {got['requests']} completion requests ({total / n:.1f} per request)\n",
        "| kind | per request |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {c / n:.2f} |" for k, c in got["garbage"][:top]]
    lines += ["\nYoung objects seen at each count (freed or not), per request:\n", "| kind | per request |", "|---|---:|"]
    lines += [f"| {k} | {c / n:.2f} |" for k, c in got["young"][:top]]
    lines += ["\nThe young tuples by what holds them, per request:\n", "| holder | per request |", "|---|---:|"]
    lines += [f"| {k} | {c / n:.2f} |" for k, c in got.get("tuple_holders", [])[:top]]
    return "\n".join(lines) + "\n"


def report_samples(path: Path, *, top: int = 40) -> str:
    """Self and inclusive shares of the sampled CPU per function (collapsed stacks in ``path``)."""

    own: collections.Counter[str] = collections.Counter()
    within: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames, count = stack.split(";"), int(n)
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            within[frame] += count
    if not total:
        return f"{path}: no samples\n"
    lines = [
        f"gateway CPU samples: {total}; each function's share of them (shares, not times: signals that\n"
        "arrive while one is pending merge, so the count is below the CPU time / interval)\n",
        "| function | self | inclusive |",
        "|---|---:|---:|",
    ]
    for frame, _ in within.most_common(top):
        lines.append(f"| {frame} | {100 * own[frame] / total:.1f}% | {100 * within[frame] / total:.1f}% |")
    lines.append("\nBy self time:\n")
    lines += ["| function | self |", "|---|---:|"]
    lines += [f"| {frame} | {100 * n / total:.1f}% |" for frame, n in own.most_common(top)]
    return "\n".join(lines) + "\n"


def report(path: Path) -> str:
    """The percentiles of every stage and gap over the streamed requests in ``path``."""
    from kvserving.sim.cluster import percentile as _pct  # nearest rank, as bench/agents.py

    every = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in every if "client_first" in r and "worker_first" in r]
    collector = next((r for r in every if "gc_seconds" in r), None)
    stalled = next((r for r in every if "stalls" in r), None)
    if not rows:
        return f"{path}: no streamed completion requests recorded\n"
    gc_line = ""
    if collector is not None:
        per = ", ".join(
            f"gen{g} {n} x {1e3 * t / max(n, 1):.3f} ms"
            for g, (n, t) in enumerate(zip(collector["gc_collections"], collector["gc_seconds"], strict=True))
        )
        each = sorted(e[2] for e in collector.get("gc_each", []))
        longest = f"; longest pauses (CPU ms) {', '.join(f'{c:.1f}' for c in each[-3:])}" if each else ""
        scanned = sorted(n for n, _ in collector.get("gc_young", []))
        if scanned:
            longest += f"; objects a young collection scanned: median {scanned[len(scanned) // 2]}, most {scanned[-1]}"
        gc_line = f" (cyclic GC while serving: {per}; {1e3 * sum(collector['gc_seconds']) / len(rows):.3f} ms per request{longest})"
    lines = [
        f"gateway timeline: {len(rows)} streamed requests, ms after the headers were parsed{gc_line}\n",
        "| stage | p50 | p90 | p99 |",
        "|---|---:|---:|---:|",
    ]
    for name in STAGES:
        got = [r[name] for r in rows if name in r]
        if got:
            lines.append(f"| {name} | {_pct(got, 0.5):.3f} | {_pct(got, 0.9):.3f} | {_pct(got, 0.99):.3f} |")
    for name, a, b in GAPS:
        got = [r[b] - r[a] for r in rows if a in r and b in r]
        if got:
            lines.append(f"| {name} | {_pct(got, 0.5):.3f} | {_pct(got, 0.9):.3f} | {_pct(got, 0.99):.3f} |")
    got = [r["prompt_cpu"] for r in rows if "prompt_cpu" in r]
    if got:
        lines.append(
            f"| prompt_cpu (the prompt stage's own CPU time) | {_pct(got, 0.5):.3f} | {_pct(got, 0.9):.3f} | {_pct(got, 0.99):.3f} |"
        )
    lines += _slowest(rows, collector, stalled)
    if stalled is not None:
        gaps = sorted(stalled["stalls"])
        lines.append(
            f"\nevent-loop stalls over {1e3 * _Stalls.STALL_S:.0f} ms: {len(gaps)}"
            + (f", total {sum(gaps):.0f} ms, longest {', '.join(f'{g:.1f}' for g in gaps[-5:])} ms" if gaps else "")
        )
        for stack, n in collections.Counter(stalled["stall_stacks"]).most_common(8):
            lines.append(f"  {n} x {stack}")
    return "\n".join(lines) + "\n"


def _slowest(
    rows: list[dict[str, Any]], collector: dict[str, Any] | None, stalled: dict[str, Any] | None, *, share: float = 0.01
) -> list[str]:
    """Where the slowest ``share`` of requests (by the time to their first frame) lost it: each gap's
    median among them against all requests', and how many overlapped a cyclic collection, an
    event-loop stall, or opened a new connection to the worker."""
    timed = [r for r in rows if "at" in r]
    if len(timed) < 100:
        return []
    timed.sort(key=lambda r: r["client_first"])
    slow = timed[-max(1, int(len(timed) * share)) :]
    collections = [(e[4], e[4] + e[1] / 1e3) for e in (collector or {}).get("gc_each", []) if len(e) > 4]
    stalls = [(end - gap / 1e3, end) for gap, end in zip((stalled or {}).get("stalls", []), (stalled or {}).get("stall_ends", []))]

    def overlap(r: dict[str, Any], spans: list[tuple[float, float]]) -> float:
        start, end = r["at"], r["at"] + r["client_first"] / 1e3
        return 1e3 * sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2] if ordered else float("nan")

    gaps = [("arrive_to_serve", None, "serve"), *GAPS[:2], ("prompt_to_write", "prompt", "worker_write"), GAPS[4], GAPS[3]]
    lines = [
        f"\nthe slowest {100 * share:g} % ({len(slow)} requests, first frame after {slow[0]['client_first']:.1f} ms or more): "
        "median of each gap, ms\n",
        "| gap | all requests | the slowest |",
        "|---|---:|---:|",
    ]
    for name, a, b in gaps:
        every = [r[b] - (r[a] if a else 0.0) for r in timed if b in r and (a is None or a in r)]
        worst = [r[b] - (r[a] if a else 0.0) for r in slow if b in r and (a is None or a in r)]
        lines.append(f"| {name} | {median(every):.3f} | {median(worst):.3f} |")
    for label, key in (("the first frame (client_first)", "client_first"), ("the prompt stage's CPU", "prompt_cpu")):
        lines.append(f"| {label} | {median([r[key] for r in timed if key in r]):.3f} | {median([r[key] for r in slow if key in r]):.3f} |")
    in_gc = [overlap(r, collections) for r in slow]
    in_stall = [overlap(r, stalls) for r in slow]
    fresh = [r["connected"] - r["connect"] for r in slow if "connected" in r and "connect" in r]
    fresh_all = sum(1 for r in timed if "connect" in r)
    lines += [
        f"\nof the slowest: {sum(1 for x in in_gc if x > 0)} overlapped a cyclic collection "
        f"(its pause inside their wait: median {median([x for x in in_gc if x > 0] or [0.0]):.1f} ms); "
        f"{sum(1 for x in in_stall if x > 0)} an event-loop stall over {1e3 * _Stalls.STALL_S:.0f} ms "
        f"(median {median([x for x in in_stall if x > 0] or [0.0]):.1f} ms inside their wait); "
        f"{len(fresh)} opened a new connection to the worker (median {median(fresh or [0.0]):.1f} ms to connect; "
        f"{fresh_all} of all {len(timed)} requests opened one)"
    ]
    return lines


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "report":
        print(report(Path(argv[1])), end="")
        return 0
    if len(argv) >= 2 and argv[0] == "report-samples":
        print(report_samples(Path(argv[1])), end="")
        return 0
    if len(argv) >= 2 and argv[0] == "report-garbage":
        print(report_garbage(Path(argv[1])), end="")
        return 0
    if len(argv) >= 3 and argv[0] in ("run", "sample", "garbage"):
        if argv[0] == "run":
            install(Path(argv[1]))
        elif argv[0] == "garbage":
            garbage(Path(argv[1]))
        else:
            sample(Path(argv[1]))
        from kvserving.cli import main as cli_main

        return cli_main(argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
