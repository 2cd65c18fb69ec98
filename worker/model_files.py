"""Model directories the worker writes: the built-in tiny model (``kvserving tiny-model DIR``) in bf16 or as
an FP8 checkpoint, and the Qwen3-8B-shaped config for the dummy load format.

The bf16 model itself is the base's (``kvserving.tiny_model``: the gateway and the model
directories need it without the engine); quantizing it the way published FP8 checkpoints are
stored needs the engine's FP8 codecs and model, which live here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from kvserving.argtypes import path_arg
from kvserving.config import WEIGHT_FORMATS as ENGINE_WEIGHT_FORMATS
from kvserving.tiny_model import SHAPES, build_tiny_model

# torch and the engine's modules load in the functions that write weights: `kvserving tiny-model` refuses a
# bad DIR or argument before importing them
if TYPE_CHECKING:
    import torch

    from kvserving.worker.weights import Fp8Scheme

FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_SAMPLE_TOKENS = 256  # random token ids whose activations set the static input scales


def build_model_dir(
    out_dir: str | Path, *, seed: int = 0, shape: str = "tiny", weight_format: str = "bf16", static_input: bool = False
) -> Path:
    """``build_tiny_model``'s directory; ``weight_format`` "fp8" / "fp8_block" writes it as an FP8 checkpoint
    (``static_input``: with measured ``input_scale`` tensors, per tensor only). A shape other than "tiny" has no
    weights: its config.json then names the FP8 scheme the dummy load format quantizes to."""
    from safetensors.torch import save_file

    from kvserving.worker.weights import WEIGHT_FORMATS, Fp8Scheme

    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r}; known: {list(WEIGHT_FORMATS)}")
    if static_input and (weight_format != "fp8" or shape != "tiny"):
        raise ValueError("static input scales need the tiny shape with weight format 'fp8' (per-tensor scales)")
    out = build_tiny_model(out_dir, seed=seed, shape=shape)
    if weight_format == "bf16":
        return out
    scheme = Fp8Scheme(weight_format, static_input=static_input)
    if shape == "tiny":
        weights = fp8_checkpoint(out, scheme)  # reads the unquantized files just written
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = scheme.quantization_config()
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def fp8_checkpoint(model_dir: Path, scheme: Fp8Scheme) -> dict[str, torch.Tensor]:
    """The unquantized checkpoint in ``model_dir`` as an FP8 checkpoint stores it: each linear layer's weight as
    E4M3 codes with its ``weight_scale`` [] or ``weight_scale_inv`` [N/128, K/128] (fp32), and for a static
    scheme ``input_scale`` [] = amax / 448 of the layer's input over a sample of random token ids."""
    from safetensors.torch import load_file

    from kvserving.kernels import fp8_gemm

    weights = load_file(str(model_dir / "model.safetensors"))
    inputs = _input_amax(model_dir) if scheme.static_input else {}
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in FP8_LINEARS:
            out[name] = w
            continue
        if scheme.weight_format == "fp8_block":
            out[name], out[f"{prefix}.weight_scale_inv"] = fp8_gemm.quantize_blocks(w)
        else:
            out[name], out[f"{prefix}.weight_scale"] = fp8_gemm.quantize_tensor(w)
        if scheme.static_input:
            out[f"{prefix}.input_scale"] = (inputs[prefix] / fp8_gemm.E4M3_MAX).reshape(())
    return out


def _input_amax(model_dir: Path) -> dict[str, torch.Tensor]:
    """Hugging Face linear module name -> amax of its input over one prefill of random token ids."""
    import torch

    from kvserving.worker.model import DenseCausalAttention, linear_parts, load_model

    args, model = load_model(model_dir)
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for module, parts in linear_parts(model).items():

        def record(_: torch.nn.Module, inp: tuple[torch.Tensor, ...], parts: list[tuple[str, int]] = parts) -> None:
            for hf, _rows in parts:
                amax[hf] = inp[0].abs().amax().float()

        hooks.append(model.get_submodule(module).register_forward_pre_hook(record))
    ids = torch.randint(0, args.vocab_size, (INPUT_SAMPLE_TOKENS,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, torch.arange(len(ids)), DenseCausalAttention())
    for h in hooks:
        h.remove()
    return amax


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=path_arg, help="output directory (created if missing; must be empty unless --force)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--force", action="store_true", help="write into a non-empty directory, replacing the model files")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="tiny",
        help="'qwen3-8b': config.json at that shape and the tokenizer, no weights (serve it with --load-format dummy)",
    )
    parser.add_argument(
        "--weights",
        choices=[f for f in ENGINE_WEIGHT_FORMATS if f != "auto"],  # a checkpoint is written in one of them
        default="bf16",
        help="'fp8' (a scale per tensor) or 'fp8_block' (per 128x128 tile): the linear layers as FP8 "
        "checkpoints store them (qwen3-8b: config.json's quantization_config only)",
    )
    parser.add_argument(
        "--static-input-scales",
        action="store_true",
        help="with --weights fp8: write measured input_scale tensors (activation_scheme 'static')",
    )


def check_output_dir(out: Path, *, force: bool) -> None:
    """Refuse a path that is a file, or a directory with files in it (unless ``force``)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and not force and any(out.iterdir()):
        what = "a model" if (out / "config.json").exists() else "files"
        raise ValueError(f"{out} already holds {what}; pass --force to overwrite")


def run(args: argparse.Namespace) -> int:
    check_output_dir(args.dir, force=args.force)
    out = build_model_dir(args.dir, seed=args.seed, shape=args.shape, weight_format=args.weights,
                           static_input=args.static_input_scales)  # fmt: skip
    if args.shape == "tiny":
        print(f"wrote tiny model to {out}" + ("" if args.weights == "bf16" else f" ({args.weights} weights)"))
    else:
        fp8 = "" if args.weights == "bf16" else f", {args.weights} weights drawn and quantized at load"
        print(f"wrote the {args.shape}-shaped config and tokenizer to {out} (no weights: serve it with --load-format dummy{fp8})")
    return 0
