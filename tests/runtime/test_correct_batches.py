"""The correct-batch corpus: every way a correct packed or padded batch reaches a hybrid model, for each GDN family
and dtype, under ``guard(packed=True)`` with the first-row probe on. None may be refused (a guard that refuses a
correct batch gets switched off), and each is checked against the truth: every example's logits in the batch
equal its logits run alone, to what the dtype's rounding allows.

The fake fla and causal-conv1d honour ``cu_seqlens`` / ``seq_idx`` exactly as the real kernels do (tests/
fake_providers), so "correct" here is the real kernels' contract. The wrong-batch counterparts live beside each
check's own tests (tests/runtime/test_boundaries.py) and in bench/cpu/bad_inputs_sweep.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernelguard.runtime.model_guard import guard
from kernelguard.runtime.registry import REGISTRY

IDS = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]  # three examples, 15 tokens
LONG = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((96, 40, 120))]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# fp32: a correct row equals its examples alone to ~2e-7 here; a leak moves them by > 1e-2 (the control below).
# In bf16 a correct row's own rounding (up to ~3e-2 on these widths, MoE routing included) is within 10x of a
# leak, so bf16 is held to the refusal only: no correct bf16 batch refused.
FP32_TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("disarmed_after")


def _cu(examples: list[list[int]]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor([len(e) for e in examples]).cumsum(0).tolist()], dtype=torch.int32)


def _positions(examples: list[list[int]]) -> torch.Tensor:
    return torch.cat([torch.arange(len(e)) for e in examples])[None]


def _seq_idx(examples: list[list[int]]) -> torch.Tensor:
    return torch.cat([torch.full((len(e),), i, dtype=torch.int32) for i, e in enumerate(examples)])[None]


def _flattening(examples: list[list[int]]) -> tuple[dict[str, Any], list[slice]]:
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": e} for e in examples])
    return {k: v for k, v in batch.items() if k != "labels"}, _spans(examples)


def _trl_padding_free(examples: list[list[int]]) -> tuple[dict[str, Any], list[slice]]:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=16)(
        [{"input_ids": e} for e in examples])
    return {k: v for k, v in batch.items() if k != "labels"}, _spans(examples)


def _static_cu_seq_lens(examples: list[list[int]]) -> tuple[dict[str, Any], list[slice]]:
    """cu_seq_lens padded to a static length with trailing repeats (compiled trainers keep shapes fixed)."""
    cu = torch.cat([_cu(examples), _cu(examples)[-1:].repeat(3)])
    longest = max(len(e) for e in examples)
    return {"input_ids": torch.tensor([list(itertools.chain.from_iterable(examples))]), "position_ids": _positions(examples),
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest,
            "seq_idx": _seq_idx(examples)}, _spans(examples)


def _block_mask_4d(examples: list[list[int]]) -> tuple[dict[str, Any], list[slice]]:
    """sdpa given the row's own causal block-diagonal 4-D mask, with the GDN signals beside it."""
    batch, spans = _static_cu_seq_lens(examples)
    segment = _seq_idx(examples)[0]
    index = torch.arange(segment.numel())
    allowed = (segment[:, None] == segment[None, :]) & (index[None, :] <= index[:, None])
    cu = _cu(examples)
    return {**batch, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "attention_mask": allowed[None, None]}, spans


def _one_example(examples: list[list[int]]) -> tuple[dict[str, Any], list[slice]]:
    return {"input_ids": torch.tensor([examples[2]])}, [slice(0, len(examples[2]))]


def _padded(examples: list[list[int]]) -> tuple[dict[str, Any], list[slice]]:
    """No packing: one example per row, right-padded, with its 2-D mask."""
    width = max(len(e) for e in examples)
    ids = torch.tensor([e + [0] * (width - len(e)) for e in examples])
    mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in examples])
    return {"input_ids": ids, "attention_mask": mask}, [slice(0, len(e)) for e in examples]


def _spans(examples: list[list[int]]) -> list[slice]:
    cu = _cu(examples).tolist()
    return [slice(a, b) for a, b in itertools.pairwise(cu)]


LAYOUTS: dict[str, Callable[[list[list[int]]], tuple[dict[str, Any], list[slice]]]] = {
    "flattening": _flattening,
    "trl-padding-free": _trl_padding_free,
    "static-cu-seq-lens": _static_cu_seq_lens,
    "4d-block-mask": _block_mask_4d,
    "one-example": _one_example,
    "padded": _padded,
}


def _alone(model: Any, example: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([example]), use_cache=False).logits[0].float()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_no_correct_batch_is_refused_and_each_matches_its_examples_alone(
    fake_providers: Any, tiny: Any, family: str, dtype: str
) -> None:
    model = tiny.tiny_model(family).to(DTYPES[dtype])
    worst: dict[str, float] = {}
    for examples_name, examples in (("short", IDS), ("long", LONG)):
        truth = [_alone(model, e) for e in examples]
        for name, layout in LAYOUTS.items():
            REGISTRY.reset()
            report = guard(model, packed=True, allow=["attention"])  # the probe on: it runs on the first row
            batch, spans = layout(examples)
            with torch.no_grad():
                logits = model(**batch, use_cache=False).logits.float()
            rows = [logits[0, s] for s in spans] if logits.shape[0] == 1 else [
                logits[i, s] for i, s in enumerate(spans)]
            want = truth if len(rows) == len(truth) else truth[2:]
            for got, ref in zip(rows, want):
                worst[f"{examples_name}/{name}"] = max(worst.get(f"{examples_name}/{name}", 0.0),
                                                       float((got - ref).abs().max()))
            report.disarm()
    assert all(math.isfinite(v) for v in worst.values()), worst
    if dtype == "fp32":
        assert max(worst.values()) < FP32_TOLERANCE, worst


def test_the_corpus_can_fail_a_leaky_row_is_refused_and_is_far_from_its_examples(
    fake_providers: Any, tiny: Any
) -> None:
    """The negative control: the same harness with the boundaries withheld (position ids only, as a flattening
    collator sends by default) is refused; let through by its allow item, it is off by far more than the
    tolerance the corpus holds correct rows to."""
    from kernelguard.errors import PackedWithoutBoundariesError

    model = tiny.tiny_model("qwen3_5")
    truth = [_alone(model, e) for e in IDS]
    leaky = {"input_ids": torch.tensor([list(itertools.chain.from_iterable(IDS))]), "position_ids": _positions(IDS)}
    guard(model, packed=True, allow=["attention"])
    with torch.no_grad(), pytest.raises(PackedWithoutBoundariesError):
        model(**leaky, use_cache=False)
    REGISTRY.reset()
    guard(model, packed=True, allow=["attention", "packed-without-boundaries"])
    with torch.no_grad():
        logits = model(**leaky, use_cache=False).logits.float()
    off = max(float((logits[0, s] - ref).abs().max()) for s, ref in zip(_spans(IDS)[1:], truth[1:]))
    assert off > 100 * FP32_TOLERANCE, off
