"""The step profiler (kernelguard.diagnosis.profiler): the reduction of profiler events to figures, on
synthetic event lists and on a real torch.profiler run of a tiny CPU model, its schedule, its settings, and
`kernelguard train` writing its figures to metrics.jsonl and the end-of-run summary. The verdicts themselves:
tests/diagnosis/test_step_diagnosis.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kernelguard.diagnosis.events import Event, busy_and_gap_us
from kernelguard.diagnosis.profiler import DEFAULT_FIRST_STEP, StepProfiler
from kernelguard.diagnosis.window import summarize_events
from kernelguard.errors import ConfigError
from kernelguard.train.common.ranks import DistInfo
from kernelguard.train.output.profiling import step_profiler
from kernelguard.train.settings.config_cli import parse_args


def test_busy_time_is_the_union_of_kernel_intervals() -> None:
    assert busy_and_gap_us([]) == (0.0, 0.0)
    assert busy_and_gap_us([(0, 10), (5, 15), (20, 30)]) == (25.0, 5.0)  # overlapping kernels (two streams) count once
    assert busy_and_gap_us([(20, 30), (0, 10), (2, 3)]) == (20.0, 10.0)


def _small_kernel_events() -> list[Event]:
    """One step of unfused work: an aten::mul (with a nested mul) launching 3 tiny kernels and an aten::copy_
    launching 1, inside the profiler's step range; 4 kernels of 10 us each in a 1,000 us step."""
    ev = [Event("ProfilerStep#3", "op", 0, 1000), Event("aten::mul", "op", 0, 300, parent=0)]
    ev += [Event("aten::mul", "op", 10 + i, 11 + i, parent=1) for i in range(2)]  # nested: not top-level
    ev += [Event("cudaLaunchKernel", "launch", 20 + i, 21 + i, parent=1) for i in range(3)]
    ev += [Event("aten::copy_", "op", 400, 500, parent=0), Event("cudaLaunchKernel", "launch", 410, 411, parent=7)]
    ev += [Event("cudaStreamSynchronize", "runtime", 900, 1000, parent=0)]
    ev += [Event(f"elementwise_kernel_{i}", "kernel", 100 * i, 100 * i + 10, parent=2 if i < 3 else 7)
           for i in range(4)]
    ev += [Event("gpu_user_annotation", "annotation", 0, 1000)]
    return ev


def test_kernels_are_counted_per_step_and_ranked_by_the_op_that_launched_them() -> None:
    p = summarize_events(_small_kernel_events(), step=3, wall_s=0.002, cpu_s=0.001, reference_step_s=0.001,
                         gpu=True, layers=1)
    assert p.kernels == 4 and p.cpu_ops == 4  # ProfilerStep is a wrapper; runtime calls are not ops
    assert p.gpu_busy_s == pytest.approx(40e-6)
    assert p.gpu_busy_pct == pytest.approx(4.0)  # over the unprofiled step time, not the profiled 2 ms
    assert p.top_ops == (("aten::mul", 3.0), ("aten::copy_", 1.0))  # the outermost op, not the nested one
    assert p.verdict == "healthy"  # 4 kernels: neither a reference nor many small kernels; busy alone says nothing
    rec = p.record()
    assert rec["gpu_busy_pct"] == 4.0 and rec["kernels_per_step"] == 4 and rec["verdict"] == "healthy"
    assert rec["launch_heavy_ops"][0] == {"op": "aten::mul", "per_step": 3.0}
    assert rec["gpu_time_by_class_pct"] == {"elementwise": 100.0} and rec["kernels_per_layer"] == 4.0


def test_a_busy_gpu_is_healthy_and_figures_are_per_step() -> None:
    events = [Event("aten::mm", "op", 0, 5), Event("cuLaunchKernel", "launch", 1, 2, parent=0)]
    events += [Event("gemm", "kernel", 0, 900, parent=0), Event("gemm", "kernel", 1000, 1900, parent=0)]
    events += [Event("Memset", "copy", 950, 960)]
    p = summarize_events(events, step=10, steps=2, wall_s=0.002, cpu_s=0.004, gpu=True)
    assert p.kernels == 1 and p.cpu_s == 0.002 and p.wall_s == 0.001
    assert p.gpu_busy_pct == pytest.approx(90.5)  # no reference step: over the profiled wall time
    assert p.verdict == "healthy" and p.warning() is None
    assert p.top_ops == (("aten::mm", 1.0),)


def test_warm_up_steps_in_the_reference_do_not_make_a_busy_gpu_look_idle() -> None:
    # Steps 1-2 autotuned (10 s each); the profiled step 3 took 0.1 s with the GPU busy 90 ms of it.
    events = [Event("aten::mm", "op", 0, 5), Event("gemm", "kernel", 0, 90_000, parent=0)]
    p = summarize_events(events, step=3, wall_s=0.1, cpu_s=0.05, reference_step_s=10.0, gpu=True)
    assert p.step_s == pytest.approx(0.1)
    assert p.gpu_busy_pct == pytest.approx(90.0)
    assert p.verdict == "healthy"


def test_a_cpu_run_has_no_gpu_figures_and_never_warns() -> None:
    events = [Event("aten::linear", "op", 0, 10), Event("aten::addmm", "op", 1, 9, parent=0)]
    events += [Event("aten::relu", "op", 10, 12)] * 2
    p = summarize_events(events, step=3, wall_s=0.01, cpu_s=0.01, gpu=False)
    assert p.gpu_busy_s is None and p.gpu_busy_pct is None and p.kernels is None
    assert p.verdict is None and p.warning() is None
    assert p.cpu_ops == 4 and p.top_ops == (("aten::relu", 2.0), ("aten::linear", 1.0))  # top-level calls
    assert p.record()["gpu_busy_pct"] is None and "GPU figures n/a (no GPU)" in p.line()


def test_by_default_a_gpu_run_is_profiled_from_step_10_and_a_cpu_run_never(tmp_path: Path) -> None:
    cpu = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    cuda = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    assert step_profiler(parse_args(_flags(tmp_path)), cpu).first_step == 0
    assert step_profiler(parse_args(_flags(tmp_path)), cuda).first_step == DEFAULT_FIRST_STEP == 10
    assert step_profiler(parse_args(_flags(tmp_path, "--profile-step", "4")), cpu).first_step == 4  # asked for
    assert step_profiler(parse_args(_flags(tmp_path, "--profile-trace", "t")), cpu).first_step == 10
    rank1 = DistInfo(rank=1, world_size=2, local_rank=1, device=torch.device("cuda", 1))
    assert step_profiler(parse_args(_flags(tmp_path)), rank1).first_step == 0  # rank 0 only


def test_the_schedule_profiles_the_first_step_then_every_n() -> None:
    assert [s for s in range(1, 30) if StepProfiler(first_step=3, every=10).due(s)] == [3, 13, 23]
    assert [s for s in range(1, 30) if StepProfiler(first_step=3, every=0).due(s)] == [3]
    assert not any(StepProfiler(first_step=0, every=10).due(s) for s in range(30))


def test_a_real_profiler_window_on_a_tiny_cpu_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 32)

    def step() -> float:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    logged: list[str] = []
    # The clock ticks 0.1 s per read: every step takes the same time, whatever the machine's load (a step of this
    # model is a millisecond: under load one 3x slower than another can postpone the window past step 8).
    prof = StepProfiler(first_step=3, every=2, trace_dir=tmp_path / "trace", device=torch.device("cpu"),
                        log=logged.append, clock=iter([i / 10 for i in range(100)]).__next__)
    records = [prof.run(s, step) for s in range(1, 9)]
    assert all(isinstance(loss, float) for loss, _ in records)
    windows = [s for s, (_, figures) in enumerate(records, start=1) if figures]
    # the first window waits for three unprofiled steps that agree (steps 1-3), then every 2 from step 3
    assert windows == [4, 5, 7], windows
    rec = records[windows[0] - 1][1]
    assert rec["gpu_busy_pct"] is None and rec["kernels_per_step"] is None and rec["verdict"] is None
    assert rec["cpu_ops_per_step"] > 10 and rec["cpu_s_per_step"] > 0 and rec["profile_overhead_s"] >= 0
    ops = [o["op"] for o in rec["launch_heavy_ops"]]
    assert "aten::linear" in ops or any(o.startswith(("aten::", "Optimizer", "autograd::")) for o in ops), ops
    trace = Path(rec["profile_trace"])
    assert trace == tmp_path / "trace" / f"trace_step{windows[0]}.json"
    assert "traceEvents" in json.loads(trace.read_text())
    assert all("profile_trace" not in records[s - 1][1] for s in windows[1:])  # only the first window is traced
    assert logged == [f"profile trace of step {windows[0]}: {trace} (open it in https://ui.perfetto.dev)"]
    summary = prof.summary()
    assert summary is not None and summary.startswith(f"profile ({len(windows)} window(s)): step {windows[-1]}: ")
    assert "GPU figures n/a (no GPU)" in summary and "profiling cost" in summary


def test_a_window_with_an_autotune_search_inside_is_thrown_away_and_the_next_step_profiled() -> None:
    import torch

    held = iter([0, 2, 2, 2])  # the step-4 window gained two autotune results; the step-5 window none
    prof = StepProfiler(first_step=4, every=0, device=torch.device("cpu"), searches=lambda: next(held),
                        clock=iter([i / 10 for i in range(100)]).__next__)  # every step 0.1 s: steady
    figures = [prof.run(s, lambda: None)[1] for s in range(1, 8)]
    assert [bool(f) for f in figures] == [False, False, False, False, True, False, False]
    assert prof.retried == 1 and [p.step for p in prof.profiles] == [5]


def _flags(tmp_path: Path, *extra: str) -> list[str]:
    return ["--model", "m", "--data", "d", "--output-dir", str(tmp_path / "o"), *extra]


def test_profile_settings_parse_and_are_checked(tmp_path: Path) -> None:
    cfg = parse_args(_flags(tmp_path))
    assert (cfg.metrics.profile_step, cfg.metrics.profile_every, cfg.metrics.profile_trace) == (None, 500, None)
    cfg = parse_args(_flags(tmp_path, "--profile-step", "5", "--profile-every", "0", "--profile-trace", "t"))
    assert (cfg.metrics.profile_step, cfg.metrics.profile_every, cfg.metrics.profile_trace) == (5, 0, Path("t"))
    with pytest.raises(ConfigError, match="profile_every is -1"):
        parse_args(_flags(tmp_path, "--profile-every", "-1"))
    with pytest.raises(ConfigError, match="profile_trace .* profile_step 0"):
        parse_args(_flags(tmp_path, "--profile-step", "0", "--profile-trace", "t"))


def test_a_profiled_step_after_max_steps_is_refused_at_start_up(tmp_path: Path) -> None:
    from kernelguard.train.startup.startup_checks import check_profile_window

    with pytest.raises(ConfigError) as info:
        check_profile_window(parse_args(_flags(tmp_path, "--profile-step", "50", "--max-steps", "3")))
    assert info.value.message == "--profile-step 50 is after the run's last step (--max-steps 3): no step would be profiled."
    assert info.value.fix == "--profile-step 3 (or any step up to 3), or leave the profiling flags out"
    with pytest.raises(ConfigError, match=r"^--profile-trace t \(its first profiled step is 10, the default\) is after"):
        check_profile_window(parse_args(_flags(tmp_path, "--profile-trace", "t", "--max-steps", "3")))
    for ok in (["--profile-step", "3", "--max-steps", "3"], ["--profile-step", "50"], ["--max-steps", "3"],
               ["--profile-step", "0", "--max-steps", "3"]):  # fmt: skip
        check_profile_window(parse_args(_flags(tmp_path, *ok)))


def test_an_asked_step_that_is_moved_is_said_with_why() -> None:
    """--profile-step 1 cannot be profiled (the warm-up) and --profile-step 4 was moved by an autotune search:
    each run says which step it profiled instead, and why; a step profiled as asked says nothing."""
    clock = lambda: iter([i / 10 for i in range(100)]).__next__  # noqa: E731 - every step 0.1 s: steady
    said: list[str] = []
    warm = StepProfiler(first_step=1, every=0, device=torch.device("cpu"), clock=clock(), log=said.append, asked=True)
    assert [s for s in range(1, 8) if warm.run(s, lambda: None)[1]] == [4]
    assert said == ["--profile-step 1: profiled step 4 instead (the 3 steps before a window must be steady, and step "
                    "3 came while the run was still compiling, autotuning or warming up; its figures would describe "
                    "the compiler or the autotuner, not the step)"]
    said.clear()
    held = iter([0, 2, 2, 2])
    tuned = StepProfiler(first_step=4, every=0, device=torch.device("cpu"), searches=lambda: next(held),
                         clock=clock(), log=said.append, asked=True)
    assert [s for s in range(1, 8) if tuned.run(s, lambda: None)[1]] == [5]
    assert said[0].startswith("--profile-step 4: profiled step 5 instead (an fla autotune search ran inside step 4;")
    said.clear()
    exact = StepProfiler(first_step=4, every=0, device=torch.device("cpu"), clock=clock(), log=said.append, asked=True)
    assert [s for s in range(1, 8) if exact.run(s, lambda: None)[1]] == [4] and said == []


def test_a_window_still_waiting_for_steady_steps_is_taken_at_the_last_step() -> None:
    """A 3-step run asked to profile every step: steps are never steady (three unprofiled ones are needed),
    so without the last step the window would never run, silently."""
    clock = iter([i / 10 for i in range(100)]).__next__
    waiting = StepProfiler(first_step=1, every=1, device=torch.device("cpu"), clock=clock)
    assert not any(waiting.run(s, lambda: None)[1] for s in range(1, 4))
    last = StepProfiler(first_step=1, every=1, device=torch.device("cpu"), clock=clock, last_step=3)
    assert [bool(last.run(s, lambda: None)[1]) for s in range(1, 4)] == [False, False, True]


def test_an_explicit_profile_that_never_ran_is_one_warning_line(tmp_path: Path) -> None:
    from kernelguard.train.output.profiling import unprofiled_warning

    cfg = parse_args(_flags(tmp_path, "--profile-step", "50", "--profile-trace", "t"))
    never = StepProfiler(first_step=50, every=500)
    assert unprofiled_warning(cfg, never, stop_step=3) == (
        "--profile-step 50: no step was profiled; the run's steps ended at step 3, so --profile-trace t holds no "
        "trace (give a --profile-step within the run's steps)"
    )
    default = parse_args(_flags(tmp_path))  # not asked for: a CPU run that is never profiled says nothing
    assert unprofiled_warning(default, StepProfiler(first_step=0), stop_step=3) is None


@pytest.mark.slow
def test_train_writes_the_figures_to_metrics_and_the_summary(tmp_path: Path) -> None:
    import train_helpers as h

    assets = h.write_train_assets(tmp_path / "assets", rows=120)
    out = tmp_path / "run"
    args = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--output-dir", str(out), "--block-size", "256", "--param-dtype", "fp32", "--max-steps", "6",
            "--no-progress", "--no-plot", "--no-export", "--allow", "attention", "--profile-step", "2",
            "--profile-every", "2", "--profile-trace", str(tmp_path / "trace")]
    r = h.run_train(args, nproc=0, fault="steady-steps")  # every step 0.1 s on the profiler's clock
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    profiled = [rec["step"] for rec in recs if "cpu_s_per_step" in rec]
    assert profiled == [4, 6], profiled  # step 2 postponed until three steady steps precede it, then every 2
    assert all(rec["gpu_busy_pct"] is None and rec["cpu_ops_per_step"] > 0 for rec in recs if "cpu_s_per_step" in rec)
    assert (tmp_path / "trace" / f"trace_step{profiled[0]}.json").exists()
    assert f"kernelguard train: profile ({len(profiled)} window(s)): step {profiled[-1]}: GPU figures n/a (no GPU)" in (
        r.stderr)
    assert "slow path:" not in r.stderr


def test_the_callback_records_the_figures_in_log_history(
    fake_providers: Path, tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import Trainer, TrainingArguments, default_data_collator

    from kernelguard.integrations import transformers as integration
    from kernelguard.integrations.transformers import PROFILE_KEY, KernelGuardCallback

    def steady_profiler(*args: Any) -> Any:
        """The callback's own profiler, timed by a clock that ticks 0.1 s per read: every step takes the same
        time, so the schedule (three steady steps first) does not depend on the machine's load."""
        profiler = real_profiler(*args)
        ticks = iter(range(10_000))
        profiler.clock = lambda: next(ticks) / 10
        return profiler

    real_profiler = integration._step_profiler
    monkeypatch.setattr(integration, "_step_profiler", steady_profiler)

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(3, 256, (12,), generator=g)), "labels": ids} for _ in range(8)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2, report_to="none",
        use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    callback = KernelGuardCallback(verbose=False, profile_step=2, profile_every=2)
    args.max_steps = 6
    trainer = Trainer(model=tiny.tiny_model("qwen3_5").train(), args=args, train_dataset=rows,
                      data_collator=default_data_collator, callbacks=[callback])
    trainer.train()
    profiled = [(e["step"], e[PROFILE_KEY]) for e in trainer.state.log_history if PROFILE_KEY in e]
    steps = [step for step, _ in profiled]
    # asked for step 2 and every 2: step 2 waits for three steady steps before it (postponed to 4), then 6
    assert steps == [4, 6], steps
    for _, figures in profiled:
        assert figures["gpu_busy_pct"] is None and figures["cpu_ops_per_step"] > 0 and figures["verdict"] is None
    err = capsys.readouterr().err
    assert f"kernelguard: profile ({len(steps)} window(s)): step {steps[-1]}: GPU figures n/a (no GPU)" in err
    assert callback.profiler is None  # dropped on train end


def test_the_callback_does_not_profile_a_cpu_run_by_default(fake_providers: Path, tiny: Any) -> None:
    from kernelguard.integrations.transformers import KernelGuardCallback, _step_profiler

    model = tiny.tiny_model("qwen3_5")
    assert _step_profiler(KernelGuardCallback().profile, model, object()) is None
    assert _step_profiler(KernelGuardCallback(profile_step=3).profile, model, object()).first_step == 3
