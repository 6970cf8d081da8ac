"""--report-to: MetricsLog fans each record out to TensorBoard (real event files), wandb and trackio (stand-in
modules with their call signatures); a missing library is refused at config time with the pip command."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kernelguard.errors import ConfigError
from kernelguard.train.output.metrics import MetricsLog, open_metrics, plot_metrics
from kernelguard.train.settings.config import TrainConfig, config_dict


def _open(cfg: TrainConfig) -> MetricsLog:
    """What the training loop opens for cfg: OUTPUT/metrics.jsonl and its trackers, given the saved config."""
    output, report_to = cfg.checkpoint.output_dir, cfg.metrics.report_to
    return open_metrics(output, report_to=report_to, run_config=config_dict(cfg), resume_step=None)

RECORDS: list[dict[str, Any]] = [
    {"step": 1, "loss": 2.5, "lr": 1e-4, "tokens_per_s": 100.0, "mfu": None},
    {"step": 2, "loss": 2.0, "lr": 2e-4, "tokens_per_s": 110.0, "mfu": None},
    {"step": 2, "eval_loss": 2.2, "eval_tokens": 64},
    {"step": 3, "loss": 1.5, "lr": 2e-4, "tokens_per_s": 120.0, "mfu": None},
]


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_writes_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    cfg = TrainConfig.from_flags(model="m", data="d", output=tmp_path, report_to=("tensorboard",))
    log = _open(cfg)
    for rec in RECORDS:
        log.write(rec)
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    scalars = _scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(1, 2.5), (2, 2.0), (3, 1.5)]
    assert [s for s, _ in scalars["train/lr"]] == [1, 2, 3] and "train/mfu" not in scalars  # None is skipped
    assert scalars["eval/loss"] == [(2, pytest.approx(2.2))] and scalars["eval/tokens"] == [(2, 64.0)]
    # metrics.jsonl keeps every record as written.
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == RECORDS


def test_tensorboard_resume_drops_events_after_the_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=None, report_to=("tensorboard",))
    for rec in RECORDS:
        log.write(rec)
    log.close()
    # Killed after step 3 but resumed from the step-1 checkpoint: steps 2 and 3 are trained again.
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=1, report_to=("tensorboard",))
    log.write({"step": 2, "loss": 1.9})
    log.close()
    assert _scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 2.5), (2, pytest.approx(1.9))]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("name", ["wandb", "trackio", "tensorboard"])
def test_missing_library_is_a_config_error_with_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # importlib.util.find_spec -> None, as when not installed
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_flags(model="m", data="d", output=tmp_path, report_to=(name,))
    assert info.value.message == f"--report-to {name}: the {name} package is not installed (or leave --report-to {name} out)."
    assert info.value.fix == f"pip install 'kernelguard-gdn[{name}]'"


def test_missing_wandb_through_the_cli_exits_2_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernelguard.train.__main__ import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    out = tmp_path / "out"
    args = [
        "--model",
        str(tmp_path / "missing"),
        "--data",
        "d",
        "--output-dir",
        str(out),
        "--report-to",
        "wandb",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == (
        "kernelguard train: error: --report-to wandb: the wandb package is not installed (or leave --report-to "
        "wandb out).\n"
        "Fix: pip install 'kernelguard-gdn[wandb]'\n"
    )
    assert not out.exists()


def test_report_to_none_and_comma_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb([]))
    pytest.importorskip("tensorboard")
    cfg = TrainConfig.from_flags(model="m", data="d", output=tmp_path, report_to=["tensorboard,wandb", "wandb"])  # type: ignore[arg-type]
    assert cfg.metrics.report_to == ("tensorboard", "wandb")
    assert TrainConfig.from_flags(model="m", data="d", output=tmp_path, report_to=("none",)).metrics.report_to == ()


class _FakeRun:
    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    def log(self, values: dict[str, float], *, step: int) -> None:
        self.calls.append(("log", (step, values)))

    def finish(self) -> None:
        self.calls.append(("finish", None))


def _fake_wandb(calls: list[tuple[str, Any]], *, fail: bool = False) -> types.ModuleType:
    mod = types.ModuleType("wandb")

    def init(**kwargs: Any) -> _FakeRun:
        if fail:
            raise RuntimeError("api_key not configured (no-tty)")
        calls.append(("init", kwargs))
        return _FakeRun(calls)

    mod.init = init  # type: ignore[attr-defined]
    mod.__spec__ = types.SimpleNamespace(name="wandb")  # type: ignore[assignment]
    return mod


def test_wandb_gets_the_config_and_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    monkeypatch.setenv("WANDB_PROJECT", "proj")
    cfg = TrainConfig.from_flags(model="m", data="d", output_dir=tmp_path / "run1", report_to=("wandb",), learning_rate=3e-4)
    log = _open(cfg)
    for rec in RECORDS[:3]:
        log.write(rec)
    log.close()
    kind, init = calls[0]
    assert kind == "init" and init["project"] == "proj" and init["name"] == "run1"
    assert init["dir"] == str(tmp_path / "run1") and init["config"] == config_dict(cfg)
    assert init["config"]["learning_rate"] == 3e-4
    assert calls[1] == ("log", (1, {"train/loss": 2.5, "train/lr": 1e-4, "train/tokens_per_s": 100.0}))
    assert calls[3] == ("log", (2, {"eval/loss": 2.2, "eval/tokens": 64.0}))
    assert calls[-1] == ("finish", None) and len(calls) == 5


def test_wandb_that_cannot_start_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb([], fail=True))
    with pytest.raises(ConfigError) as info:
        MetricsLog(tmp_path / "metrics.jsonl", resume_step=None, report_to=("wandb",))
    assert (
        info.value.message
        == "--report-to wandb: could not start it: RuntimeError: api_key not configured (no-tty)"
    )
    assert info.value.fix == "set WANDB_MODE=offline or run `wandb login`"


def test_trackio_gets_every_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []
    mod = types.ModuleType("trackio")
    mod.init = lambda **kw: calls.append(("init", kw))  # type: ignore[attr-defined]
    mod.log = lambda values, step: calls.append(("log", (step, values)))  # type: ignore[attr-defined]
    mod.finish = lambda: calls.append(("finish", None))  # type: ignore[attr-defined]
    mod.__spec__ = types.SimpleNamespace(name="trackio")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "trackio", mod)
    log = MetricsLog(
        tmp_path / "metrics.jsonl", resume_step=None, report_to=("trackio",), run_config={"lr": 1}
    )
    log.write(RECORDS[0])
    log.close()
    assert calls == [
        ("init", {"project": "kernelguard", "name": tmp_path.name, "config": {"lr": 1}}),
        ("log", (1, {"train/loss": 2.5, "train/lr": 1e-4, "train/tokens_per_s": 100.0})),
        ("finish", None),
    ]


def test_older_trackio_without_step_gets_the_step_as_a_metric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logged: list[dict[str, float]] = []
    mod = types.ModuleType("trackio")
    mod.init = lambda **kw: None  # type: ignore[attr-defined]
    mod.log = lambda values: logged.append(values)  # type: ignore[attr-defined]
    mod.finish = lambda: None  # type: ignore[attr-defined]
    mod.__spec__ = types.SimpleNamespace(name="trackio")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "trackio", mod)
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=None, report_to=("trackio",))
    log.write({"step": 7, "loss": 1.0})
    log.close()
    assert logged == [{"train/loss": 1.0, "train/global_step": 7}]


def test_a_tracker_failing_mid_run_is_dropped_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=None, report_to=("wandb",))

    def broken(values: dict[str, float], *, step: int) -> None:
        raise ConnectionError("network down")

    log._trackers["wandb"].run.log = broken
    log.write(RECORDS[0])
    log.write(RECORDS[1])
    log.close()
    err = capsys.readouterr().err
    assert err == "kernelguard train: --report-to wandb stopped: ConnectionError: network down\n"
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_plot_includes_eval_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.axes import Axes

    lines: list[tuple[list[Any], str | None]] = []
    real_plot = Axes.plot

    def spy(self: Axes, *args: Any, **kwargs: Any) -> Any:
        lines.append((list(args[0]), kwargs.get("label")))
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    png = plot_metrics(jsonl, tmp_path / "metrics.png")
    assert png.stat().st_size > 0
    assert ([1, 2, 3], "train loss") in lines and ([2], "eval loss") in lines
