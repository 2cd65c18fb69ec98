"""Reading a Hugging Face model directory: config.json, its FP8 ``quantization_config``,
and safetensors weights by their Hugging Face tensor names (one file or a sharded index)."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

# Tensors some checkpoints carry that no model needs (recomputed at load).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Weight formats: the model dtype unquantized, FP8 with one scale per tensor, FP8 with one per 128x128 tile.
WEIGHT_FORMATS = ("bf16", "fp8", "fp8_block")
FP8_BLOCK = [128, 128]
_SUPPORTED = "supported: quant_method 'fp8' with per-tensor scales or weight_block_size [128, 128]"


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How a checkpoint's FP8 linear layers are stored (config.json ``quantization_config``, quant_method fp8).

    fp8:       ``<layer>.weight`` e4m3, ``<layer>.weight_scale`` fp32 [] (one per tensor), and with
               activation_scheme "static" ``<layer>.input_scale`` fp32 [] (else activations per token);
    fp8_block: ``<layer>.weight`` e4m3, ``<layer>.weight_scale_inv`` fp32 [ceil(N/128), ceil(K/128)]
               (the factor that dequantizes a 128x128 tile), activations per token per 128 channels."""

    weight_format: str
    static_input: bool = False

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS[1:]:
            raise ValueError(f"FP8 weight format must be one of {WEIGHT_FORMATS[1:]}, got {self.weight_format!r}")
        if self.static_input and self.weight_format == "fp8_block":
            raise ValueError("static activation scales are not supported with 128x128 block scales")

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.weight_format == "fp8_block" else "weight_scale"

    def quantization_config(self) -> dict[str, object]:
        """The config.json entry that describes this scheme (what FP8 checkpoints publish)."""
        out: dict[str, object] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static" if self.static_input else "dynamic"}
        if self.weight_format == "fp8_block":
            out["weight_block_size"] = list(FP8_BLOCK)
        return out


def read_quantization(config: dict[str, object]) -> Fp8Scheme | None:
    """The FP8 scheme config.json's ``quantization_config`` describes; None when it has none (unquantized).
    ValueError, one line, for any scheme this engine cannot run."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported ({_SUPPORTED})")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (only e4m3; {_SUPPORTED})")
    act = q.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme {act!r} is not supported (dynamic or static)")
    block = q.get("weight_block_size")
    if block is not None and list(block) != FP8_BLOCK:  # type: ignore[call-overload]
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not supported ({_SUPPORTED})")
    if block is not None and act == "static":
        raise ValueError(
            "quantization_config: activation_scheme 'static' with weight_block_size is not supported "
            f"({_SUPPORTED}; block scales take per-token activation scales)"
        )
    return Fp8Scheme("fp8" if block is None else "fp8_block", static_input=act == "static")


def read_config(model_dir: str | Path) -> dict[str, object]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {model_dir}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config


def read_generation_config(model_dir: str | Path) -> dict[str, object]:
    """generation_config.json, or {} where the directory has none."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return config if isinstance(config, dict) else {}


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        return {name: root / file for name, file in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {model_dir} (a directory without weights needs model.load_format 'dummy')")
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    where[name] = file
        except SafetensorError as exc:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}") from exc
    return where


def load_tensors(
    model_dir: str | Path,
    expected: Iterable[str],
    *,
    optional: Iterable[str] = (),
    dtype: torch.dtype,
    device: str | torch.device,
    stored_dtype: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Load exactly the `expected` tensors (plus any of `optional` present),
    cast to `dtype` on `device` (those named in `stored_dtype` keep their own:
    FP8 codes stay FP8, scales are made fp32).

    Raises ValueError naming missing tensors, and tensors in the checkpoint
    that the model does not know (a sign of a wrong architecture).
    """
    where = weight_files(model_dir)
    expected = list(expected)
    optional_set = set(optional)
    missing = [name for name in expected if name not in where]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint in {model_dir} is missing tensors: {', '.join(missing[:8])}{more}")
    known = set(expected) | optional_set
    unexpected = sorted(n for n in where if n not in known and not n.endswith(IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(f"checkpoint in {model_dir} has tensors the model does not use: {', '.join(unexpected[:8])}")

    wanted = [name for name in where if name in known]
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(where[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    if name in stored_dtype:
                        keep = tensor.dtype if tensor.dtype == torch.float8_e4m3fn else torch.float32
                        out[name] = tensor.to(device=device, dtype=keep)
                    else:
                        out[name] = tensor.to(device=device, dtype=dtype)
        except SafetensorError as exc:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}") from exc
    return out
