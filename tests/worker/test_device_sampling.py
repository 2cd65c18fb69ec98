"""The batched sampler (``sample_tokens``) against the one-row reference (``sample_one``): same tokens on CPU
for the same logits and seeds, whatever mix of greedy, temperature, top-k and top-p rows a step holds."""

from __future__ import annotations

import pytest
import torch

from kvserving.worker.sampling import SamplingParams, make_generator, sample_one, sample_tokens

VOCAB = 512

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.3, top_k=5, seed=2),
    SamplingParams(temperature=1.0, top_p=0.9, seed=3),
    SamplingParams(temperature=0.5, top_k=50, top_p=0.8, seed=4),
    SamplingParams(temperature=2.0, top_k=VOCAB, seed=5),  # k = vocab: no cut
    SamplingParams(temperature=1.0, top_k=1, seed=6),
    SamplingParams(temperature=1.0, top_p=0.05, seed=7),
    SamplingParams(),
    SamplingParams(temperature=1.1, top_k=3, top_p=0.5, seed=9),
]


def test_batched_sampler_equals_reference_over_steps() -> None:
    torch.manual_seed(0)
    ref_gens = [make_generator(p.seed) for p in PARAMS]
    new_gens = [make_generator(p.seed) for p in PARAMS]
    for step in range(12):
        logits = torch.randn(len(PARAMS), VOCAB) * (1 + step)
        logits[8] = 0.0  # a greedy row of ties: the first index wins in both
        ref = [sample_one(logits[i], p, g) for i, (p, g) in enumerate(zip(PARAMS, ref_gens))]
        new = sample_tokens(logits, PARAMS, new_gens)
        assert new.dtype == torch.long and new.shape == (len(PARAMS),)
        assert new.tolist() == ref
    assert ref[8] == 0


def test_greedy_rows_are_argmax_and_draw_nothing() -> None:
    logits = torch.randn(3, VOCAB)
    gens = [make_generator(11) for _ in range(3)]
    before = [g.get_state() for g in gens]
    out = sample_tokens(logits, [SamplingParams()] * 3, gens)
    assert out.tolist() == logits.argmax(dim=-1).tolist()
    assert all(torch.equal(a, g.get_state()) for a, g in zip(before, gens))


def test_top_k_one_is_greedy_and_top_p_tiny_keeps_the_first() -> None:
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(temperature=5.0, top_k=1, seed=0), SamplingParams(temperature=5.0, top_p=1e-6, seed=0)]
    out = sample_tokens(logits, params, [make_generator(0), make_generator(0)])
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 rows of logits but 1 params"):
        sample_tokens(torch.zeros(2, 4), [SamplingParams()], [make_generator(0)])


def test_generator_lives_on_the_asked_device() -> None:
    assert make_generator(3).device.type == "cpu"
    assert make_generator(3, device="cpu").initial_seed() == 3
