"""The FP8 linear layer (E4M3 weight codes with fp32 scales, run by ``kernels.fp8_gemm``), and how a
checkpoint's FP8 tensors, or a layer's weight quantized at load, become it.

A merged projection (q/k/v, gate/up) stacks its checkpoint parts along the output rows,
so the scales keep each part's own value on its rows::

    fp8 (per tensor)   weight [N, K] e4m3   weight_scale [N] fp32        (part i's scalar on its rows)
                       input_scale [] fp32  (static activation scheme: the parts' largest, as every
                                             part reads the same input; else per token on the fly)
    fp8_block          weight [N, K] e4m3   weight_scale [N/128, K/128]  (parts' tiles stacked; each
                                             part's rows a multiple of 128)

On CUDA with bf16 activations the forward is the FP8 GEMM (``fp8_gemm.linear_cuda``);
elsewhere it is the reference: the weight dequantized, then the matmul in the activation's
dtype (``fp8_gemm.linear_ref``), which the tests hold the logits to. ``set_backend``
picks the block-scaled GEMM ("cublas", "triton"; "auto": cuBLASLt where it runs) or
"torch": the GPU GEMMs' arithmetic in torch on any device (``fp8_gemm.linear_quantized_ref``,
activations quantized too), which shows on CPU what the GPU path does to the tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from kvserving.kernels import fp8_gemm
from kvserving.worker.weights import Fp8Scheme

# weight format -> the GEMM's scale layout
SCHEMES = {"fp8": "rows", "fp8_block": "block"}
BACKENDS = (*fp8_gemm.BLOCK_BACKENDS, "torch")


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W stored as E4M3 codes and fp32 scales (module docstring).

    ``backend``: one of ``BACKENDS`` (module docstring; ``set_backend``)."""

    weight: Tensor
    weight_scale: Tensor
    input_scale: Tensor | None
    scale_cublas: Tensor | None

    def __init__(
        self, in_features: int, out_features: int, *, weight_format: str, bias: bool = False,
        static_input: bool = False, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if weight_format not in SCHEMES:
            raise ValueError(f"weight_format must be one of {sorted(SCHEMES)}, got {weight_format!r}")
        self.in_features, self.out_features = in_features, out_features
        self.weight_format = weight_format
        self.scheme = SCHEMES[weight_format]
        self.backend = "auto"
        n, k = out_features, in_features
        scale_shape = (n,) if self.scheme == "rows" else (math.ceil(n / fp8_gemm.BLOCK), math.ceil(k / fp8_gemm.BLOCK))
        self.register_buffer("weight", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.empty((), dtype=torch.float32, device=device) if static_input else None)
        self.register_buffer("scale_cublas", None, persistent=False)
        self.bias = nn.Parameter(torch.empty(n, device=device, dtype=dtype), requires_grad=False) if bias else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight_format={self.weight_format}"

    def prepare(self) -> None:
        """Build what the GPU path reads besides the checkpoint's tensors (the cuBLASLt scale layout) and decide,
        eagerly (never inside a graph capture), whether cuBLASLt's block-scaled GEMM runs here."""
        if self.scheme != "block" or not self.weight.is_cuda:
            return
        if fp8_gemm.cublas_block_supported(self.weight.device.index or 0):
            self.scale_cublas = fp8_gemm.cublas_block_scales(self.weight_scale)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [T, K]
        if self.backend == "torch":
            out = fp8_gemm.linear_quantized_ref(
                x2, self.weight, self.weight_scale, scheme=self.scheme, input_scale=self.input_scale, bias=self.bias
            ).to(x.dtype)
        elif fp8_gemm.cuda_supported(x2):
            backend = self.backend if self.scale_cublas is not None or self.backend != "auto" else "triton"
            out = fp8_gemm.linear_cuda(
                x2, self.weight, self.weight_scale, scheme=self.scheme, input_scale=self.input_scale,
                bias=self.bias, scale_cublas=self.scale_cublas, backend=backend,
            )  # fmt: skip
        else:
            out = fp8_gemm.linear_ref(x2, self.weight, self.weight_scale, scheme=self.scheme, bias=self.bias)
        return out.view(*lead, self.out_features)

    def dequantized_weight(self) -> Tensor:
        """The fp32 weight [N, K] the codes and scales stand for."""
        return fp8_gemm.dequantize(self.weight, self.weight_scale, scheme=self.scheme)


def set_backend(model: nn.Module, backend: str) -> int:
    """Set every ``Fp8Linear`` of ``model`` to ``backend`` (``BACKENDS``); returns how many there are."""
    if backend not in BACKENDS:
        raise ValueError(f"FP8 GEMM backend must be one of {BACKENDS}, got {backend!r}")
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in layers:
        m.backend = backend
    return len(layers)


def merge_scales(weight_format: str, part_rows: Sequence[int], scales: Sequence[Tensor], *, name: str) -> Tensor:
    """The checkpoint parts' scales (per tensor: [] each; block: [rows_i/128, K/128] each) as the merged layer's."""
    if weight_format == "fp8":
        for s, what in zip(scales, part_rows, strict=True):
            if s.numel() != 1:
                raise ValueError(f"{name}: weight_scale must hold one value per tensor, got shape {tuple(s.shape)} "
                                 f"for {what} rows (per-channel FP8 is not supported)")  # fmt: skip
        return torch.cat([s.float().reshape(1).expand(rows) for s, rows in zip(scales, part_rows, strict=True)])
    if len(scales) > 1 and any(rows % fp8_gemm.BLOCK for rows in part_rows):
        raise ValueError(f"{name}: merging block-scaled parts of {list(part_rows)} rows needs each a multiple of "
                         f"{fp8_gemm.BLOCK}")  # fmt: skip
    return torch.cat([s.float() for s in scales])


def quantize_weight(weight: Tensor, part_rows: Sequence[int], *, weight_format: str) -> tuple[Tensor, Tensor]:
    """(codes, merged scales) of a merged weight [N, K] quantized as a checkpoint would be: per tensor each part
    (``part_rows`` split the rows), block the 128x128 tiles."""
    if weight_format == "fp8_block":
        return fp8_gemm.quantize_blocks(weight)
    codes, scales = [], []
    for part in weight.split(list(part_rows)):
        c, s = fp8_gemm.quantize_tensor(part)
        codes.append(c)
        scales.append(s)
    return torch.cat(codes), merge_scales("fp8", part_rows, scales, name="quantize")


def from_linear(linear: nn.Linear, part_rows: Sequence[int], *, weight_format: str) -> Fp8Linear:
    """An ``Fp8Linear`` holding ``linear``'s weight quantized (dynamic activation scales), on its device."""
    w = linear.weight
    out = Fp8Linear(w.shape[1], w.shape[0], weight_format=weight_format, bias=linear.bias is not None,
                    device=w.device, dtype=w.dtype)  # fmt: skip
    codes, scale = quantize_weight(w.detach(), part_rows, weight_format=weight_format)
    out.weight, out.weight_scale = codes, scale
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    out.prepare()
    return out


@torch.no_grad()
def quantize_layers(model: nn.Module, parts_of: dict[str, list[tuple[str, int]]], *, weight_format: str) -> None:
    """Replace each ``nn.Linear`` named in ``parts_of`` (module name -> its checkpoint parts (name, rows)) by
    ``from_linear`` of it, in place."""
    for module, parts in parts_of.items():
        parent, _, leaf = module.rpartition(".")
        holder = model.get_submodule(parent)
        setattr(holder, leaf, from_linear(getattr(holder, leaf), [rows for _, rows in parts], weight_format=weight_format))


def checkpoint_fp8_layers(
    model: nn.Module, parts_of: dict[str, list[tuple[str, int]]], scheme: Fp8Scheme, names: set[str]
) -> dict[str, list[tuple[str, int]]]:
    """The linear layers the checkpoint stores in FP8 (their scale tensors are there; layers a checkpoint leaves
    unquantized, e.g. ``ignored_layers``, have none), swapped in ``model`` for meta ``Fp8Linear``s."""
    out: dict[str, list[tuple[str, int]]] = {}
    for module, parts in parts_of.items():
        has = [f"{hf}.{scheme.scale_name}" in names for hf, _ in parts]
        if any(has) and not all(has):
            raise ValueError(f"checkpoint stores only some of {[hf for hf, _ in parts]} in FP8: they cannot be merged")
        if not all(has):
            continue
        parent, _, leaf = module.rpartition(".")
        holder = model.get_submodule(parent)
        old = getattr(holder, leaf)
        setattr(holder, leaf, Fp8Linear(old.in_features, old.out_features, weight_format=scheme.weight_format,
                                        bias=old.bias is not None, static_input=scheme.static_input, device="meta"))  # fmt: skip
        out[module] = parts
    return out


def checkpoint_fp8_state(
    parts_of: dict[str, list[tuple[str, int]]], tensors: dict[str, Tensor], scheme: Fp8Scheme, in_features: dict[str, int]
) -> dict[str, Tensor]:
    """The FP8 layers' buffers (state-dict entries) from the checkpoint's tensors (popped from ``tensors``), each
    layer's parts merged."""
    state: dict[str, Tensor] = {}
    for module, parts in parts_of.items():
        k = in_features[module]
        codes, scales, inputs = [], [], []
        for hf, rows in parts:
            w = tensors.pop(f"{hf}.weight")
            if w.dtype != torch.float8_e4m3fn:
                raise ValueError(f"tensor {hf}.weight is {w.dtype}, but quantization_config says FP8 (float8_e4m3fn)")
            if tuple(w.shape) != (rows, k):
                raise ValueError(f"tensor {hf}.weight has shape {tuple(w.shape)}, config implies {(rows, k)}")
            s = tensors.pop(f"{hf}.{scheme.scale_name}")
            if scheme.weight_format == "fp8_block" and tuple(s.shape) != (math.ceil(rows / 128), math.ceil(k / 128)):
                raise ValueError(f"tensor {hf}.weight_scale_inv has shape {tuple(s.shape)}, "
                                 f"128x128 tiles of {(rows, k)} imply {(math.ceil(rows / 128), math.ceil(k / 128))}")  # fmt: skip
            codes.append(w)
            scales.append(s)
            if scheme.static_input:
                inputs.append(tensors.pop(f"{hf}.input_scale").float().reshape(()))
        state[f"{module}.weight"] = torch.cat(codes)
        state[f"{module}.weight_scale"] = merge_scales(scheme.weight_format, [r for _, r in parts], scales, name=module)
        if scheme.static_input:
            # one input feeds every part: its largest scale saturates none of them
            state[f"{module}.input_scale"] = torch.stack(inputs).max()
    return state
