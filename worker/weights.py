"""Reading a Hugging Face model directory: config.json and safetensors weights
by their Hugging Face tensor names (one file or a sharded index)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

# Tensors some checkpoints carry that no model needs (recomputed at load).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
) -> dict[str, torch.Tensor]:
    """Load exactly the `expected` tensors (plus any of `optional` present),
    cast to `dtype` on `device`.

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
                    out[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except SafetensorError as exc:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {exc}") from exc
    return out
