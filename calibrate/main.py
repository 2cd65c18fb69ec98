"""`kvserving calibrate`'s command line: its arguments and the checks made before any work. Torch-free: the
measuring (``kvserving.calibrate.measure``, torch) is imported once the arguments, the output path and the
device pass, so a refused start answers at once."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserving.argtypes import check_device, check_output_file, float_in, int_in
from kvserving.bits import format_bits_table
from kvserving.calibrate import DEFAULT_CHUNK, METRICS
from kvserving.calibrate.data import WRAPS
from kvserving.config import ModelConfig
from kvserving.model_dir import resolve_model_dir
from kvserving.progress import add_quiet_argument

DEFAULT_BUDGETS = (2.5, 2.7, 3.0, 3.5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory (HF format); empty (the default): the built-in tiny model")
    parser.add_argument(
        "--data",
        type=Path,
        nargs="+",
        required=True,
        help="calibration files: .jsonl chat requests, or plain text wrapped as agent conversations",
    )
    parser.add_argument(
        "--bit-budget",
        type=float_in(2.0, 4.0),
        nargs="+",
        default=list(DEFAULT_BUDGETS),
        dest="bit_budgets",
        metavar="B",
        help="triaxial budgets to write tables for (default: 2.5 2.7 3.0 3.5)",
    )
    parser.add_argument("--out", type=Path, required=True, help="calibration JSON to write")
    parser.add_argument("--seq-len", type=int_in(2), default=2048, help="tokens per calibration prompt")
    parser.add_argument("--max-tokens", type=int_in(2), default=16384, help="calibration tokens in all")
    parser.add_argument(
        "--scale-search", action="store_true", help="choose fp8/nvfp4 scales by attention-output error among multiples of the amax scale"
    )
    parser.add_argument(
        "--frequencies",
        choices=("data", "agent"),
        default="data",
        help="class shares a budget is met under: the calibration data's, or the default agent-context shares",
    )
    parser.add_argument(
        "--wrap",
        choices=WRAPS,
        default="agent",
        help="how plain text becomes conversations: agent-load shaped (default) or 17 equal pieces",
    )
    parser.add_argument(
        "--metric",
        choices=METRICS,
        default="kl",
        help="D_k(b): next-token KL with class k at b bits through every layer (default), or DESIGN.md's per-layer attention-output MSE",
    )
    parser.add_argument(
        "--select",
        action="store_true",
        help="--metric kl: per budget, keep the least whole-table KL (measured on the calibration prompts) "
        "among the KL search's table, the attention-MSE search's and the default sensitivities' "
        "(1.8x the calibration time on CPU; changed 1 of 8 tables on the bench's two models)",
    )
    parser.add_argument(
        "--chunk",
        type=int_in(0),
        default=DEFAULT_CHUNK,
        help="--metric kl: prefill chunk in tokens (the engine's chunk_size; 0: every query on quantized KV)",
    )
    parser.add_argument(
        "--page-seq-len",
        type=int_in(2),
        nargs="+",
        default=[],
        dest="page_seq_lens",
        metavar="N",
        help="count the budget's stored pages on the data wrapped at these context lengths (the lengths served) instead of --seq-len",
    )
    parser.add_argument(
        "--page-data",
        type=Path,
        nargs="+",
        default=[],
        metavar="FILE",
        help="count the budget's stored pages on these files (e.g. a sample of the served traffic: "
        ".jsonl chat requests or plain text) instead of --data; the D_k are measured on --data",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add_quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    check_output_file(args.out, "--out")  # before minutes of work, not after
    check_device(args.device)
    model_dir = resolve_model_dir(ModelConfig(path=args.model))
    from kvserving.calibrate.measure import CANDIDATES, calibrate  # torch with it, once the checks above pass

    selection: dict[str, dict[str, float | str]] = {}
    cal = calibrate(
        model_dir,
        args.data,
        args.bit_budgets,
        seq_len=args.seq_len,
        max_tokens=args.max_tokens,
        search=args.scale_search,
        frequency_source=args.frequencies,
        device=args.device,
        wrap=args.wrap,
        metric=args.metric,
        page_seq_lens=args.page_seq_lens,
        chunk=args.chunk,
        select=args.select,
        selection=selection,
        page_data=args.page_data,
        show_progress=not args.quiet,
    )
    args.out.write_text(cal.to_json())
    print(f"calibrated {model_dir} on {cal.tokens} tokens -> {args.out}")
    unit = "stored bits (pages)" if cal.page_rule() else "average bits"
    for key, table in cal.tables.items():
        print(f"  budget {key}: {cal.stored_bits(table):.3f} {unit}; {format_bits_table(table)}")
        if key in selection:
            kls = ", ".join(f"{name} {selection[key][name]:.4g}" for name in CANDIDATES)
            print(f"    whole-table KL on the calibration prompts: {kls}; kept {selection[key]['chosen']}")
    for name, s in sorted(cal.scales.items()):
        print(f"  {name} scales ({s.method}): K {', '.join(f'{x:.3g}' for x in s.k)}; V {', '.join(f'{x:.3g}' for x in s.v)}")
    return 0
