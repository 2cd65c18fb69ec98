"""What each KV format costs in model quality, on a model trained here (no downloads).

    .venv/bin/python bench/fidelity.py --section NAME       # CPU config, section NAME of bench/results/fidelity_cpu.json
    python bench/fidelity.py --device cuda --out X.json     # GPU config (~57M parameters, 2K and 8K context)
    .venv/bin/python bench/fidelity.py --combine bench/results/fidelity_gpu_h200.json X.json \
        --out bench/results/fidelity_gpu_h200.json

One result file per machine (``bench/results_file.py``): each run is a named section of it
(``--section``, default ``main``; the other sections stay), and ``--combine`` joins a run made
elsewhere (a device machine's ``$OUT``) into it.

1. Trains, with a seed, a small Qwen3-style decoder (GQA, head_dim 128, RoPE,
   q/k-norm) with the worker's own model code on agent conversations built from
   the Python standard library's ``.py`` sources (every machine has them):
   ``kvserving.calibrate.data.agent_wrap`` gives them the shape of the agent load
   generator's agents (system prompt, tool schemas, turns of user request or
   tool result, replies that quote the latest result and call the next tool),
   rendered by the gateway's chat template, so the model learns the template
   (its delimiters) and to look back into tool results. Every 10th file (sorted
   by path) is held out, so held-out text is unseen code. Residual dropout
   during training. The tokenizer is the built-in tiny model's byte-level BPE.
   Random weights lack what makes KV quantization hard (outlier channels,
   attention sinks); a trained model has them.
2. Calibrates it with ``kvserving.calibrate.measure`` on held-out files the evaluation
   does not use, wrapped the same way, at the first evaluation context (D_k by
   next-token KL, prefilled in chunks of ``--chunk`` like the evaluation;
   ``--metric attn`` for DESIGN.md's attention-output MSE). At a longer context
   the tables are counted on the calibration text's pages at that context
   (``kvserving calibrate --page-seq-len``); ``--calibrate-at-context`` adds
   tables whose D_k are measured on the calibration text wrapped at that
   context too (rows ``calibrated@<ctx>``). ``--diagnose`` adds the other
   metric's tables, the attention-MSE 2.7 table with the system prompt at 4
   bits, and every table's KL and attention MSE measured whole on the
   calibration prompts against the per-class sums; every run prints the paired
   per-conversation KL comparison against default@pages. ``--count-on-evaluation``
   counts every table's budget on the evaluation conversations' pages instead (their
   tags only), so each table stores its budget on the text it is scored on: the held-out
   text's page mix differs from the calibration text's, and at 8K the calibrated tables
   stored 0.02-0.05 fewer bits there than default@pages (docs/performance-log/fidelity.md).
3. Scores held-out files (the first ``--eval-seqs`` conversations of at least
   half the context; how many the evaluation files give is recorded; only if
   they give too few, the standard library's test suites, idlelib and lib2to3,
   which ``stdlib_files`` never gives to training or calibration, supply the
   rest: ``evaluation_conversations``), wrapped the same way and tagged by the gateway's
   tagger (the real 56 classes at agent-context shares), through the engine's
   real KV path for each format: pages from the engine's pool,
   quantize-on-write, the extend path (chunked prefill over the dequantized
   cached prefix) for perplexity, then the decode path for greedy generation.
   - perplexity over every token of each sequence (chunks of ``--chunk`` tokens;
     the first chunk attends on fresh K/V, later ones on the cache), and over
     the reply tokens alone (assistant text: the quotes, where attention decides);
   - KL divergence of the next-token distribution from the unquantized KV's,
     mean over tokens, and top-1 agreement (share of positions whose argmax
     matches), both teacher-forced: far less noisy than perplexity differences;
   - greedy agreement: prompt = the sequence minus its last N tokens, N tokens
     generated greedily; the position of the first token that differs from the
     unquantized KV's (N if none; ``--generate 0`` skips it: the generation
     prefills every conversation again, with nothing the KL rows need);
   - per layer, the attention-output relative error ||o - o_exact|| / ||o_exact||,
     o_exact the same layer's attention over unquantized K/V of the same tokens.
   Formats: bf16 (unquantized; fp32 on CPU, where the model runs in fp32),
   fp8 and nvfp4 at global scale 1 and calibrated, triaxial at 2.5/2.7/3.0/3.5
   bits (``--budgets``: some of them, per context) with (a) the engine's
   default table (default priorities, budget counted
   in stored pages on the agent pages of ``kvserving.agents.pages``), (b) "default@pages": the default
   priorities through the calibration's page-counted greedy rule on the same
   calibration data (the equal-cost baseline), (c) the calibrated table, and
   (d) "held": no table, the bit-budget controller (``bit_budget_control: hold``,
   the default ranking) holding the budget on the scored text, and (e) "held
   calibrated": the same controller on the calibrated ranking (as an engine
   given the calibration file builds it: the greedy gain-per-bit order of its priorities on its
   pages, ``kvserving.worker.kv.cache.budget_controller``). A held row's engine is
   warmed first on the scored conversations' tags, as a deployment that has
   served this traffic (``warm_up``: admitted and released without computing
   K/V until one whole pass stores within +-0.05 bits of the budget); every
   scored sequence is admitted as the scheduler admits a prompt (``admit``), so
   the controller keeps counting while the row is scored.
   ``bits`` is what the sequences actually stored: a page is INT2 only if all
   of its 32 tokens are 2-bit (DESIGN.md).

Writes its section of ``--out`` after each scored row (a context still running is marked
``partial``: a run stopped by a time limit keeps what it finished) and prints one table.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import combine, write_section  # noqa: E402  (bench/ beside this file)

from kvserving.bits import bits_table_for_budget, count_page_mixes, default_sensitivity, format_bits_table, page_records
from kvserving.calibrate import METRICS
from kvserving.calibrate.data import TaggedSeq, agent_wrap, chars_per_token, load_data
from kvserving.calibrate.measure import calibrate, capture_qkv, select_tables
from kvserving.calibrate.kl import kl_sum, log_probs, predicted, table_attn_distortion, table_bits
from kvserving.calibration import Calibration, budget_key
from kvserving.config import KVCacheConfig, ModelConfig, SchedulerConfig, ServingConfig
from kvserving.gateway.prompt.chat_template import ChatTemplate, normalize_messages, normalize_tools
from kvserving.gateway.prompt.tagger import ChatTagger
from kvserving.gateway.prompt.tokenizer import TextTokenizer
from kvserving.model_dir import tiny_model_dir
from kvserving.worker.attention import causal_attention
from kvserving.worker.bit_budget import WINDOW_PAGES
from kvserving.worker.engine import LLMEngine
from kvserving.worker.kv.cache import budget_controller
from kvserving.worker.model import DecoderModel, ModelArgs, load_model
from kvserving.worker.sampling import SamplingParams, make_generator
from kvserving.worker.sequence import ScheduledChunk, Sequence
from kvserving.tags import NUM_TAGS, SEMANTIC, decode_tag
from kvserving.progress import add_quiet_argument, progress

BUDGETS = (2.5, 2.7, 3.0, 3.5)


@dataclass(frozen=True)
class Setup:
    """One hardware config: model size, training and evaluation sizes."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    train_steps: int
    train_len: int
    batch: int
    lr: float
    contexts: tuple[int, ...]  # evaluation context lengths
    eval_seqs: int  # sequences per context
    generate: int  # greedy tokens per sequence
    calib_tokens: int
    calib_len: int  # tokens per calibration prompt
    chunk: int
    dropout: float = 0.1  # residual dropout (attention and MLP outputs) while training
    train_chars: int = 3_000_000  # training text cap, characters of source before wrapping
    val_chars: int = 400_000  # held-out text for the training log's loss, characters


# Every held-out evaluation conversation (36) and 64K calibration tokens: with 8 conversations and 16K tokens
# (Runs 4-7) the tables' KL differences stayed within noise, and the calibration's class mix was not the
# evaluation's (docs/performance-log/fidelity.md, Run 7c). ~20 min on an idle 2-core machine.
CPU = Setup(
    layers=2,
    hidden=256,
    heads=4,
    kv_heads=2,
    intermediate=512,
    train_steps=300,
    train_len=512,
    batch=2,
    lr=3e-3,
    contexts=(2048,),
    eval_seqs=36,
    generate=64,
    calib_tokens=65536,
    calib_len=2048,
    chunk=256,
    dropout=0.0,
    train_chars=1_500_000,
)
# ~2 passes over the deep stdlib's sources as conversations (~5M tokens): more passes over-fit (held-out
# perplexity rises while the training loss falls; the first GPU run's 8 passes reached 155 at 2K).
GPU = Setup(
    layers=8,
    hidden=768,
    heads=6,
    kv_heads=2,
    intermediate=2048,
    train_steps=400,
    train_len=2048,
    batch=12,
    lr=1.5e-3,
    contexts=(2048, 8192),
    eval_seqs=4,
    generate=256,
    calib_tokens=32768,
    calib_len=2048,
    chunk=512,
    dropout=0.1,
    train_chars=12_000_000,
)
# A larger CPU model (--size large, ~13M parameters, ~30 min on an idle 2-core machine): does a model
# that has learned more spread the per-class sensitivities the calibration measures?
CPU_LARGE = Setup(
    layers=4,
    hidden=512,
    heads=4,
    kv_heads=2,
    intermediate=1024,
    train_steps=400,
    train_len=1024,
    batch=4,
    lr=2e-3,
    contexts=(2048,),
    eval_seqs=8,
    generate=64,
    calib_tokens=16384,
    calib_len=2048,
    chunk=256,
    dropout=0.0,
    train_chars=3_000_000,
)
# A minute-long end-to-end check of the harness itself (--smoke); its numbers mean nothing.
SMOKE = Setup(
    layers=2,
    hidden=256,
    heads=4,
    kv_heads=2,
    intermediate=512,
    train_steps=2,
    train_len=128,
    batch=2,
    lr=3e-3,
    contexts=(256, 512),
    eval_seqs=1,
    generate=8,
    calib_tokens=512,
    calib_len=256,
    chunk=64,
    train_chars=100_000,
    val_chars=50_000,
)  # 2 steps of 2 x 128 tokens: text for ~20 steps
HEAD_DIM = 128


# ---------------------------------------------------------------- data and training
def stdlib_files(*, deep: bool = False) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the standard library's .py sources (top level, or every
    package but tests and site-packages when ``deep``); every 10th file by sorted path is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = root.rglob("*.py") if deep else root.glob("*.py")
    skip = ("test", "tests", "site-packages", "idlelib", "lib2to3")
    files = sorted(
        p for p in found if p.is_file() and p.stat().st_size > 2000 and not any(part in skip for part in p.relative_to(root).parts[:-1])
    )
    return [p for i, p in enumerate(files) if i % 10], [p for i, p in enumerate(files) if i % 10 == 0]


EXTRA_CHARS = 3_000_000  # at most this much of extra_held_out_files' text


def extra_held_out_files() -> list[Path]:
    """Standard-library sources that ``stdlib_files`` never gives (so neither training nor calibration
    reads them): the test suites, idlelib and lib2to3, where installed (a distribution may ship none);
    never site- or dist-packages (not the standard library). Files over 2000 bytes, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    held = ("test", "tests", "idlelib", "lib2to3")
    out = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts[:-1]
        if (
            any(part in held for part in parts)
            and not any(part in ("site-packages", "dist-packages") for part in parts)
            and p.is_file()
            and p.stat().st_size > 2000
        ):
            out.append(p)
    return sorted(out)


def joined_text(files: list[Path], max_chars: int) -> str:
    """The files' sources, in order, separated by blank lines, up to ``max_chars`` characters."""
    parts, n = [], 0
    for p in files:
        if n >= max_chars:
            break
        text = p.read_text(encoding="utf-8", errors="replace")[: max_chars - n]
        parts.append(text)
        n += len(text) + 2
    return "\n\n".join(parts)


def conversation_ids(text: str, tagger: ChatTagger, *, context: int, seed: int) -> list[int]:
    """``text`` wrapped as agent conversations planned for ``context`` tokens, each rendered by the
    chat template and tokenized, concatenated (every conversation starts with its system turn).
    Long texts are cut into pieces of ~300K characters built in parallel (fork; one per core)."""
    cpt = chars_per_token(tagger, text)
    piece = 300_000
    jobs = [(text[i : i + piece], context, seed * 1000 + n, cpt) for n, i in enumerate(range(0, len(text), piece))]
    global _TAGGER
    _TAGGER = tagger
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        parts = [_conversation_piece(j) for j in jobs]
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            parts = list(pool.map(_conversation_piece, jobs))
    return [t for part in parts for t in part]


_TAGGER: ChatTagger | None = None  # conversation_ids' tagger, inherited by its forked workers


def _conversation_piece(job: tuple[str, int, int, float]) -> list[int]:
    text, context, seed, cpt = job
    assert _TAGGER is not None
    ids: list[int] = []
    for req in agent_wrap(text, name="stdlib", chars_per_token=cpt, context_tokens=context, seed=seed):
        rendered = _TAGGER.template.render(normalize_messages(req.messages), tools=normalize_tools(req.tools), add_generation_prompt=False)
        ids += _TAGGER.tokenizer.encode_ids(rendered)
    return ids


def model_config(s: Setup, vocab: int, eos: int, max_pos: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


class BatchCausal:
    """AttentionOp for training: the flat token batch is ``batch`` sequences of equal length."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        t = q.shape[0] // b
        # [B, H, T, D]
        qh, kh, vh = (x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)


@torch.no_grad()
def held_out_loss(model: DecoderModel, s: Setup, val: torch.Tensor, *, device: torch.device) -> float:
    """Mean next-token loss on (up to) 4 x ``batch`` fixed windows of held-out ids, no dropout."""
    was = model.training
    model.eval()
    attn = BatchCausal(s.batch)
    positions = torch.arange(s.train_len, device=device).repeat(s.batch)
    n = s.train_len + 1
    starts = torch.linspace(0, len(val) - n - 1, 4 * s.batch).long().tolist()
    total = 0.0
    for i in range(0, len(starts), s.batch):
        batch = torch.stack([val[j : j + n] for j in starts[i : i + s.batch]]).to(device)
        logits = model.compute_logits(model(batch[:, :-1].reshape(-1), positions, attn))
        total += float(F.cross_entropy(logits.float(), batch[:, 1:].reshape(-1)))
    model.train(was)
    return total / (len(starts) // s.batch)


def train(
    s: Setup, cfg: dict[str, Any], ids: torch.Tensor, val: torch.Tensor, *, device: torch.device, seed: int, quiet: bool = False
) -> tuple[DecoderModel, list[float], list[tuple[int, float]]]:
    torch.manual_seed(seed)
    args = ModelArgs.from_config(cfg)
    model = DecoderModel(args).to(device)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02 if "embed" not in name else 1.0)
    model.inv_freq = model.inv_freq.to(device)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    hooks = (
        [
            m.register_forward_hook(lambda mod, inp, out: F.dropout(out, s.dropout, training=mod.training))
            for name, m in model.named_modules()
            if name.endswith((".self_attn", ".mlp"))
        ]
        if s.dropout > 0
        else []
    )
    model.train()
    gen = torch.Generator().manual_seed(seed)
    attn = BatchCausal(s.batch)
    positions = torch.arange(s.train_len, device=device).repeat(s.batch)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    losses: list[float] = []
    val_losses: list[tuple[int, float]] = []
    warm = max(1, s.train_steps // 20)
    for step in progress(range(s.train_steps), desc="train", quiet=quiet):
        lr = s.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / s.train_steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(ids) - s.train_len - 1, (s.batch,), generator=gen)
        batch = torch.stack([ids[i : i + s.train_len + 1] for i in starts.tolist()]).to(device)
        with amp:
            hidden = model(batch[:, :-1].reshape(-1), positions, attn)
            logits = model.compute_logits(hidden)
        loss = F.cross_entropy(logits.float(), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % max(1, s.train_steps // 5) == 0 or step == s.train_steps - 1:
            vl = held_out_loss(model, s, val, device=device)
            val_losses.append((step, vl))
            print(f"  train step {step}/{s.train_steps}: loss {losses[-1]:.3f}, held-out {vl:.3f}", file=sys.stderr, flush=True)
    for h in hooks:
        h.remove()
    model.requires_grad_(False)
    return model.eval(), losses, val_losses


def save_model(model: DecoderModel, cfg: dict[str, Any], out: Path, tokenizer_dir: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    state = {n: p.detach().float().cpu().contiguous() for n, p in model.hf_state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------- scoring through the engine
class LayerError:
    """Wraps the engine's PagedAttention: records, per layer, ||o - o_exact||^2 and ||o_exact||^2,
    o_exact = attention over the unquantized K/V of the same sequence (kept here as it streams)."""

    def __init__(self, paged: Any, num_layers: int) -> None:
        self.paged = paged
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.err = [0.0] * num_layers
        self.ref = [0.0] * num_layers

    def reset(self) -> None:
        self.k.clear()
        self.v.clear()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.paged(layer, q, k, v)
        start = 0 if layer not in self.k else self.k[layer].shape[0]
        self.k[layer] = k if layer not in self.k else torch.cat([self.k[layer], k])
        self.v[layer] = v if layer not in self.v else torch.cat([self.v[layer], v])
        ref = causal_attention(q, self.k[layer], self.v[layer], q_offset=start, sm_scale=self.paged.sm_scale)
        self.err[layer] += float((out.float() - ref.float()).pow(2).sum())
        self.ref[layer] += float(ref.float().pow(2).sum())
        return out


REPLY = SEMANTIC.index("assistant")


@dataclass
class Score:
    """Sums over the predicted tokens of the scored sequences."""

    nll: float = 0.0
    count: int = 0
    reply_nll: float = 0.0  # over targets tagged assistant (the replies' quotes)
    reply_count: int = 0
    kl: float = 0.0  # KL(reference || this format) of the next-token distribution
    top1: int = 0  # positions whose argmax equals the reference's


@torch.inference_mode()
def score(
    engine: LLMEngine, ids: list[int], tags: list[int], chunk: int, rec: LayerError, acc: Score, ref: list[torch.Tensor] | None
) -> float:
    """Adds ``ids``' scores through the engine's pool to ``acc``; returns the stored bits per value.
    ``ref``: the reference log-probabilities per chunk (an empty list: this run records them)."""
    seq = admit(engine, ids, tags)
    rec.reset()
    record = ref is not None and not ref
    dev = engine.device
    reply = torch.tensor([decode_tag(t)[2] == "assistant" for t in tags[1:]], device=dev)
    try:
        for s in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - s)
            engine.attention.meta = engine.runner._metadata([ScheduledChunk(seq, s, n)])
            try:
                hidden = engine.model(torch.tensor(ids[s : s + n], device=dev), torch.arange(s, s + n, device=dev), rec)
            finally:
                engine.attention.meta = None
            seq.num_computed = s + n
            logits = engine.model.compute_logits(hidden).float()
            targets = torch.tensor(ids[s + 1 : s + n + 1], device=dev)
            logp = torch.log_softmax(logits[: len(targets)], dim=-1)
            tok = -logp.gather(1, targets[:, None]).squeeze(1)
            mask = reply[s : s + len(targets)]
            acc.nll += float(tok.sum())
            acc.count += len(targets)
            acc.reply_nll += float(tok[mask].sum())
            acc.reply_count += int(mask.sum())
            if ref is not None:
                if record:
                    ref.append(logp.clone())
                r = ref[s // chunk]
                acc.kl += float((r.exp() * (r - logp)).sum())
                acc.top1 += int((r.argmax(-1) == logp.argmax(-1)).sum())
        bits = stored_bits(engine, seq.page_ids, len(ids))
    finally:
        engine.kv.free(seq)
    return bits


def admit(engine: LLMEngine, ids: list[int], tags: list[int]) -> Sequence:
    """A sequence for ``ids`` with pages for all of it, taken as the scheduler admits a prompt:
    ``match_prefix``, then ``allocate_until``. Under the bit-budget controller ``match_prefix`` is
    where the prompt's class mix is counted, so the controller sees the scored traffic as it sees
    served traffic. Nothing matches: the bench never registers a page, so every token is computed."""
    seq = Sequence("score", list(ids), SamplingParams(max_tokens=1), make_generator(0), tags=list(tags))
    if engine.kv.match_prefix(seq):
        raise RuntimeError("a scored sequence matched cached pages: the bench registers none")
    if not engine.kv.allocate_until(seq, len(ids)):
        raise RuntimeError("the KV pool is too small for one scored sequence")
    return seq


WARM_TOLERANCE = 0.05  # bits: a held row is scored once a whole warm-up pass stored within budget +- this
WARM_WINDOWS = 4  # the warm-up stops after this many of the controller's windows of pages, reached or not


def warm_up(engine: LLMEngine, seqs: list[TaggedSeq], budget: float) -> dict[str, Any]:
    """Warms the bit-budget controller of ``engine`` on ``seqs`` (the scored conversations' tags, as
    a deployment that has served this traffic): pass after pass, each conversation admitted
    (``admit``: the controller counts its class mix and looks at the pool) and released, until one
    whole pass stored within ``WARM_TOLERANCE`` of ``budget`` (mean over its conversations, as a row's bits)
    and left the cut where it found it (the scored pass then stores what that pass stored).
    No K/V is computed: the controller reads tags and page precisions only. Returns each pass's
    stored bits, whether the tolerance was reached, and the controller's cut and moves."""
    controller = engine.kv.controller
    assert controller is not None, "warm_up needs an engine with bit_budget_control 'hold'"
    passes: list[float] = []
    pages = 0
    while pages < WARM_WINDOWS * WINDOW_PAGES:
        bits = []
        moves = controller.moves
        for q in seqs:
            seq = admit(engine, q.ids, q.tags)
            bits.append(stored_bits(engine, seq.page_ids, len(q.ids)))
            pages += len(seq.page_ids)
            engine.kv.free(seq)
        passes.append(sum(bits) / len(bits))
        if abs(passes[-1] - budget) <= WARM_TOLERANCE and controller.moves == moves:
            break
    return {
        "passes": passes if len(passes) <= 8 else passes[:4] + passes[-4:],  # a long warm-up: its first and last passes
        "pass_count": len(passes),
        "pages": pages,
        "conversations": len(seqs),
        "reached": abs(passes[-1] - budget) <= WARM_TOLERANCE,
        "tolerance": WARM_TOLERANCE,
        "cut": controller.cut,
        "moves": controller.moves,
    }


def stored_bits(engine: LLMEngine, page_ids: list[int], num_tokens: int) -> float:
    """Nominal bits per value the sequence is stored at (16/8/4 for one-precision formats)."""
    nominal = {"bf16": 16.0, "fp8_e4m3": 8.0, "nvfp4": 4.0}.get(engine.storage.kv_dtype)
    if nominal is not None:
        return nominal
    from kvserving.kernels.page_ids import page_id_bits

    p = engine.storage.page_size
    total = sum(page_id_bits(pid) * min(p, num_tokens - i * p) for i, pid in enumerate(page_ids))
    return total / num_tokens


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------- the run
def build_engine(
    model_dir: Path,
    dtype: str,
    *,
    device: torch.device,
    ctx: int,
    chunk: int,
    table: tuple[int, ...] | None = None,
    scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
    held: float | None = None,
    calibration: Calibration | None = None,
) -> LLMEngine:
    """``held``: triaxial with the bit-budget controller holding that budget, no table: on the ranking of
    ``calibration`` when given (the controller an engine given that calibration file builds), else the
    default ranking."""
    kv = KVCacheConfig(
        dtype=dtype,
        memory_bytes=(256 if device.type == "cpu" else 4096) * 2**20,
        bit_budget=held,
        bit_budget_control="hold" if held is not None else "fixed",
    )
    cfg = ServingConfig(
        model=ModelConfig(path=str(model_dir), max_model_len=ctx + 64),
        kv_cache=kv,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max(chunk, 8), chunk_size=chunk),
    )
    engine = LLMEngine(cfg, device=device, bits_table=table)
    if scales is not None:  # before any page is written: pages keep the scale they were written with
        engine.storage.k_scales, engine.storage.v_scales = list(scales[0]), list(scales[1])
    if held is not None and calibration is not None:  # before any page is written, as build_kv_cache does
        # (a calibration counted at another context is no file: its pages are not its tokens')
        engine.kv.controller = budget_controller(held, calibration, page_size=engine.storage.page_size)
    return engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default bench/results/fidelity_{device}.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-steps", type=int, default=None, help="override the config's training steps")
    ap.add_argument(
        "--generate",
        type=int,
        default=None,
        help="override the config's greedy tokens per conversation (the greedy-agreement column; "
        "0: no generation, the KL rows in less time)",
    )
    ap.add_argument(
        "--eval-seqs",
        type=int,
        nargs="+",
        default=None,
        help="override the config's evaluation conversations per context (one number, or one per context)",
    )
    ap.add_argument("--calib-tokens", type=int, default=None, help="override the config's calibration tokens")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument(
        "--triaxial-only",
        action="store_true",
        help="score bf16 (the reference) and the triaxial rows only: more conversations in the same time",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the harness runs (numbers mean nothing)")
    ap.add_argument("--size", choices=("default", "large"), default="default", help="large: the ~13M-parameter CPU model (CPU only)")
    ap.add_argument("--metric", choices=METRICS, default="kl", help="the calibrated table's D_k (kvserving calibrate --metric)")
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="also calibrate with the other metric (rows 'calibrated (<metric>)'), the attention-MSE 2.7 "
        "table with the system prompt swapped to 4 bits, and whole-table KL / attention MSE on the "
        "calibration prompts against the per-class sums (additivity)",
    )
    ap.add_argument("--skip-default", action="store_true", help="leave out the engine default table's rows")
    ap.add_argument(
        "--select", action="store_true", help="calibrated = the least whole-table KL among three candidates (kvserving calibrate --select)"
    )
    ap.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=None,
        help="evaluate these of the config's contexts only (the model and the calibration are the same)",
    )
    ap.add_argument(
        "--budgets",
        nargs="+",
        default=None,
        metavar="B[,B...]",
        help=f"score the triaxial rows at these of {','.join(f'{b:g}' for b in BUDGETS)} only: one "
        "comma-separated list for every context, or one per context (the calibration still "
        "writes every budget's table)",
    )
    ap.add_argument(
        "--count-on-evaluation",
        action="store_true",
        help="count every table's budget (default@pages' too) on the pages of the evaluation conversations "
        "(their tags only: what the gateway knows of served traffic), so every table stores its budget "
        "on the scored text and the paired KL compares equal stored bits; the D_k are measured on the "
        "calibration text as always, and --select still scores on it",
    )
    ap.add_argument(
        "--calibrate-at-context",
        action="store_true",
        help="also calibrate on the calibration text wrapped at each longer evaluation context (D_k "
        "measured on prompts of that length, the budget on the same pages): rows 'calibrated@<ctx>'",
    )
    ap.add_argument(
        "--calibration",
        type=Path,
        default=None,
        metavar="FILE",
        help="read the calibration from FILE (a kvserving calibrate file; a section's calibration.file) instead of "
        "measuring it: only for the model FILE was measured on (the same seed and config; training is deterministic "
        "on one machine), to score more rows without the calibration's time",
    )
    ap.add_argument(
        "--section",
        default="main",
        help="the name this run's results take in --out, beside the sections already there (one file per machine)",
    )
    ap.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="FILE",
        help="run nothing: join the sections of these result files (a device machine's run, the committed file) into --out",
    )
    add_quiet_argument(ap)
    opts = ap.parse_args(argv)
    device = torch.device(opts.device)
    out_path = opts.out or Path(__file__).parent / "results" / f"fidelity_{device.type}.json"
    if opts.combine is not None:
        missing = [f for f in opts.combine if not Path(f).is_file()]
        if missing:
            print(f"fidelity: error: --combine: no file {missing[0]}", file=sys.stderr)
            return 2
        doc = combine([Path(f) for f in opts.combine], out_path, what=WHAT, name_of=section_of)
        print(f"wrote {out_path}: sections {', '.join(doc['sections'])}")
        return 0
    if opts.calibration is not None:
        if not opts.calibration.is_file():
            print(f"fidelity: error: --calibration: no file {opts.calibration}", file=sys.stderr)
            return 2
        if opts.select or opts.diagnose:
            print("fidelity: error: --calibration reads a calibration; --select and --diagnose measure one", file=sys.stderr)
            return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("fidelity: error: --device cuda but torch sees no GPU", file=sys.stderr)
        return 1
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.size == "large" and device.type == "cuda":
        print("fidelity: error: --size large is a CPU config; the GPU config is already larger", file=sys.stderr)
        return 2
    s = SMOKE if opts.smoke else GPU if device.type == "cuda" else CPU_LARGE if opts.size == "large" else CPU
    contexts: tuple[int, ...] = tuple(opts.contexts or s.contexts)
    if not set(contexts) <= set(s.contexts) or len(set(contexts)) != len(contexts):
        print(f"fidelity: error: --contexts takes distinct contexts of the config's {list(s.contexts)}", file=sys.stderr)
        return 2
    eval_seqs: list[int] = opts.eval_seqs or []
    if len(eval_seqs) > 1 and len(eval_seqs) != len(contexts):
        print(f"fidelity: error: --eval-seqs takes one number or one per context ({len(contexts)})", file=sys.stderr)
        return 2
    if any(n < 1 for n in eval_seqs):
        print("fidelity: error: --eval-seqs must be >= 1", file=sys.stderr)
        return 2
    opts.eval_seqs = eval_seqs[0] if eval_seqs else None
    budgets = context_budgets(opts.budgets, contexts)
    if isinstance(budgets, str):
        print(f"fidelity: error: {budgets}", file=sys.stderr)
        return 2
    per_context = dict(zip(contexts, eval_seqs)) if len(eval_seqs) > 1 else {}
    for field in ("train_steps", "eval_seqs", "calib_tokens", "generate"):
        value = getattr(opts, field)
        if value is not None:
            least = 0 if field == "generate" else 1
            if value < least:
                print(f"fidelity: error: --{field.replace('_', '-')} must be >= {least}, got {value}", file=sys.stderr)
                return 2
            s = Setup(**{**s.__dict__, field: value})
    t0 = time.time()

    tok_dir = tiny_model_dir()
    tokenizer = TextTokenizer.from_dir(tok_dir)
    tagger = ChatTagger(tokenizer, ChatTemplate.from_dir(tok_dir))
    train_files, held_files = stdlib_files(deep=device.type == "cuda")
    # held-out files: odd ones calibrate, even ones evaluate (neither is trained on)
    calib_files, eval_files = held_files[1::2], held_files[0::2]
    eval_text = joined_text(eval_files, 10**9)
    ids = torch.tensor(
        conversation_ids(joined_text(train_files, s.train_chars), tagger, context=max(s.contexts), seed=opts.seed), dtype=torch.long
    )
    val = torch.tensor(conversation_ids(eval_text[: s.val_chars], tagger, context=max(s.contexts), seed=opts.seed + 1), dtype=torch.long)
    eos = tokenizer.token_to_id("<|im_end|>") or 0
    cfg = model_config(s, tokenizer.vocab_size, eos, max(max(s.contexts) + 256, 4096))
    print(
        f"fidelity: {len(train_files)} training files ({len(ids)} tokens as conversations), {len(calib_files)} "
        f"calibration / {len(eval_files)} evaluation files held out; model {s.layers} layers x {s.hidden}, "
        f"{s.heads}/{s.kv_heads} heads x {HEAD_DIM}",
        file=sys.stderr,
        flush=True,
    )
    model, losses, val_losses = train(s, cfg, ids, val, device=device, seed=opts.seed, quiet=opts.quiet)
    params = sum(p.numel() for p in model.parameters())
    t_train = time.time() - t0

    work = Path(tempfile.mkdtemp(prefix="kvs-fidelity-"))
    try:
        model_dir = work / "model"
        save_model(model, cfg, model_dir, tok_dir)
        del model
        # Calibration on held-out files the evaluation does not use, at the first evaluation context.
        t1 = time.time()
        calib_path, eval_path = work / "calibration_text.py", work / "evaluation_text.py"
        calib_path.write_text(joined_text(calib_files, 10**9))
        eval_path.write_text(eval_text)
        selection: dict[str, dict[str, float | str]] = {}
        attn: dict[str, dict[int, list[float]]] = {"calibrated": {}}  # --select: each calibration's attention-MSE D_k
        # the fp8/nvfp4 scale search only where those formats are scored (--triaxial-only: ~25 % of the time);
        # --select at the calibration length only where that context is scored: every other context selects
        # again on its own pages (reselect), so a selection here would be discarded (and cost 3 whole-table
        # KL passes per budget)
        cal = (
            Calibration.load(opts.calibration)
            if opts.calibration is not None
            else calibrate(
                model_dir,
                [calib_path],
                BUDGETS,
                seq_len=s.calib_len,
                max_tokens=s.calib_tokens,
                search=not opts.triaxial_only,
                frequency_source="data",
                device=opts.device,
                wrap="agent",
                metric=opts.metric,
                chunk=s.chunk,
                select=opts.select and s.calib_len in contexts and not opts.count_on_evaluation,
                selection=selection,
                attn_out=attn["calibrated"] if opts.select else None,
            )
        )
        (work / "calibration.json").write_text(cal.to_json())
        t_cal = time.time() - t1
        cals = {"calibrated": cal}
        other = METRICS[1 - METRICS.index(opts.metric)]
        if opts.diagnose:  # the same prompts, the other D_k (no scale search: the scales come from ``cal``)
            cals[f"calibrated ({other})"] = calibrate(
                model_dir,
                [calib_path],
                BUDGETS,
                seq_len=s.calib_len,
                max_tokens=s.calib_tokens,
                device=opts.device,
                wrap="agent",
                metric=other,
                show_progress=False,
                chunk=s.chunk,
            )
        t_other = time.time() - t1 - t_cal
        swap = ("calibrated" if opts.metric == "attn" else f"calibrated ({other})") if opts.diagnose else None
        tables = {}
        for b in BUDGETS:
            t = table_set(cals, b, swap=swap)
            tables[f"{b:g}"] = {
                name: {"table": format_bits_table(tb), "stored_bits_calibration_data": cal.stored_bits(tb)} for name, tb in t.items()
            }
        results: dict[str, Any] = {
            "section": opts.section,
            "device": opts.device,
            "seed": opts.seed,
            "params": params,
            "config": {k: v for k, v in s.__dict__.items()},
            "head_dim": HEAD_DIM,
            "train": {
                "files": len(train_files),
                "tokens": len(ids),
                "loss_first": losses[0],
                "loss_last": sum(losses[-10:]) / min(10, len(losses)),
                "held_out_loss": val_losses,
                "held_out_ppl": math.exp(val_losses[-1][1]),
                "seconds": round(t_train, 1),
            },
            "calibration": {
                "tokens": cal.tokens,
                "seconds": round(t_cal, 1),
                # --calibration: the file read instead of measuring (its model: this seed's, trained the same way)
                **({"loaded_from": str(opts.calibration)} if opts.calibration is not None else {}),
                "metric": opts.metric,
                "tables": tables,
                # per budget: each candidate table's whole-table KL on the calibration prompts, the one kept
                "selection": selection,
                # per class seen: token share, measured per-token gain (D_k(2) - D_k(4)) / N_k, default s_k
                "classes": {
                    "/".join(decode_tag(k)): {"share": cal.frequency[k], "gain": cal.priorities()[k], "default": default_sensitivity()[k]}
                    for k in range(len(cal.frequency))
                    if cal.frequency[k] > 0
                },
                "scales": {d: {"k": sc.k, "v": sc.v, "method": sc.method} for d, sc in cal.scales.items()},
                # the whole calibration file (its pages and distortions): tables can be re-derived offline
                "file": cal.to_dict(),
                # --diagnose: the other metric's calibration of the same prompts
                "others": {
                    name: {
                        "seconds": round(t_other, 1),
                        "file": c.to_dict(),
                        "gain": {"/".join(decode_tag(k)): c.priorities()[k] for k in range(NUM_TAGS) if c.frequency[k] > 0},
                    }
                    for name, c in cals.items()
                    if c is not cal
                },
            },
            "calibration_files": [str(p.relative_to(p.parents[len(p.parents) - 1])) for p in calib_files][:3] + ["..."],
            "evaluation_files": len(eval_files),
            "contexts": {},
        }
        extra_path = work / "extra_held_out_text.py"
        ctx_selection: dict[int, dict[str, dict[str, dict[str, float | str]]]] = {}
        for ctx in contexts:
            # Tables for a context other than the calibration prompts' are counted on the calibration text's
            # pages at that context (kvserving calibrate --page-seq-len: the budget holds on the lengths served).
            ccals = dict(cals)
            t_ctx = time.time()
            at_ctx: Calibration | None = None  # --calibrate-at-context: D_k measured on prompts of this length
            n_eval = per_context.get(ctx, s.eval_seqs)
            seqs, sources = evaluation_conversations(eval_path, extra_path, tagger, ctx=ctx, n=n_eval)
            if ctx != s.calib_len or opts.count_on_evaluation:
                # the calibration text's pages at this context: what the budget is counted on, and what --select
                # scores on (with --count-on-evaluation and no --select nothing reads them)
                page_seqs = (
                    load_data([calib_path], tagger, seq_len=ctx, max_tokens=2 * s.calib_tokens, wrap="agent")
                    if opts.select or not opts.count_on_evaluation
                    else []
                )
                if opts.calibrate_at_context and ctx != s.calib_len:  # the calibration text wrapped at this context
                    attn[f"calibrated@{ctx}"] = {}  # --select: measured here, the selection is made after with_pages
                    at_ctx = calibrate(
                        model_dir,
                        [calib_path],
                        BUDGETS,
                        seq_len=ctx,
                        max_tokens=s.calib_tokens,
                        device=opts.device,
                        wrap="agent",
                        metric=opts.metric,
                        show_progress=False,
                        chunk=s.chunk,
                        attn_out=attn[f"calibrated@{ctx}"] if opts.select else None,
                    )
                    ccals[f"calibrated@{ctx}"] = at_ctx
                # --count-on-evaluation: the held-out text's page mix is not the calibration text's (its
                # conversations run longer and hold fewer older tool calls: docs/performance-log/fidelity.md, "Why the
                # calibrated tables under-spend"), so tables at the budget there store other bits on it
                counted = seqs if opts.count_on_evaluation else page_seqs
                ccals = {name: with_pages(c, counted) for name, c in ccals.items()}
                if opts.select:  # with_pages dropped the selected tables: select again on this context's pages
                    ccals, ctx_selection[ctx] = reselect(
                        ccals, attn, model_dir, page_seqs, budgets=budgets[ctx], max_tokens=s.calib_tokens, device=device, chunk=s.chunk
                    )
            t_ctx_cal = time.time() - t_ctx
            specs = variants(ccals, swap=swap, skip_default=opts.skip_default, triaxial_only=opts.triaxial_only, budgets=budgets[ctx])

            def partial(rows: dict[str, Any], ctx: int = ctx, sources: dict[str, Any] = sources) -> None:
                # each row as it completes: a run stopped by its time limit keeps the rows it finished (and the
                # selection made at this context, written before the first row)
                results["contexts"][str(ctx)] = {
                    "partial": True,
                    "conversations": sources,
                    "rows": rows,
                    **({"selection": ctx_selection[ctx]} if ctx in ctx_selection else {}),
                }
                write_section(out_path, opts.section, results, what=WHAT, name_of=section_of)

            partial({})
            block = run_context(model_dir, specs, ccals["calibrated"], seqs, s, ctx, device, on_row=partial, quiet=opts.quiet)
            block["conversations"] = sources
            block["calibration_pages"] = {
                "context": ctx,
                "counted_on": "evaluation" if opts.count_on_evaluation else "calibration",
                **page_mix_summary(ccals["calibrated"]),
            }
            # the scored conversations' page mix, whatever the budget was counted on: tables re-count offline
            block["evaluation_pages"] = page_mix_summary(with_pages(ccals["calibrated"], seqs))
            if ctx in ctx_selection:  # --select at this context: per calibration, per budget, each candidate's KL
                block["selection"] = ctx_selection[ctx]
            if at_ctx is not None:  # the file as measured (its own pages); the tables used are counted on the above
                block["calibration_at_context"] = {
                    "tokens": at_ctx.tokens,
                    "seconds": round(t_ctx_cal, 1),
                    "file": at_ctx.to_dict(),
                    "gain": {"/".join(decode_tag(k)): at_ctx.priorities()[k] for k in range(NUM_TAGS) if at_ctx.frequency[k] > 0},
                }
            if opts.diagnose and ctx == s.calib_len:
                calib_seqs = load_data([calib_path], tagger, seq_len=s.calib_len, max_tokens=min(s.calib_tokens, 32768), wrap="agent")
                block["diagnosis"] = diagnose(
                    model_dir, cals, {n: sp[1]["table"] for n, sp in specs.items() if "table" in sp[1]}, calib_seqs, device, s.chunk
                )
            block["budgets"] = list(budgets[ctx])
            block["comparisons"] = comparisons(block["rows"], budgets=budgets[ctx])
            results["contexts"][str(ctx)] = block
            write_section(out_path, opts.section, results, what=WHAT, name_of=section_of)  # each context as it completes
        results["seconds"] = round(time.time() - t0, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_section(out_path, opts.section, results, what=WHAT, name_of=section_of)
    print_table(results)
    print(f"wrote section {opts.section!r} of {out_path}")
    return 0


WHAT = "bench/fidelity.py: what each KV format costs in model quality on a model trained here; one section per configuration"


def section_of(run: dict[str, Any]) -> str:
    """A run's section: the ``--section`` it was run with (``main`` for a run that names none)."""
    return str(run.get("section", "main"))


def context_budgets(specs: list[str] | None, contexts: tuple[int, ...]) -> dict[int, tuple[float, ...]] | str:
    """``--budgets``: context -> the budgets whose triaxial rows it scores (every one of BUDGETS without the
    option), or the error. ``specs``: one comma-separated list for every context, or one per context."""
    if not specs:
        return dict.fromkeys(contexts, BUDGETS)
    if len(specs) not in (1, len(contexts)):
        return f"--budgets takes one list or one per context ({len(contexts)})"
    out = {}
    for ctx, spec in zip(contexts, specs * len(contexts) if len(specs) == 1 else specs):
        try:
            chosen = {float(b) for b in spec.split(",")}
        except ValueError:
            return f"--budgets: {spec!r} is not a comma-separated list of budgets"
        if not chosen <= set(BUDGETS):
            return f"--budgets: {spec!r} names a budget other than {', '.join(f'{b:g}' for b in BUDGETS)}"
        out[ctx] = tuple(b for b in BUDGETS if b in chosen)
    return out


def table_set(
    cals: dict[str, Calibration], budget: float, *, swap: str | None = None, skip_default: bool = False
) -> dict[str, tuple[int, ...]]:
    """The triaxial tables compared at ``budget`` (module docstring): the engine default, the
    default priorities on the calibration pages, each calibration's table; with ``swap`` (the
    attention-MSE calibration's name), at 2.7 that table with the system prompt at 4 bits."""
    cal = cals["calibrated"]
    out = {} if skip_default else {"default": bits_table_for_budget(budget)}
    out["default@pages"] = cal.derive_table(budget, per_token=default_sensitivity())
    for name, c in cals.items():
        out[name] = c.table_for_budget(budget)[0]
    if swap is not None and abs(budget - 2.7) < 1e-9:
        out[f"{swap} +system prompt"] = system_prompt_swap(cals[swap], out[swap], budget)
    return out


SYSTEM_PROMPT_CLASSES = tuple(c for c in range(NUM_TAGS) if decode_tag(c)[2] == "inst")


def system_prompt_swap(cal: Calibration, table: tuple[int, ...], budget: float) -> tuple[int, ...]:
    """``table`` with the system prompt and tool schemas (inst classes) at 4 bits, then the bought
    classes of the least measured per-token gain back at 2 bits until the stored bits on the
    calibration pages are within ``budget``, then the most-gain 2-bit classes that still fit at 4."""
    t = list(table)
    for c in SYSTEM_PROMPT_CLASSES:
        t[c] = 4
    gain = cal.priorities()
    seen = [c for c in range(NUM_TAGS) if cal.frequency[c] > 0 and c not in SYSTEM_PROMPT_CLASSES]
    for c in sorted((c for c in seen if t[c] == 4), key=lambda c: gain[c]):
        if cal.stored_bits(t) <= budget + 1e-9:
            break
        t[c] = 2
    for c in sorted((c for c in seen if t[c] == 2), key=lambda c: -gain[c]):
        t[c] = 4
        if cal.stored_bits(t) > budget + 1e-9:
            t[c] = 2
    return tuple(t)


def page_mix_summary(cal: Calibration, top: int = 8) -> dict[str, Any]:
    """What the budget is counted on: full pages, residual tokens, and the classes that fill whole
    pages alone (share of the full pages): a table can store a page INT2 only if every token on it is
    2-bit, so only such classes (and page mixes all at 2 bits) free whole pages."""
    full = sum(n for n, _ in cal.pages)
    pure: Counter[int] = Counter()
    for n, mix in cal.pages:
        if len(mix) == 1:
            pure[mix[0][0]] += n
    return {
        "tokens": cal.residual + cal.page_size * full,
        "full_pages": full,
        "residual_tokens": cal.residual,
        "single_class_pages": {"/".join(decode_tag(c)): n / full for c, n in pure.most_common(top)} if full else {},
        "mixed_pages": (full - sum(pure.values())) / full if full else 0.0,
        # every page mix (n pages, [[tag, tokens], ...]): the tables can be re-counted offline
        "counts": [[n, [list(ct) for ct in mix]] for n, mix in cal.pages],
    }


def evaluation_conversations(
    eval_path: Path, extra_path: Path, tagger: ChatTagger, *, ctx: int, n: int
) -> tuple[list[TaggedSeq], dict[str, Any]]:
    """The first ``n`` held-out conversations of at least ``ctx / 2`` tokens at context ``ctx``: from the
    evaluation files, then, only if they give fewer, from the standard library's sources that neither
    training nor calibration reads (``extra_held_out_files``; written to ``extra_path``). Returns the
    conversations and where they came from."""

    def long_enough(path: Path, max_tokens: int) -> list[TaggedSeq]:
        return [q for q in load_data([path], tagger, seq_len=ctx, max_tokens=max_tokens, wrap="agent") if len(q.ids) >= ctx // 2]

    seqs = long_enough(eval_path, 10**9)  # all of them: how many there are is part of the record
    info: dict[str, Any] = {"available_in_evaluation_files": len(seqs), "from_evaluation_files": min(n, len(seqs)), "from_extra_files": 0}
    if len(seqs) < n:
        files = extra_held_out_files()
        if files:
            if not extra_path.exists():  # the test suites can be tens of MB: a few MB give hundreds of conversations
                extra_path.write_text(joined_text(files, EXTRA_CHARS))
            extra = long_enough(extra_path, 4 * ctx * (n - len(seqs)))
            info.update(extra_files=len(files), extra_chars=len(extra_path.read_text()))
            seqs += extra
        info["from_extra_files"] = min(n, len(seqs)) - info["from_evaluation_files"]
    if len(seqs) < n:
        print(
            f"fidelity: warning: {len(seqs)} held-out conversations of >= {ctx // 2} tokens at {ctx}, {n} asked",
            file=sys.stderr,
            flush=True,
        )
    if not seqs:
        raise RuntimeError(f"no held-out sequence of >= {ctx // 2} tokens")
    return seqs[:n], info


def reselect(
    cals: dict[str, Calibration],
    attn: dict[str, dict[int, list[float]]],
    model_dir: Path,
    seqs: list[TaggedSeq],
    *,
    budgets: tuple[float, ...],
    max_tokens: int,
    device: torch.device,
    chunk: int,
) -> tuple[dict[str, Calibration], dict[str, dict[str, dict[str, float | str]]]]:
    """``--select`` at a context other than the calibration prompts': each calibration with attention-MSE
    D_k (``attn``) gets, per budget in ``budgets``, the candidate table (KL rule, attention-MSE rule, default
    sensitivities, all counted on that context's pages) with the least whole-table KL on the first
    ``max_tokens`` tokens of ``seqs`` (the calibration text at that context). ``with_pages`` alone would
    derive every table by the KL rule: the selection made at the calibration length does not carry over."""
    take, total = [], 0
    for q in seqs:
        if total >= max_tokens:
            break
        take.append(q)
        total += len(q.ids)
    _, model = load_model(model_dir, dtype=torch.float32, device=device)
    out, record = dict(cals), {}
    for name, c in cals.items():
        if not attn.get(name):
            continue
        rec: dict[str, dict[str, float | str]] = {}
        derived = replace(c, tables={budget_key(b): c.derive_table(b) for b in budgets})
        out[name] = select_tables(derived, attn[name], model, take, device=device, chunk=chunk, record=rec)
        record[name] = rec
    return out, record


def with_pages(cal: Calibration, seqs: list[TaggedSeq]) -> Calibration:
    """``cal`` with its budget counted on the pages of ``seqs`` (its stored tables dropped: derived anew)."""
    counts: Counter[Any] = Counter()
    residual = sum(count_page_mixes(counts, q.tags, cal.page_size) for q in seqs)
    return replace(cal, pages=page_records(counts), residual=residual, tables={})


def variants(
    cals: dict[str, Calibration],
    *,
    swap: str | None = None,
    skip_default: bool = False,
    triaxial_only: bool = False,
    budgets: tuple[float, ...] = BUDGETS,
) -> dict[str, tuple[str, dict[str, Any]]]:
    """row name -> (kv dtype, build_engine kwargs) for every format of the table (triaxial at ``budgets``)."""
    cal = cals["calibrated"]
    rows: dict[str, tuple[str, dict[str, Any]]] = {"bf16": ("bf16", {})}
    if not triaxial_only:
        for d, short in (("fp8_e4m3", "fp8"), ("nvfp4", "nvfp4")):
            sc = cal.scales[d]
            rows[f"{short} scale 1"] = (d, {})
            rows[f"{short} calibrated ({sc.method})"] = (d, {"scales": (sc.k, sc.v)})
    for b in budgets:
        for name, table in table_set(cals, b, swap=swap, skip_default=skip_default).items():
            rows[f"triaxial {b:g} {name}"] = ("triaxial", {"table": table})
        # the bit-budget controller on the default and on the calibrated ranking: the budget held on the scored text
        rows[f"triaxial {b:g} held"] = ("triaxial", {"held": b})
        rows[f"triaxial {b:g} held calibrated"] = ("triaxial", {"held": b, "ranking": "calibrated"})
    return rows


def diagnose(
    model_dir: Path,
    cals: dict[str, Calibration],
    tables: dict[str, tuple[int, ...]],
    seqs: list[TaggedSeq],
    device: torch.device,
    chunk: int,
) -> dict[str, Any]:
    """Per table, on the calibration prompts (page rule): the summed next-token KL and attention-output MSE
    (max over heads, summed over layers, each layer's inputs exact) measured with the whole table applied,
    and what each calibration's per-class D_k predict for it (sum over tokens of D_c(b) / N_c). The KL is
    prefilled in chunks of ``chunk`` (as the evaluation and the KL metric)."""
    args, model = load_model(model_dir, dtype=torch.float32, device=device)
    out: dict[str, Any] = {"prompts": len(seqs), "tokens": sum(len(q.ids) for q in seqs), "tables": {}}
    acc = {name: {"kl": 0.0, "attn": 0.0, **{f"predicted {c}": 0.0 for c in cals}} for name in tables}
    for q in seqs:
        tags = torch.tensor(q.tags, dtype=torch.long, device=device)
        ref = log_probs(model, q.ids, None, device=device)
        cap = capture_qkv(model, q.ids, device=device)
        for name, table in tables.items():
            bits = table_bits(tags, table)
            a = acc[name]
            a["kl"] += kl_sum(ref, log_probs(model, q.ids, bits, device=device, chunk=chunk))
            a["attn"] += sum(table_attn_distortion(cap.q[i], cap.k[i], cap.v[i], bits) for i in range(args.num_layers))
            for c_name, c in cals.items():
                counts = [f * c.tokens for f in c.frequency]
                a[f"predicted {c_name}"] += predicted(c.distortion, counts, tags, bits)
    out["tables"] = acc
    return out


def comparisons(rows: dict[str, Any], *, budgets: tuple[float, ...] = BUDGETS) -> dict[str, dict[str, Any]]:
    """Per budget, each triaxial table against default@pages: the pooled KL change and the paired
    per-conversation difference (mean and standard error as % of default@pages' mean KL; t)."""
    out: dict[str, dict[str, Any]] = {}
    for b in budgets:
        base = rows.get(f"triaxial {b:g} default@pages")
        if base is None:
            continue
        block: dict[str, dict[str, Any]] = {}
        for name, r in rows.items():
            if not name.startswith(f"triaxial {b:g} ") or r is base or name.endswith(" default"):
                continue
            if r.get("table") is not None and r["table"] == base.get("table"):  # nothing to compare
                block[name.removeprefix(f"triaxial {b:g} ")] = {
                    "same_table": True,
                    "paired_mean_pct": 0.0,
                    "paired_se_pct": None,
                    "t": None,
                }
                continue
            x, y = r["kl_per_sequence"], base["kl_per_sequence"]
            d = [a - c for a, c in zip(x, y)]
            n, mean_base = len(d), sum(y) / len(y)
            mean = sum(d) / n
            sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1)) if n > 1 else 0.0
            se = sd / math.sqrt(n)
            block[name.removeprefix(f"triaxial {b:g} ")] = {
                "kl_change_pct": 100.0 * (r["kl_vs_bf16"] / base["kl_vs_bf16"] - 1.0) if base["kl_vs_bf16"] else None,
                "paired_mean_pct": 100.0 * mean / mean_base if mean_base else None,
                "paired_se_pct": 100.0 * se / mean_base if mean_base else None,
                "t": mean / se if se > 0 else None,
                "lower_higher_equal": [sum(v < 0 for v in d), sum(v > 0 for v in d), sum(v == 0 for v in d)],
                "stored_bits_minus_default_pages": r["stored_bits"] - base["stored_bits"],
            }
        out[f"{b:g}"] = block
    return out


def run_context(
    model_dir: Path,
    specs: dict[str, tuple[str, dict[str, Any]]],
    cal: Calibration,
    seqs: list[Any],
    s: Setup,
    ctx: int,
    device: torch.device,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Scores every row of ``specs`` on ``seqs``; ``on_row(rows so far)`` after each. A held row on the
    calibrated ranking walks ``cal``'s."""
    rows: dict[str, Any] = {}
    reference_out: list[list[int]] | None = None
    ref: list[list[torch.Tensor]] = [[] for _ in seqs]  # the bf16 run's log-probabilities per sequence and chunk
    scored: dict[str, str] = {}  # the same format and table score the same: row key -> the row that scored it
    for name, (dtype, kw) in progress(specs.items(), desc=f"ctx {ctx} rows", total=len(specs), quiet=quiet):
        key = json.dumps([dtype, kw.get("table"), kw.get("scales"), kw.get("held"), kw.get("ranking")])
        if key in scored:
            rows[name] = {**rows[scored[key]], "same_table_as": scored[key], "seconds": 0.0}
            print(f"  ctx {ctx} {name}: the same table as {scored[key]}", file=sys.stderr, flush=True)
            if on_row is not None:
                on_row(rows)
            continue
        scored[key] = name
        t = time.time()
        engine_kw = {k: v for k, v in kw.items() if k != "ranking"}
        if kw.get("ranking") == "calibrated":
            engine_kw["calibration"] = cal
        engine = build_engine(model_dir, dtype, device=device, ctx=ctx, chunk=s.chunk, **engine_kw)
        warm = warm_up(engine, seqs, kw["held"]) if kw.get("held") is not None else None
        rec = LayerError(engine.attention, engine.args.num_layers)
        acc = Score()
        bits, kl_seq = [], []
        for q, r in zip(seqs, ref):
            kl0, n0 = acc.kl, acc.count
            bits.append(score(engine, q.ids, q.tags, s.chunk, rec, acc, r))
            kl_seq.append((acc.kl - kl0) / max(1, acc.count - n0))
        gen_n = s.generate
        div: list[int] = []  # --generate 0: no greedy-agreement column
        if gen_n:
            prompts = [q.ids[:-gen_n] for q in seqs]
            tags = [q.tags[:-gen_n] for q in seqs]
            outs = engine.generate(prompts, SamplingParams(max_tokens=gen_n, temperature=0.0, ignore_eos=True), tags=tags)
            if reference_out is None:
                reference_out = outs
            div = [first_divergence(o, r) for o, r in zip(outs, reference_out)]
        table = kw.get("table")
        rows[name] = {
            "dtype": dtype,
            "ppl": math.exp(acc.nll / acc.count),
            "nll_per_token": acc.nll / acc.count,
            "tokens": acc.count,
            "reply_ppl": math.exp(acc.reply_nll / acc.reply_count) if acc.reply_count else None,
            "reply_tokens": acc.reply_count,
            "kl_vs_bf16": acc.kl / acc.count,
            "kl_per_sequence": kl_seq,  # paired across rows: how many conversations a KL difference holds on
            "top1_vs_bf16": acc.top1 / acc.count,
            "stored_bits": sum(bits) / len(bits),
            "stored_bits_per_sequence": bits,  # paired with kl_per_sequence: how much of a KL difference is bits
            "stored_bits_calibration_data": cal.stored_bits(table) if table is not None else None,
            "table": format_bits_table(table) if table is not None else None,
            "first_divergence": div,
            "mean_first_divergence": sum(div) / len(div) if div else None,
            "generated": gen_n,
            "attn_rel_err": [math.sqrt(e / r) if r > 0 else 0.0 for e, r in zip(rec.err, rec.ref)],
            # a held row: the warm-up on the scored conversations before it was scored (warm_up)
            **({"warm_up": warm} if warm is not None else {}),
            "seconds": round(time.time() - t, 1),
        }
        print(
            f"  ctx {ctx} {name}: bits {rows[name]['stored_bits']:.2f}, ppl {rows[name]['ppl']:.4f}, "
            f"KL {rows[name]['kl_vs_bf16']:.2e}, first divergence {div}, {rows[name]['seconds']} s{warm_note(warm)}",
            file=sys.stderr,
            flush=True,
        )
        del engine
        if on_row is not None:
            on_row(rows)
    base, rbase = rows["bf16"]["ppl"], rows["bf16"]["reply_ppl"]
    for r in rows.values():
        r["ppl_vs_bf16_pct"] = 100.0 * (r["ppl"] / base - 1.0)
        r["reply_ppl_vs_bf16_pct"] = 100.0 * (r["reply_ppl"] / rbase - 1.0) if rbase else None
    return {"sequences": len(seqs), "tokens_per_sequence": [len(q.ids) for q in seqs], "rows": rows}


def warm_note(warm: dict[str, Any] | None) -> str:
    """A held row's warm-up, for its progress line ("" for a table's row)."""
    if warm is None:
        return ""
    within = "" if warm["reached"] else f" (not within +-{warm['tolerance']:g} of the budget)"
    return f", warmed in {warm['pass_count']} passes to {warm['passes'][-1]:.3f} bits{within}"


def agree(row: dict[str, Any]) -> str:
    """The greedy-agreement column: mean first divergence / tokens generated ("-" with ``--generate 0``)."""
    mean = row["mean_first_divergence"]
    return "-" if mean is None else f"{mean:.0f}/{row['generated']}"


def print_table(results: dict[str, Any]) -> None:
    tr = results["train"]
    print(
        f"\nmodel {results['params'] / 1e6:.1f}M parameters, {results['device']}; training loss {tr['loss_last']:.3f}, "
        f"held-out perplexity {tr['held_out_ppl']:.2f}"
    )
    for ctx, block in results["contexts"].items():
        print(f"\ncontext {ctx} ({block['sequences']} held-out agent conversations, {sum(block['tokens_per_sequence'])} tokens)")
        print(
            f"{'format':<30} {'bits':>5} {'ppl':>8} {'vs bf16':>8} {'replies':>8} {'KL':>8} {'top1':>6} {'agree':>7}"
            f"  attn rel err per layer"
        )
        for name, r in block["rows"].items():
            errs = " ".join(f"{e:.3f}" for e in r["attn_rel_err"])
            print(
                f"{name:<30} {r['stored_bits']:>5.2f} {r['ppl']:>8.3f} {r['ppl_vs_bf16_pct']:>+7.2f}% "
                f"{r['reply_ppl_vs_bf16_pct']:>+7.2f}% {r['kl_vs_bf16']:>8.2e} {100 * r['top1_vs_bf16']:>5.1f}% "
                f"{agree(r):>7} {errs}"
            )
        if block.get("comparisons"):
            print("KL against default@pages (pooled change; paired mean +- se as % of its KL, t; conversations lower/higher)")
            for b, comp in block["comparisons"].items():
                for name, c in comp.items():
                    if c.get("same_table"):
                        print(f"  {b:>4} {name:<34} the same table as default@pages")
                    if c["paired_se_pct"] is None:
                        continue
                    print(
                        f"  {b:>4} {name:<34} {c['kl_change_pct']:+6.1f}%  {c['paired_mean_pct']:+6.1f} +- "
                        f"{c['paired_se_pct']:4.1f}%  t {c['t'] if c['t'] is not None else 0:+5.1f}  "
                        f"{c['lower_higher_equal'][0]}/{c['lower_higher_equal'][1]}  bits {c['stored_bits_minus_default_pages']:+.3f}"
                    )
        diag = block.get("diagnosis")
        if diag:
            print(f"whole tables on {diag['prompts']} calibration prompts: measured vs per-class sums")
            for name, a in diag["tables"].items():
                preds = "  ".join(f"{k.removeprefix('predicted ')} {v:.4g}" for k, v in a.items() if k.startswith("predicted"))
                print(f"  {name:<40} KL {a['kl']:.4g}  attn {a['attn']:.4g}  predicted: {preds}")


if __name__ == "__main__":
    raise SystemExit(main())
