"""kernelguard.train.step.grad_norm: the step's gradient norm over FSDP2's gradient buffers, and the clip done by
the fused AdamW's ``grad_scale``, against torch's own norm and clip (CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernelguard.train.step.grad_norm import clip_divisor, gradient_norm, tiled_buffers


def test_only_gradients_that_tile_a_buffer_end_to_end_are_normed_as_one() -> None:
    buf = torch.arange(20.0)
    a, b, c = buf[0:6].view(2, 3), buf[6:10], buf[10:20].view(5, 2)
    gap = torch.arange(10.0)
    d, e = gap[0:4], gap[5:9]  # one element between them: not a tiling
    over = torch.arange(8.0)
    f, g = over[0:5], over[3:8]  # overlapping views
    t = torch.arange(12.0).view(3, 4).t()  # not contiguous
    alone = torch.ones(3)
    flats, rest = tiled_buffers([c, a, b, d, e, f, g, t, alone])
    assert len(flats) == 1 and torch.equal(flats[0], buf)  # in any order given, the whole buffer once
    assert {id(x) for x in rest} == {id(x) for x in (d, e, f, g, t, alone)}


def test_fsdp2_gradients_are_normed_per_buffer_and_match_torch(gloo_one_rank: Any, fake_providers: Any, tiny: Any) -> None:
    """The product's model under FSDP2: its sharded gradients are views of one reduce-scatter output per group,
    so the norm is taken over a few buffers, and it is torch's norm of every gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from kernelguard.train.model.parallel import apply_fsdp, mixed_precision

    torch.manual_seed(0)
    model = tiny.tiny_model("qwen3_5").train()
    apply_fsdp(model, mesh=init_device_mesh("cpu", (1,)), mp_policy=mixed_precision("fp32"))
    ids = torch.randint(3, model.config.vocab_size, (1, 24))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    flats, rest = tiled_buffers(grads)
    assert flats, "FSDP2 no longer hands out gradients as views of one buffer: the norm fell back to every tensor"
    assert sum(f.numel() for f in flats) + sum(r.numel() for r in rest) == sum(g.numel() for g in grads)
    reference = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    assert float(gradient_norm(model)) == pytest.approx(float(reference), rel=1e-6)


def test_the_fused_adamw_clips_with_grad_scale_as_clip_grads_with_norm_does() -> None:
    """Dividing by :func:`clip_divisor` inside the fused AdamW is torch's clip followed by the same AdamW (to
    rounding); without it the update differs (the clip is real). The gradients' size changes between steps (AdamW
    does not see a constant factor): the first step is under the limit, the later ones over it."""
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (7, 3, 5)]
    start = [torch.randn(s) for s in shapes]
    steps = [[torch.randn(s) * size for s in shapes] for size in (0.01, 3.0, 8.0)]
    max_norm = 1.0
    norms = [torch.nn.utils.get_total_norm(g, norm_type=2.0) for g in steps]
    assert float(norms[0]) < max_norm < float(norms[1])

    def stepped(how: str) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
        for grads, norm in zip(steps, norms):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            if how == "torch":
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            elif how == "grad_scale":
                opt.grad_scale = clip_divisor(norm, max_norm)
            opt.step()
            opt.__dict__.pop("grad_scale", None)
        return [p.detach() for p in params]

    clipped, scaled, unclipped = stepped("torch"), stepped("grad_scale"), stepped("none")
    for a, b in zip(clipped, scaled):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert any(not torch.allclose(a, c, rtol=1e-3) for a, c in zip(clipped, unclipped))
    assert float(clip_divisor(norms[0], max_norm)) == 1.0  # under the limit: nothing is scaled
