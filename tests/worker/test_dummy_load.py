"""The dummy load format: a model built from config.json alone with seeded random
weights, equal in every process of a deployment (vLLM's ``--load-format dummy``)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserving import cli
from kvserving.config import ModelConfig, ServingConfig
from kvserving.worker.model import DenseCausalAttention, load_dummy_model, load_model
from kvserving.tiny_model import QWEN3_8B_CONFIG

PROMPT = [5, 17, 300, 42, 99, 7, 1000, 3]

# Logits of PROMPT's last position under the dummy weights of (model dir, seed, device),
# printed as a digest of their bytes: run in a child process to prove two processes agree.
_LOGITS_SCRIPT = """
import hashlib, sys, torch
from kvserving.worker.model import DenseCausalAttention, load_dummy_model
model_dir, seed, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dtype = torch.bfloat16 if device == "cuda" else torch.float32
args, model = load_dummy_model(model_dir, seed=seed, dtype=dtype, device=device)
ids = torch.tensor({prompt}, device=device)
with torch.no_grad():
    hidden = model(ids, torch.arange(len(ids), device=device), DenseCausalAttention())
    logits = model.compute_logits(hidden[-1:])[0].cpu()
print(hashlib.sha256(logits.numpy().tobytes()).hexdigest())
"""


def weightless_dir(tiny_model_dir: Path, dest: Path) -> Path:
    """The tiny model's config and tokenizer without its safetensors."""
    dest.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    return dest


def child_logits_digest(model_dir: Path, seed: int, device: str) -> str:
    script = _LOGITS_SCRIPT.format(prompt=PROMPT)
    out = subprocess.run(
        [sys.executable, "-c", script, str(model_dir), str(seed), device], capture_output=True, text=True, timeout=600, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def test_dummy_weights_are_seeded_and_read_no_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = weightless_dir(tiny_model_dir, tmp_path / "m")
    with pytest.raises(ValueError, match="load_format 'dummy'"):
        load_model(d)
    args, a = load_dummy_model(d, seed=0)
    _, b = load_dummy_model(d, seed=0)
    _, c = load_dummy_model(d, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # Every non-norm weight is drawn: seed 1 differs from seed 0 in each; norms are 1.
    for k in sa:
        if k.endswith("norm.weight"):
            assert torch.equal(sa[k], torch.ones_like(sa[k])) and torch.equal(sc[k], sa[k])
        elif k != "inv_freq":
            assert not torch.equal(sa[k], sc[k]), k
            assert abs(float(sa[k].std()) - 0.02) < 0.002, k  # N(0, 0.02) over thousands of values
    assert args.num_layers == 4 and sa["embed_tokens.weight"].shape == (args.vocab_size, args.hidden_size)


def test_two_processes_build_the_same_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = weightless_dir(tiny_model_dir, tmp_path / "m")
    _, model = load_dummy_model(d, seed=7)
    with torch.no_grad():
        hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), DenseCausalAttention())
        here = model.compute_logits(hidden[-1:])[0]
    digest = hashlib.sha256(here.numpy().tobytes()).hexdigest()
    assert child_logits_digest(d, 7, "cpu") == digest
    assert child_logits_digest(d, 8, "cpu") != digest


def test_engine_serves_a_dummy_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from kvserving.worker.engine import LLMEngine
    from kvserving.worker.sampling import SamplingParams

    d = weightless_dir(tiny_model_dir, tmp_path / "m")
    config = ServingConfig(model=ModelConfig(path=str(d), load_format="dummy", seed=3))
    engine = LLMEngine(config)
    _, model = load_dummy_model(d, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), model.parameters(), strict=True))
    out = engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0]) == 4


def test_config_refuses_an_unknown_load_format() -> None:
    with pytest.raises(ValueError, match="model.load_format"):
        ServingConfig.from_dict({"model": {"load_format": "npz"}})
    with pytest.raises(ValueError, match="model.seed"):
        ModelConfig(seed=-1)


def test_cli_writes_a_weightless_qwen3_8b_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q8b"
    assert cli.main(["tiny-model", str(out), "--shape", "qwen3-8b"]) == 0
    assert "--load-format dummy" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert config[key] == QWEN3_8B_CONFIG[key]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (36, 4096, 8)
    assert (out / "tokenizer.json").is_file() and not list(out.glob("*.safetensors"))


@pytest.mark.gpu
@pytest.mark.gpu_alone
def test_qwen3_8b_dummy_logits_equal_in_two_gpu_processes(tmp_path: Path) -> None:
    out = tmp_path / "q8b"
    assert cli.main(["tiny-model", str(out), "--shape", "qwen3-8b"]) == 0
    first = child_logits_digest(out, 0, "cuda")
    assert child_logits_digest(out, 0, "cuda") == first
    assert child_logits_digest(out, 1, "cuda") != first


@pytest.mark.gpu
@pytest.mark.gpu_alone
def test_one_gpu_stack_serves_the_8b_shape_and_pulls_back(tmp_path: Path) -> None:
    """Prefill and decode worker of the Qwen3-8B shape share GPU 0, each with its own KV
    budget; turn 2 pulls the decode worker's KV back over NIXL on the same device."""
    from openai import OpenAI

    from kvserving.config import KVCacheConfig
    from kvserving.local.stack import LocalStack, StackSpec, free_ports
    from kvserving.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "q8b", shape="qwen3-8b")
    config = ServingConfig(
        model=ModelConfig(path=str(model_dir), load_format="dummy"), kv_cache=KVCacheConfig(dtype="nvfp4", memory_bytes=4 << 30)
    )
    gateway, prefill, decode = free_ports(3)
    spec = StackSpec(config=config, gateway_port=gateway, prefill_port=prefill, decode_port=decode, run_dir=tmp_path / "run", gpus=("0",))
    with LocalStack(spec) as stack:
        stack.start()
        stack.wait_ready(timeout_s=600)
        client = OpenAI(base_url=stack.openai_base_url, api_key="unused", max_retries=0, timeout=300)
        messages = [
            {"role": "system", "content": "You review code. " * 200},
            {"role": "user", "content": "Find the bug in this function. " * 20},
        ]
        first = client.chat.completions.create(
            model=config.model.served_name,
            messages=messages,
            max_tokens=128,
            temperature=0.0,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Session-ID": "gpu-stack"},
        )
        assert first.usage is not None and first.usage.completion_tokens == 128
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""}, {"role": "user", "content": "Now fix it."}]
        second = client.chat.completions.create(
            model=config.model.served_name,
            messages=messages,
            max_tokens=8,
            temperature=0.0,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Session-ID": "gpu-stack"},
        )
        assert second.usage is not None
        ext = (second.usage.model_extra or {}).get("kvserving") or {}
        # The history (prompt and reply of turn 1) comes back from the decode worker, not recomputed.
        assert ext.get("reuse_fallback") is None, ext
        assert ext.get("remote_pulled_tokens", 0) > 0, ext
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
