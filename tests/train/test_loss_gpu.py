"""The chunked linear cross-entropy on a GPU at Qwen3.5's real vocabulary, bf16 (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernelguard.resolution.packed_batch import IGNORE_INDEX
from kernelguard.train.step.loss import linear_cross_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_real_vocab_bf16_matches_the_stock_loss_with_less_memory() -> None:
    n, hid, vocab = 8192, 2048, 151_936
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(n, hid, device="cuda", generator=gen) * 0.5).bfloat16()
    weight = (torch.randn(vocab, hid, device="cuda", generator=gen) * 0.02).bfloat16()
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    labels[::7] = IGNORE_INDEX

    def stock() -> tuple[torch.Tensor, ...]:
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = F.cross_entropy((h @ w.t()).float(), labels, ignore_index=IGNORE_INDEX)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    def chunked(compiled_chunks: bool = False) -> tuple[torch.Tensor, ...]:
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        total, count = linear_cross_entropy(h, w, labels, compiled_chunks=compiled_chunks)
        loss = total / count
        loss.backward()
        return loss.detach(), h.grad, w.grad

    peaks = {}
    results = {}
    compiled = lambda: chunked(compiled_chunks=True)  # noqa: E731  # what `kernelguard train` runs when it compiles
    compiled()  # compile outside the measured peak
    for name, fn in (("stock", stock), ("chunked", chunked), ("compiled", compiled)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        results[name] = fn()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    l1, dh1, dw1 = results["stock"]

    def off(name: str) -> dict[str, float]:
        l2, dh2, dw2 = results[name]
        return {
            "loss": abs(float(l2) - float(l1)) / abs(float(l1)),
            "dhidden": float((dh2.float() - dh1.float()).norm() / dh1.float().norm()),
            "dweight": float((dw2.float() - dw1.float()).norm() / dw1.float().norm()),
        }

    rel, rel_compiled = off("chunked"), off("compiled")
    print({"rel": rel, "rel_compiled": rel_compiled, "peak_GB": {k: round(v / 2**30, 2) for k, v in peaks.items()}})
    assert rel["loss"] < 1e-4 and rel_compiled["loss"] < 1e-4, (rel, rel_compiled)
    assert rel_compiled["dhidden"] < 3e-2 and rel_compiled["dweight"] < 3e-2, rel_compiled
    assert peaks["compiled"] < 0.75 * peaks["stock"], peaks
    # H200, 2026-12-03: dhidden 0.28%, dweight 0.17% (bf16 against bf16: 10.7x and 17.6x under 3e-2; a wrong
    # gradient is off by O(1)); peaks 8.18 vs 14.55 GB (0.56x: a chunking that materialises the logits is >= 1x,
    # so 0.75 sits between the two, 1.3x from each: a memory figure, the same on every run of one stack)
    assert rel["dhidden"] < 3e-2 and rel["dweight"] < 3e-2, rel
    assert peaks["chunked"] < 0.75 * peaks["stock"], peaks
