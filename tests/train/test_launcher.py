"""`kernelguard train --nproc-per-node N`: a rank's kernelguard error reaches the user as one message, printed
once, with the documented exit code (2 usage/config/data, 3 guard refused) — where plain torchrun exits 1."""

from __future__ import annotations

import json
import re
import shlex
import types
from pathlib import Path
from typing import Any

import pytest
import train_helpers as h

from kernelguard.train import launch as launch_mod
from kernelguard.train.__main__ import main
from kernelguard.train.settings.config_cli import LaunchOptions

DATA_ERROR = "row 1, field 'messages': the conversation is empty"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("launch")
    return {
        "root": root,
        "tok": h.write_tokenizer(root / "tok"),
        "model": h.write_model_config(root / "model"),
        "data": h.write_jsonl(root / "data.jsonl", h.copy_task_rows(60)),
        "bad": h.write_jsonl(root / "bad.jsonl", [{"messages": []}]),
    }


def _args(assets: dict[str, Path], out: Path, data: str = "data") -> list[str]:
    return [
        "--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets[data]),
        "--output-dir", str(out), "--max-length", "256", "--param-dtype", "fp32", "--no-progress",
        "--allow", "attention", "--max-steps", "1",
    ]  # fmt: skip


def _assert_clean(stderr: str) -> None:
    for noise in ("Traceback", "ChildFailedError", "exitcode", "OMP_NUM_THREADS"):
        assert noise not in stderr, stderr


@pytest.mark.slow
def test_under_plain_torchrun_its_failure_table_carries_kernelguards_line(assets: dict[str, Path]) -> None:
    """torchrun's own ChildFailedError traceback comes from torchrun's process and cannot be stopped from a
    rank; what a rank can do is fill torchelastic's error file, so the table torchrun prints names the cause
    and its fix instead of "To enable traceback see ...". kernelguard train --nproc-per-node prints none."""
    r = h.run_train(_args(assets, assets["root"] / "plain", "bad"), nproc=2, fault="ranks-meet-at-start")
    assert r.returncode == 1, r.stderr  # torchrun's own exit code for a failed child
    root = r.stderr.split("Root Cause (first observed failure):", 1)[1]
    line = f"kernelguard train: error: {assets['bad']}, {DATA_ERROR}"
    assert f"traceback : {line}" in root and "--skip-bad-rows" in root, r.stderr
    assert "To enable traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_under_plain_torchrun_a_rank_stopped_by_its_agent_names_itself_in_the_table(assets: dict[str, Path]) -> None:
    """Rank 1 fails on the data while rank 0 is still starting (held there by the fault, as a loaded machine
    does by chance); the agent SIGTERMs rank 0, whose own row in torchrun's table then says what stopped it."""
    r = h.run_train(_args(assets, assets["root"] / "stalled", "bad"), nproc=2,
                    fault="ranks-meet-at-start-then-rank-0-stalls")
    assert r.returncode == 1, r.stderr
    table, root = r.stderr.split("Root Cause (first observed failure):", 1)
    assert f"traceback : kernelguard train: error: {assets['bad']}, {DATA_ERROR}" in root, r.stderr
    stopped = "traceback : kernelguard train: stopped by SIGTERM before training started; nothing was saved."
    assert stopped in table.split("Failures:", 1)[1] and "To enable traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_data_error_in_the_ranks_exits_2_printed_once(assets: dict[str, Path]) -> None:
    out = assets["root"] / "bad"
    r = h.run_train([*_args(assets, out, "bad"), "--nproc-per-node", "2"], nproc=0)
    assert r.returncode == 2, r.stderr
    line = f"kernelguard train: error: {assets['bad']}, {DATA_ERROR}"
    assert r.stderr.count(line) == 1 and r.stderr.count("kernelguard train: error:") == 1, r.stderr
    assert r.stderr.rstrip().endswith(
        "Fix: fix or remove that row, or pass --skip-bad-rows to skip malformed rows with a count"
    )
    _assert_clean(r.stderr)
    assert not out.exists()


@pytest.mark.slow
def test_guard_refusal_in_the_ranks_exits_3_with_one_report(assets: dict[str, Path]) -> None:
    out = assets["root"] / "refused"
    r = h.run_train([*_args(assets, out), "--nproc-per-node", "2"], nproc=0, fakes=False)
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("refused to start (exit 3)") == 1, r.stderr
    assert r.stderr.count("SLOW PATHS") == 1 and "chunk_gated_delta_rule" in r.stderr
    _assert_clean(r.stderr)
    assert not out.exists()


@pytest.mark.slow
def test_launched_run_from_a_config_file_trains_and_reports_to_tensorboard(assets: dict[str, Path]) -> None:
    """The success path: --config YAML (CLI wins), two ranks through the launcher, exit 0, events written."""
    pytest.importorskip("tensorboard")
    out = assets["root"] / "ok"
    config = assets["root"] / "run.yaml"
    config.write_text(
        f"model: {assets['model']}\ntokenizer: {assets['tok']}\ndata: {assets['data']}\n"
        f"output_dir: {out}\nmax_length: 256\nparam_dtype: fp32\nprogress: false\nallow: [attention]\n"
        "max_steps: 5\nlearning_rate: 3e-3\nreport_to: tensorboard\nexport: false\nplot: false\n"
    )
    argv = ["--config", str(config), "--max-steps", "2", "--save-every", "0", "--nproc-per-node", "2"]
    r = h.run_train(argv, nproc=0)
    assert r.returncode == 0, r.stderr
    _assert_clean(r.stderr)
    # The launcher warns about a deprecated flag once for the job, not once per rank.
    assert r.stderr.count("--save-every is deprecated") == 1, r.stderr
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == [1, 2]  # --max-steps 2 on the command line beat max_steps: 5 in the file
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert r.stderr.count("guard passed") == 1  # rank 0 speaks for the job
    # ... and prints the provider summary (one line per kernel with its layer count), not just "passed".
    assert r.stderr.count("mode training, packed=True: OK") == 1, r.stderr
    assert re.search(r"fast +chunk_gated_delta_rule +fla .* 3 layers", r.stderr), r.stderr


def test_config_error_exits_2_before_any_rank_starts(
    assets: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[Any] = []
    monkeypatch.setattr(launch_mod, "launch", lambda *a: started.append(a))
    args = [*_args(assets, assets["root"] / "x"), "--nproc-per-node", "2", "--max-length", "0"]
    assert main(args) == 2 and not started
    # the fix: this command with the flag's every value (256 from the helper, then 0) replaced by the one to use
    at = [i for i, a in enumerate(args) if a == "--max-length"]
    fixed = [a for i, a in enumerate(args) if i not in at and i - 1 not in at]
    assert capsys.readouterr().err == (
        "kernelguard train: error: max_length is 0; it must be a positive integer.\n"
        f"Fix: kernelguard train {shlex.join(fixed)} --max-length 8192\n"
    )


def test_launcher_flags_inside_torchrun_are_refused(
    assets: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv(launch_mod.LAUNCH_DIR_ENV, raising=False)
    assert main([*_args(assets, assets["root"] / "y"), "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "kernelguard train: error: --nproc-per-node was given inside a process that torchrun"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--nproc-per-node", "0"],
            "--nproc-per-node is '0'; expected a positive integer or one of auto, cpu, gpu",
        ),
        (["--nproc-per-node", "many"], "--nproc-per-node is 'many'; expected a positive integer"),
        (
            ["--nproc-per-node", "2", "--nnodes", "4:2"],
            "--nnodes is '4:2'; expected a positive integer N or MIN:MAX",
        ),
        (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2"], "--node-rank is 2; expected 0 to 1"),
        (["--nproc-per-node", "2", "--master-port", "0"], "--master-port is 0; expected 1 to 65535."),
    ],
)
def test_bad_launcher_values_are_usage_errors(tmp_path: Path, flags: list[str], message: str) -> None:
    from kernelguard.errors import ConfigError
    from kernelguard.train.settings.config_cli import parse_command

    with pytest.raises(ConfigError) as info:
        parse_command(["--model", "m", "--data", "d", "--output-dir", str(tmp_path), *flags])
    assert info.value.message.startswith(message), info.value.message


def test_torchrun_argv() -> None:
    assert launch_mod.torchrun_argv(LaunchOptions(nproc_per_node="2"), ["--model", "m"]) == [
        "--nproc-per-node", "2", "--nnodes", "1", "--node-rank", "0", "--standalone",
        "-m", "kernelguard.train", "--model", "m",
    ]  # fmt: skip
    multi = LaunchOptions(
        nproc_per_node="8", nnodes="2", node_rank=1, rdzv_backend="c10d", rdzv_endpoint="h:29400"
    )
    argv = launch_mod.torchrun_argv(multi, [])
    assert "--standalone" not in argv and argv[argv.index("--rdzv-endpoint") + 1] == "h:29400"


def _failure(rank: int, exitcode: int, **others: int) -> Any:
    """A ChildFailedError's shape: ``failures`` by rank (``others``: rank_N=exitcode), the first one."""
    failure = types.SimpleNamespace(exitcode=exitcode, timestamp=1)
    failures = {rank: failure} | {
        int(k.split("_")[1]): types.SimpleNamespace(exitcode=v, timestamp=2) for k, v in others.items()
    }
    return types.SimpleNamespace(get_first_failure=lambda: (rank, failure), failures=failures)


def test_a_rank_killed_by_a_signal_is_named_not_the_peers_it_took_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """kill -9 of rank 1: rank 0's collective loses its peer (a crash record with its traceback) and the agent
    SIGTERMs what is left; the one message names rank 1's SIGKILL."""
    monkeypatch.setenv(launch_mod.LAUNCH_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    launch_mod.write_rank_error(
        1, "kernelguard train: rank 0 failed: RuntimeError: reset", "Traceback...", crash=True
    )
    assert launch_mod._report_failure(_failure(0, 1, rank_1=-9, rank_2=-15), tmp_path) == 137
    assert capsys.readouterr().err == "kernelguard train: rank 1 was killed by SIGKILL.\n"


def test_lowest_failing_rank_record_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(launch_mod.LAUNCH_DIR_ENV, str(tmp_path))
    for rank, code in ((1, 3), (0, 2)):
        monkeypatch.setenv("RANK", str(rank))
        assert launch_mod.write_rank_error(code, f"message of rank {rank}", report=None)
    assert json.loads((tmp_path / "rank-1.json").read_text())["exit_code"] == 3
    assert launch_mod._report_failure(_failure(1, 3), tmp_path) == 2
    assert capsys.readouterr().err == "message of rank 0\n"
    monkeypatch.delenv(launch_mod.LAUNCH_DIR_ENV)
    assert not launch_mod.write_rank_error(2, "x")  # outside a launched rank the caller prints


@pytest.mark.parametrize(
    ("exitcode", "expected_rc", "message"),
    [
        (1, 1, "kernelguard train: rank 1 failed with exit code 1; its output is above.\n"),
        (-9, 137, "kernelguard train: rank 1 was killed by SIGKILL.\n"),
    ],
)
def test_other_rank_failures_keep_their_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], exitcode: int, expected_rc: int, message: str
) -> None:
    assert launch_mod._report_failure(_failure(1, exitcode), tmp_path) == expected_rc
    assert capsys.readouterr().err == message


@pytest.mark.parametrize(("rank_said", "shown"), [
    # a rank that saved and said how to resume: its line is the news
    ("kernelguard train: stopped by SIGTERM at step 3; resume: kernelguard train ... --resume", "at step 3"),
    # a rank that only lost its peer to the same SIGTERM: the launcher's own line instead
    ("kernelguard train: rank 0 failed: RuntimeError: Connection reset by peer", "stopped by SIGTERM"),
])
def test_a_signal_during_the_launch_reports_the_signal_not_a_lost_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], rank_said: str, shown: str
) -> None:
    """SIGTERM reaches the launcher and its ranks at once; a rank still meeting its peers then fails with a
    lost connection, and its record used to be printed in place of "stopped by SIGTERM"."""
    import os
    import signal

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def run(args: Any) -> None:  # torchrun, as it ends when the launcher gets SIGTERM mid-start
        crash = "Connection reset" in rank_said
        launch_mod.write_rank_error(1 if crash else 143, rank_said, crash=crash)
        raise SignalException("got signal 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(torchrun, "run", run)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    opts = LaunchOptions(nproc_per_node="2")
    code = launch_mod.launch(opts, ["--max-steps", "1"], output=tmp_path / "out")
    err = capsys.readouterr().err
    assert code == 143 and shown in err, err
    assert "Connection reset" not in err, err
    assert os.environ.get(launch_mod.LAUNCH_DIR_ENV) is None  # the launcher's environment is restored


def test_the_failing_ranks_record_wins_over_the_ranks_the_agent_then_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Which rank fails first depends on the machine's load: when rank 1 refuses first, the agent SIGTERMs rank
    0, whose "stopped by SIGTERM" record (exit 143) has the lower rank but is only the consequence."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    refused = "kernelguard train: refused to start (exit 3)."

    def run(args: Any) -> None:  # torchrun, after rank 1 refused and the agent stopped rank 0
        launch_mod.write_rank_error(143, "kernelguard train: stopped by SIGTERM before training started; nothing "
                                    "was saved.")
        monkeypatch.setenv("RANK", "1")
        launch_mod.write_rank_error(3, refused, "SLOW PATHS: the table")
        monkeypatch.setenv("RANK", "0")
        failures = {0: ProcessFailure(0, 101, 143, "<N/A>"), 1: ProcessFailure(1, 102, 3, "<N/A>")}
        raise ChildFailedError("kernelguard.train", failures)

    monkeypatch.setattr(torchrun, "run", run)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("RANK", "0")
    code = launch_mod.launch(LaunchOptions(nproc_per_node="2"), ["--max-steps", "1"], output=tmp_path / "out")
    err = capsys.readouterr().err
    assert code == 3 and err.splitlines() == ["SLOW PATHS: the table", refused], err


def test_a_peers_sigterm_record_does_not_hide_the_rank_killed_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """kill -9 of rank 1 on a loaded machine: the agent's SIGTERM reached rank 0 first, which saved and wrote its
    "stopped by SIGTERM" record (exit 143) while rank 1 wrote nothing. The job is rank 1's SIGKILL (137)."""
    monkeypatch.setenv(launch_mod.LAUNCH_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    launch_mod.write_rank_error(143, "kernelguard train: stopped by SIGTERM after step 3 of 8; ...", report=None)
    assert launch_mod._report_failure(_failure(0, 143, rank_1=-9), tmp_path) == 137
    assert capsys.readouterr().err == "kernelguard train: rank 1 was killed by SIGKILL.\n"
    # a scheduler's SIGTERM to the whole job is not a kill of one rank: the saved rank's line stays the news
    assert launch_mod._report_failure(_failure(0, 143, rank_1=-15), tmp_path) == 143
    assert "stopped by SIGTERM after step 3" in capsys.readouterr().err
