"""A packed block's loss and gradients equal the per-example ones (fake fast providers honour boundaries);
dropping the boundary kwargs is detected as leakage; the kernelguard_varlen attention is exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kernelguard.resolution.packed_batch import IGNORE_INDEX, MODEL_INPUT_KEYWORDS
from kernelguard.train.step.packing import build_packed_block

LENGTHS = (7, 13, 5, 11)
BLOCK = 40


def _examples(vocab: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX] * (n // 3) + ids[n // 3 :]  # a "prompt" part without loss
        out.append((ids, labels))
    return out


def _loss_sum(model: Any, block: dict[str, Any], keys: tuple[str, ...]) -> torch.Tensor:
    logits = model(**{k: block[k] for k in keys}, use_cache=False).logits
    return F.cross_entropy(
        logits[0, :-1].float(), block["labels"][0, 1:], ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _separate_loss_sum(model: Any, examples: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    total = torch.zeros(())
    for ids, labels in examples:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
        total = total + F.cross_entropy(
            logits[0, :-1].float(), torch.tensor(labels[1:]), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    return total


def _grads(model: Any) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.fixture
def packed_case(
    fake_providers: Any, tiny: Any
) -> tuple[Any, list[tuple[list[int], list[int]]], dict[str, Any]]:
    model = tiny.tiny_model("qwen3_5").train()
    examples = _examples(model.config.vocab_size)
    return model, examples, build_packed_block(examples, BLOCK, pad_token_id=0)


def test_packed_loss_and_grads_equal_separate_examples(packed_case: Any) -> None:
    model, examples, block = packed_case
    packed = _loss_sum(model, block, MODEL_INPUT_KEYWORDS)
    packed.backward()
    g_packed = _grads(model)
    separate = _separate_loss_sum(model, examples)
    separate.backward()
    g_separate = _grads(model)
    assert abs(float(packed.detach()) - float(separate.detach())) / float(separate.detach()) <= 1e-3
    assert g_packed.keys() == g_separate.keys()
    worst = max(_rel(g_packed[n], g_separate[n]) for n in g_packed)
    assert worst <= 1e-3, worst


def _token_losses(model: Any, block: dict[str, Any], keys: tuple[str, ...]) -> torch.Tensor:
    logits = model(**{k: block[k] for k in keys}, use_cache=False).logits
    return F.cross_entropy(
        logits[0, :-1].float(), block["labels"][0, 1:], ignore_index=IGNORE_INDEX, reduction="none"
    )


def test_dropping_boundary_kwargs_is_detected_as_leakage(packed_case: Any) -> None:
    model, _, block = packed_case
    with torch.no_grad():
        exact = _token_losses(model, block, MODEL_INPUT_KEYWORDS)
        leaky = _token_losses(model, block, ("input_ids", "position_ids"))
    first = block["cu_seq_lens_q"].tolist()[1]
    # The first example sees no earlier tokens either way; every later one leaks GDN state and conv inputs.
    assert torch.allclose(exact[: first - 1], leaky[: first - 1], rtol=1e-5, atol=1e-6)
    later = (exact[first:] - leaky[first:]).abs().max()
    assert later > 1e-3, float(later)


def test_registered_varlen_attention_is_exact_in_the_model(
    fake_providers: Any, tiny: Any, cpu_varlen: None
) -> None:
    from kernelguard.runtime.attention import VARLEN_NAME, register_varlen_attention

    assert register_varlen_attention(device_type="cuda") == VARLEN_NAME  # torch 2.13 has varlen_attn
    assert register_varlen_attention(device_type="cpu") == "sdpa"
    model = tiny.tiny_model("qwen3_5", attn_implementation=VARLEN_NAME).train()
    assert model.config._attn_implementation == VARLEN_NAME
    examples = _examples(model.config.vocab_size)
    block = build_packed_block(examples, BLOCK, pad_token_id=0)
    with torch.no_grad():
        packed = _loss_sum(model, block, MODEL_INPUT_KEYWORDS)
        separate = _separate_loss_sum(model, examples)
    assert abs(float(packed) - float(separate)) / float(separate) <= 1e-3


def test_guard_accepts_varlen_for_packed_training(fake_providers: Any, tiny: Any, cpu_varlen: None) -> None:
    from kernelguard.runtime.attention import VARLEN_NAME, register_varlen_attention
    from kernelguard.runtime.model_guard import guard

    register_varlen_attention(device_type="cuda")
    model = tiny.tiny_model("qwen3_5", attn_implementation=VARLEN_NAME)
    with guard(model, mode="training", packed=True) as report:
        assert report.ok
