"""The step diagnosis (kernelguard.diagnosis.verdict, kernel_classes): kernel classes by name, attribution of
kernels to the torch reference functions that launched them (forward and backward), and the verdicts — on
synthetic records, on a real profiler run of a tiny Qwen3.5 model on CPU, and on kernel records recorded from
real H200 traces of the fallback, the stock recipe and the product (tests/data/profiles/)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kernelguard.diagnosis.events import Event
from kernelguard.diagnosis.kernel_classes import KERNEL_CLASSES, classify_kernel
from kernelguard.diagnosis.profiler import StepProfiler, events_from_profiler
from kernelguard.diagnosis.verdict import (
    SLOW_PATH_PCT,
    KernelRecord,
    attribute_kernels,
    diagnose,
    layer_span,
)
from kernelguard.diagnosis.window import summarize_events
from kernelguard.runtime.tripwires import REFERENCE_RANGE, arm_tripwires

PROFILES = Path(__file__).parents[1] / "data" / "profiles"


# ------------------------------------------------------------------------------------------ classes ---
@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn"),
        ("chunk_bwd_kernel_dqkwg", "gdn"),
        ("solve_tril_16x16_kernel", "gdn"),
        ("l2norm_fwd_kernel", "gdn"),
        ("void causal_conv1d_channellast_fwd_kernel<Causal_conv1d_channellast_fwd_kernel_traits<128, 4, 16, true, true>>", "conv"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, false, true>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>", "elementwise"),
        ("triton_poi_fused_add_mul_0", "elementwise"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("ncclDevKernel_AllGather_RING_LL", "communication"),
        ("void at::native::elementwise_kernel<128, 4, gpu_kernel_impl_nocast<direct_copy_kernel_cuda>>", "copy"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 3>", "copy"),
        ("void at::native::cunn_SoftMaxForward<8, float>", "elementwise"),
        ("void at::native::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>", "loss"),
        ("some_unknown_thing", "other"),
    ],
)
def test_kernel_names_are_classified(name: str, cls: str) -> None:
    assert classify_kernel(name) == cls
    assert cls in KERNEL_CLASSES


# -------------------------------------------------------------------------------------- attribution ---
def _tree() -> list[Event]:
    """A forward op inside a reference range (seq 7), its backward node (seq 7), an op outside (seq 8) and its
    backward node; one kernel launched by each op."""
    return [
        Event(f"{REFERENCE_RANGE}torch_chunk_gated_delta_rule@model.layers.2.linear_attn", "op", 0, 50),  # 0
        Event("aten::mul", "op", 1, 5, parent=0, seq=7),  # 1
        Event("aten::mm", "op", 60, 70, seq=8),  # 2
        Event("autograd::engine::evaluate_function: MulBackward0", "op", 100, 120, seq=7),  # 3
        Event("MulBackward0", "op", 101, 119, parent=3, seq=7),  # 4
        Event("aten::mul", "op", 102, 110, parent=4),  # 5
        Event("autograd::engine::evaluate_function: MmBackward0", "op", 130, 150, seq=8),  # 6
        Event("aten::mm", "op", 131, 149, parent=6),  # 7
        Event("elementwise_kernel", "kernel", 2, 4, parent=1),
        Event("nvjet_gemm", "kernel", 61, 69, parent=2),
        Event("elementwise_kernel", "kernel", 103, 109, parent=5),
        Event("nvjet_gemm", "kernel", 132, 148, parent=7),
        Event("Memset (Device)", "copy", 150, 151),
    ]


def test_kernels_launched_inside_a_reference_forward_and_its_backward_are_attributed_to_it() -> None:
    records = attribute_kernels(_tree())
    ref = "torch_chunk_gated_delta_rule@model.layers.2.linear_attn"
    assert [(r.name, r.reference) for r in records] == [
        ("elementwise_kernel", ref),  # forward, inside the range
        ("nvjet_gemm", None),
        ("elementwise_kernel", ref),  # backward: its node carries the forward op's sequence number
        ("nvjet_gemm", None),
        ("Memset (Device)", None),
    ]
    assert records[2].op == "autograd::engine::evaluate_function: MulBackward0"
    assert records[1].op == "aten::mm" and records[4].copy and records[4].cls == "copy"


def test_layer_spans_are_compressed() -> None:
    paths = [f"model.layers.{i}.linear_attn" for i in (0, 1, 2, 5, 7, 8)]
    assert layer_span(paths) == "0-2, 5, 7-8"
    assert layer_span(["GatedDeltaNet (layer_idx=3)"]) == "GatedDeltaNet (layer_idx=3)"


@pytest.mark.slow  # a tiny Qwen3.5 forward + backward under the profiler on CPU: a few seconds
def test_a_real_profiler_window_attributes_the_reference_and_its_backward(tiny: Any) -> None:
    """The real event tree of a tiny Qwen3.5 model whose GDN layers run transformers' torch reference: ops
    inside the tripwire's range, and backward nodes linked by sequence number. Kernels are simulated as one
    per leaf op (CPU has none), launched by that op, as the profiler's correlation ids link them on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = tiny.tiny_model("qwen3_5").train()
    ids = torch.randint(3, 100, (1, 32))
    with arm_tripwires(allow=["*"], source="test"), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    events = events_from_profiler(prof)
    children = {e.parent for e in events if e.parent is not None}
    leaves = [i for i, e in enumerate(events) if e.kind == "op" and i not in children]
    simulated = events + [Event(f"k:{events[i].name}", "kernel", events[i].start_us, events[i].end_us, parent=i)
                          for i in leaves]
    records = attribute_kernels(simulated)
    refs = {r.reference for r in records if r.reference}
    layers = sorted({r.split("@")[1] for r in refs})
    assert {r.split("@")[0] for r in refs} >= {"torch_chunk_gated_delta_rule"}
    assert layers and all(".linear_attn" in layer for layer in layers), layers
    backward = [r for r in records if r.reference and r.op.startswith("autograd::engine::evaluate_function")]
    forward = [r for r in records if r.reference and not r.op.startswith("autograd::engine::evaluate_function")]
    assert backward and forward  # the reference's backward is its slow path too
    outside = [r for r in records if r.reference is None and "linear" in r.op.lower()]
    assert outside  # the MLP / projections are not blamed on the reference


# ----------------------------------------------------------------------------------------- verdicts ---
def _k(name: str, start: float, dur: float, *, ref: str | None = None, op: str = "aten::op") -> KernelRecord:
    return KernelRecord(name, start, start + dur, op, ref)


def test_a_slow_path_names_the_reference_function_and_its_layers_whatever_the_gpu_busy() -> None:
    ref = "torch_chunk_gated_delta_rule@model.layers.{}.linear_attn"
    records = [_k("elementwise_kernel", i * 10.0, 9.0, ref=ref.format(i % 3)) for i in range(90)]
    records += [_k("nvjet_gemm", 900 + i * 10.0, 9.0) for i in range(10)]
    d = diagnose(records, step_s=1000e-6, layers=4, fix="pip install 'flash-linear-attention>=0.6.0,<1'")
    assert d.busy_pct == pytest.approx(90.0)  # a busy GPU, and still the slow path
    assert d.verdict == "slow_path" and d.alarm
    assert d.line == (
        "slow path: 90% of GPU time is in kernels launched from transformers' torch reference functions: "
        "`torch_chunk_gated_delta_rule` 90% (layers 0-2). Fix: pip install 'flash-linear-attention>=0.6.0,<1'"
    )
    rec = d.record()
    assert rec["verdict"] == "slow_path" and rec["reference_pct"] == 90.0
    assert rec["reference_functions"] == [{"function": "torch_chunk_gated_delta_rule", "layers": "0-2", "pct": 90.0}]


def test_a_stray_reference_call_below_the_threshold_is_not_a_slow_path() -> None:
    share = SLOW_PATH_PCT / 2
    records = [_k("elementwise_kernel", 0, share, ref="torch_causal_conv1d_update@m.layers.0")]
    records += [_k("nvjet_gemm", 10, 100 - share)]
    assert diagnose(records, step_s=120e-6, layers=1).verdict == "healthy"


def test_many_small_elementwise_kernels_without_a_reference_are_small_kernel_bound() -> None:
    records = [_k("vectorized_elementwise_kernel", i * 2.0, 1.5, op="aten::mul") for i in range(1500)]
    records += [_k("nvjet_gemm", 4000 + i * 10.0, 5.0, op="aten::mm") for i in range(100)]
    d = diagnose(records, step_s=0.004, layers=2)
    assert d.verdict == "small_kernels"
    assert d.line.startswith("small-kernel bound: 82% of GPU time in elementwise/copy kernels, 800 kernels per "
                             "decoder layer per step; most launched by: aten::mul x1,500")


def test_a_long_stretch_without_kernels_on_a_steady_step_is_gpu_idle() -> None:
    records = [_k("nvjet_gemm", i * 10.0, 9.0) for i in range(20)] + [_k("nvjet_gemm", 900, 50)]
    d = diagnose(records, step_s=1000e-6, layers=2)
    assert d.verdict == "gpu_idle" and d.busy_pct == pytest.approx(23.0) and d.largest_gap_pct == pytest.approx(70.1)
    assert d.line.startswith("GPU idle: kernels ran 23% of a steady step and the GPU waited 70% of it in one stretch")


def test_a_half_busy_gpu_with_many_small_gaps_is_healthy_not_an_alarm() -> None:
    # A small model's product step: the host dispatches kernels back to back, the GPU waits a little each time.
    records = [_k("nvjet_gemm", i * 20.0, 9.0) for i in range(50)]
    d = diagnose(records, step_s=1000e-6, layers=2, flops_per_step=4e8, peak_flops=1e12)
    assert d.verdict == "healthy" and not d.alarm and d.busy_pct == pytest.approx(45.0)
    assert d.line == "healthy: MFU 40.0%; GPU time: gemm 100%; fused GDN/conv/attention 0%"


def test_summarize_events_diagnoses_gpu_windows_and_warns_only_on_an_alarm() -> None:
    events = _tree()
    p = summarize_events(events, step=12, wall_s=0.0004, cpu_s=0.0002, reference_step_s=0.0002, gpu=True, layers=1)
    assert p.verdict == "slow_path"  # 8 of 33 us (memset included) from the reference: 24%
    warning = p.warning()
    assert warning is not None and warning.startswith("at step 12: slow path: 24% of GPU time")
    assert "\n" not in warning
    assert p.kernels == 4  # the memset is a copy, not a kernel launch
    cpu = summarize_events([Event("aten::relu", "op", 0, 1)], step=3, wall_s=0.01, cpu_s=0.01, gpu=False)
    assert cpu.verdict is None and cpu.warning() is None and "GPU figures n/a (no GPU)" in cpu.line()


# ---------------------------------------------------------------------------------- H200 recordings ---
def _recorded(variant: str) -> dict[str, Any]:
    path = PROFILES / f"{variant}.json.gz"
    if not path.exists():
        pytest.fail(f"missing recorded H200 profile {path}: bash bench/gpu/acceptance.sh writes it to $OUT/profiles")
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _diagnose_recorded(variant: str) -> Any:
    data = _recorded(variant)
    records = [KernelRecord.from_list(row) for row in data["kernels"]]
    return diagnose(records, step_s=data["step_s"], layers=data["layers"], flops_per_step=data["flops_per_step"],
                    peak_flops=data["peak_flops"])


def test_recorded_h200_fallback_is_a_slow_path_naming_the_gdn_reference() -> None:
    d = _diagnose_recorded("fallback")
    assert d.verdict == "slow_path", d.line
    assert d.references[0][0] == "torch_chunk_gated_delta_rule", d.references
    assert "`torch_chunk_gated_delta_rule`" in d.line and "(layers " in d.line


@pytest.mark.parametrize("variant", ["product_default", "stock_best"])
def test_recorded_h200_fast_paths_are_healthy(variant: str) -> None:
    d = _diagnose_recorded(variant)
    assert d.verdict == "healthy", d.line
    assert d.reference_pct == 0.0 and d.by_class_pct["gdn"] > 0  # fla's fused kernels ran


def test_recorded_h200_fallback_with_its_attribution_removed_is_still_not_healthy() -> None:
    """Negative control: the fallback's kernels with their launcher forgotten (a reference the tripwires do not
    know) must still not read healthy: the small-kernel rule catches what attribution cannot."""
    data = _recorded("fallback")
    records = [KernelRecord.from_list([*row[:4], None, row[5]]) for row in data["kernels"]]
    d = diagnose(records, step_s=data["step_s"], layers=data["layers"])
    assert d.verdict != "healthy", d.line


# ---------------------------------------------------------------------------------------- schedule ---
def test_the_first_window_waits_for_three_steady_steps() -> None:
    ticks = iter([0.0, 5.0, 5.0, 6.0, 6.0, 6.1, 6.1, 6.2, 6.2, 6.3] + [6.4 + i / 100 for i in range(40)])
    prof = StepProfiler(first_step=2, every=0, device=torch.device("cpu"), searches=lambda: 0,
                        clock=lambda: next(ticks))
    figures = [prof.run(s, lambda: None)[1] for s in range(1, 8)]
    # steps 1-5 unprofiled: 5 s (compile), then 1.0, 0.1, 0.1, 0.1 s; the last three agree first at step 6
    assert [bool(f) for f in figures] == [False, False, False, False, False, True, False]
    assert [p.step for p in prof.profiles] == [6] and prof.retried == 4
