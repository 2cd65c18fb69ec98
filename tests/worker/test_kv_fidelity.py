"""Per-layer attention-output error of each quantized KV format against the
unquantized cache, on real K/V/Q of the tiny model.

Measure: relative Frobenius error of the decode output ||o - o_ref|| / ||o_ref||.
The output is a softmax-weighted mean of V rows; averaging shrinks the error
and the (random-signed) output alike, so the relative output error tracks
the RMS relative rounding error of one element, plus a smaller share from
K's error perturbing the logits. Predicted RMS element error per format, and
the bound (prediction + room for the K share, which is of the same order):

- fp8 E4M3: uniform error over a 2^-3 relative mantissa step: 2^-3/sqrt(12)
  = 0.036; bound 2^-4.
- nvfp4: block scale S = amax/6 with amax ~ 2 sigma over 16 Gaussian values
  (S ~ 0.35 sigma); grid steps 0.5/1/2 S in the three magnitude bands give a
  mean squared step ~0.9 S^2, RMS error ~0.28 S ~ 0.1 sigma; bound 0.2.
- triaxial INT4: range of 32 Gaussian values ~ 4.1 sigma, step range/15,
  RMS step/sqrt(12) ~ 0.08 sigma; bound 0.15.
- triaxial INT2 pages: step range/3 ~ 1.4 sigma, RMS ~ 0.4 sigma for values
  and for keys (per channel over 32 tokens); bound 0.7.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserving.kernels.page_ids import INT2_PAGE_FLAG
from kvserving.worker.kv.storage import KVShape, KVStorage
from kvserving.worker.model import dense_causal_attention, load_model

SEQ = 96  # three full pages of 32 (triaxial) / six of 16


class Recorder:
    """AttentionOp that records each layer's q/k/v of one prefill."""

    def __init__(self) -> None:
        self.qkv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.qkv[layer] = (q, k, v)
        return dense_causal_attention(q, k, v)


@pytest.fixture(scope="module")
def recorded(tiny_model_dir: Path) -> tuple[object, Recorder]:
    args, model = load_model(tiny_model_dir)
    rec = Recorder()
    ids = torch.randint(10, args.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model(ids, torch.arange(SEQ), rec)
    return args, rec


def decode_error(args: object, rec: Recorder, kv_dtype: str, *, int2: bool = False) -> list[float]:
    page = 32 if kv_dtype == "triaxial" else 16
    shape = KVShape(args.num_layers, args.num_kv_heads, args.head_dim)  # type: ignore[attr-defined]
    st = KVStorage(kv_dtype, shape, page_size=page, budget_bytes=8 << 20, model_dtype=torch.float32)
    n_pages = SEQ // page
    sm = args.head_dim**-0.5  # type: ignore[attr-defined]
    errors = []
    for layer, (q, k, v) in rec.qkv.items():
        if int2:
            ids = torch.tensor([i | INT2_PAGE_FLAG for i in range(n_pages)], dtype=torch.int32)
            st.write_int2_pages(layer, k.view(n_pages, page, *k.shape[1:]), v.view(n_pages, page, *v.shape[1:]), ids)
        else:
            ids = torch.arange(n_pages, dtype=torch.int32)
            st.write(layer, k, v, ids.repeat_interleave(page), torch.arange(SEQ, dtype=torch.int32) % page)
        out = st.decode(
            layer,
            q[-1:],
            ids.view(1, -1),
            torch.tensor([SEQ], dtype=torch.int32),
            sm_scale=sm,
            num_int2_pages=torch.tensor([n_pages if int2 else 0], dtype=torch.int32),
        )
        ref = dense_causal_attention(q[-1:], k, v)
        errors.append(float((out - ref).norm() / ref.norm()))
    return errors


@pytest.mark.parametrize(
    ("kv_dtype", "int2", "bound"),
    [("bf16", False, 1e-6), ("fp8_e4m3", False, 2**-4), ("nvfp4", False, 0.2), ("triaxial", False, 0.15), ("triaxial", True, 0.7)],
)
def test_attention_error_per_layer_within_format_bound(recorded: tuple, kv_dtype: str, int2: bool, bound: float) -> None:
    args, rec = recorded
    errors = decode_error(args, rec, kv_dtype, int2=int2)
    assert len(errors) == args.num_layers
    assert max(errors) <= bound, errors
    if kv_dtype != "bf16":
        assert min(errors) > 0  # a quantized cache that reproduces fp32 exactly is not quantizing


def test_error_ordering_follows_bits(recorded: tuple) -> None:
    args, rec = recorded
    mean = {
        name: sum(e) / len(e)
        for name, e in {
            "fp8": decode_error(args, rec, "fp8_e4m3"),
            "nvfp4": decode_error(args, rec, "nvfp4"),
            "int4": decode_error(args, rec, "triaxial"),
            "int2": decode_error(args, rec, "triaxial", int2=True),
        }.items()
    }
    assert mean["fp8"] < mean["nvfp4"] < mean["int2"]
    assert mean["int4"] < mean["int2"]
