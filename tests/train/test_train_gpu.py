"""GPU-only checks of the train path (skipped without CUDA; run on the H200 machine, see DEVICE.md)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import train_helpers as h

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _per_segment_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """q/k/v [1, H, T, D] fp32; causal SDPA inside every segment."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    outs = [
        F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
        for a, b in itertools.pairwise(cu)
    ]
    return torch.cat(outs, dim=2).transpose(1, 2)  # [1, T, H, D]


def test_varlen_attention_matches_per_segment_sdpa() -> None:
    from kernelguard.runtime.attention import VARLEN_NAME, register_varlen_attention, varlen_attention_forward

    name = register_varlen_attention(device_type="cuda")
    if name != VARLEN_NAME:
        pytest.skip(
            f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (would use {name})"
        )
    torch.manual_seed(0)
    lens = [100, 37, 250, 125]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    t, heads, kv_heads, dim = cu[-1], 8, 2, 128
    q = torch.randn(1, heads, t, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, t, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, t, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu_t = torch.tensor(cu, device="cuda", dtype=torch.int32)

    class _M:
        is_causal = True

    out, _ = varlen_attention_forward(
        _M(),
        q,
        k,
        v,
        None,
        scaling=dim**-0.5,
        cu_seq_lens_q=cu_t,
        cu_seq_lens_k=cu_t,
        max_length_q=max(lens),
        max_length_k=max(lens),
    )
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = _per_segment_reference(qf, kf, vf, cu)
    assert out.shape == ref.shape
    # H200, 2026-12-03: 0.0085 max abs, grads 0.31-0.35% (bf16); attending across segments moved outputs by 2.05
    # in the CPU twin (tests/runtime/test_attention.py)
    assert float((out.detach().float() - ref.detach()).abs().max()) < 0.1
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    ref.backward(grad)
    for a, b in ((q, qf), (k, kf), (v, vf)):
        rel = float((a.grad.float() - b.grad).norm() / b.grad.norm())
        assert rel < 5e-2, rel


# Three `kernelguard train` processes, each compiling its layers and autotuning fla for this tiny geometry:
# over the acceptance's default per-test bound, within its group's.
@pytest.mark.timeout(210)
def test_one_gpu_packed_bf16_training_with_varlen_and_resume(tmp_path: Path) -> None:
    tok = h.write_tokenizer(tmp_path / "tok")
    model = h.write_model_config(tmp_path / "model")
    data = h.write_jsonl(tmp_path / "data.jsonl", h.copy_task_rows(600))

    def args(out: Path, *extra: str) -> list[str]:
        return [
            "--model", str(model), "--tokenizer", str(tok), "--data", str(data), "--output-dir", str(out),
            "--block-size", "512", "--learning-rate", "3e-3", "--schedule-steps", "10", "--no-progress",
            "--eval-fraction", "0.1", "--eval-every", "4",
            # The fake fla reports version 0.6.0: on Hopper with Triton 3.4-3.7.0 the known-issue table matches
            # it (fla #640, key head dim <= 64) exactly as it would the real one. Accepting that one row is
            # what a user of this stack would do; no slow-path allowance is given.
            "--allow", "fla-640-wrong-grads",
            # Its subject is varlen attention and resume; three processes each compiling outgrew the
            # acceptance's shared phase (bench/RESULTS.md 1.11). Compile on a GPU is the default that
            # bench/gpu/train_diagnosis.sh and the timed variants run.
            "--no-compile", *extra,
        ]  # fmt: skip

    full = tmp_path / "full"
    r = h.run_train(args(full, "--max-steps", "8"), nproc=1, cuda=True, timeout=500)
    assert r.returncode == 0, r.stderr
    assert "attention=kernelguard_varlen" in r.stderr, (
        r.stderr
    )  # no slow path allowed: the guard passed on its own
    recs = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in recs if "eval_loss" in x]
    recs = [x for x in recs if "loss" in x]
    losses = [x["loss"] for x in recs]
    assert losses[-1] < losses[0] - 0.5, losses
    assert [x["step"] for x in evals] == [4, 8] and evals[1]["eval_loss"] < evals[0]["eval_loss"], evals
    part = tmp_path / "part"
    assert h.run_train(args(part, "--max-steps", "4"), nproc=1, cuda=True, timeout=500).returncode == 0
    r = h.run_train(args(part, "--max-steps", "8", "--resume"), nproc=1, cuda=True, timeout=500)
    assert r.returncode == 0, r.stderr
    resumed = [
        r["loss"] for x in (part / "metrics.jsonl").read_text().splitlines() if "loss" in (r := json.loads(x))
    ]
    assert len(resumed) == 8
    assert max(abs(a - b) for a, b in zip(losses, resumed)) < 1e-3, (losses, resumed)
    print(json.dumps({"losses": losses, "resumed": resumed, "evals": evals, "last": recs[-1]}))
