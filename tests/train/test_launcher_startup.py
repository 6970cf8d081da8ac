"""`kernelguard train` start-up: Ctrl-C and SIGTERM before the ranks exist end in one line and their exit code
(real processes, real signals); everything preflight can check — the environment, the paths, a multi-node
launch without a rendezvous endpoint — is one usage error before any rank starts or anything is written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import train_helpers as h

from kernelguard.train.__main__ import main


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return h.write_train_assets(tmp_path_factory.mktemp("startup"), rows=40)


def _argv(assets: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--output-dir", str(out), "--max-steps", "2", "--max-length", "128", "--allow", "attention",
            "--no-progress", *extra]


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "whom", "code", "line"), [
    (signal.SIGINT, "group", 130, "kernelguard train: interrupted before training started; nothing was written."),
    (signal.SIGTERM, "launcher", 143,
     "kernelguard train: stopped by SIGTERM before training started; nothing was saved."),
], ids=["ctrl-c-to-the-terminal-group", "sigterm-to-the-launcher"])
def test_a_signal_while_the_launcher_starts_is_one_line_and_its_exit_code(
    assets: dict[str, Path], tmp_path: Path, sig: int, whom: str, code: int, line: str
) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join([str(h.REPO), str(h.FAKE_PROVIDERS)]))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "kernelguard", "train", "--nproc-per-node", "2",
                             *_argv(assets, out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,  # a terminal's foreground job: SIGINT not ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    time.sleep(1.0)  # the launcher is still importing torch: no rank exists yet
    if whom == "group":
        os.killpg(proc.pid, sig)  # what Ctrl-C does: the whole foreground process group
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.strip().splitlines() == [line], err
    assert not out.exists()


@pytest.mark.slow
def test_ctrl_c_while_the_launcher_imports_torch_stops_it(assets: dict[str, Path], tmp_path: Path) -> None:
    """Ctrl-C as the launcher starts importing torch stops it before any rank starts, with its one line. (Torch's
    own numpy import, where Ctrl-C used to be lost, no longer happens in the launcher: the tokenizer check imports
    numpy first. tests/train/test_silent_successes.py covers that window in a single-process run, check and export.)"""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               KERNELGUARD_FAULT="ctrl-c-in-launcher-torch-import",
               PYTHONPATH=os.pathsep.join([str(h.REPO / "tests" / "fault_hooks"), str(h.REPO), str(h.FAKE_PROVIDERS)]))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kernelguard", "train", "--nproc-per-node", "2",
                           *_argv(assets, out)], env=env, capture_output=True, text=True, timeout=300, check=False,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (
        130, ["kernelguard train: interrupted before training started; nothing was written."]), proc.stderr
    assert not out.exists()


@pytest.mark.slow
def test_ctrl_c_while_a_rank_imports_kernelguard_is_one_line(assets: dict[str, Path], tmp_path: Path) -> None:
    """A rank that Ctrl-C reaches before its own handler exists (still importing kernelguard) printed a
    KeyboardInterrupt traceback under the launcher's line. The launcher starts its ranks with SIGINT held, and
    each rank takes it once its handler is in place (kernelguard.errors.interrupts)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               KERNELGUARD_FAULT="ctrl-c-as-a-rank-imports-kernelguard",
               PYTHONPATH=os.pathsep.join([str(h.REPO / "tests" / "fault_hooks"), str(h.REPO), str(h.FAKE_PROVIDERS)]))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kernelguard", "train", "--nproc-per-node", "2",
                           *_argv(assets, out)], env=env, capture_output=True, text=True, timeout=300, check=False,
                          start_new_session=True,  # the hook signals the whole group: not pytest's
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "interrupted" in proc.stderr, proc.stderr


@pytest.mark.parametrize(("command", "sig", "code", "line"), [
    (["check", "--model", "qwen3_5"], "SIGINT", 130, "kernelguard: interrupted."),
    (["export", "no-such-run"], "SIGINT", 130, "kernelguard export: interrupted; nothing was written."),
    (["train"], "SIGINT", 130, "kernelguard train: interrupted before training started; nothing was written."),
    (["train"], "SIGTERM", 143, "kernelguard train: stopped by SIGTERM before training started; nothing was saved."),
], ids=["check-ctrl-c", "export-ctrl-c", "train-ctrl-c", "train-sigterm"])
def test_a_signal_while_the_command_line_imports_is_one_line(
    assets: dict[str, Path], tmp_path: Path, command: list[str], sig: str, code: int, line: str
) -> None:
    """The `kernelguard` program installs its start-up handlers before the command line's modules import
    (kernelguard.cli.entry): a signal there was a KeyboardInterrupt traceback (SIGTERM: a death without a word)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRANSFORMERS_VERBOSITY="error",
               KERNELGUARD_FAULT=f"signal-as-the-cli-imports:{sig}",
               PYTHONPATH=os.pathsep.join([str(h.REPO / "tests" / "fault_hooks"), str(h.REPO), str(h.FAKE_PROVIDERS)]))
    if command == ["train"]:
        command = ["train", *_argv(assets, tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-m", "kernelguard", *command], env=env, capture_output=True, text=True,
                          timeout=300, check=False, cwd=tmp_path,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (code, [line]), proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_ctrl_c_while_torch_imports_numpy_stops_a_one_process_run(assets: dict[str, Path], tmp_path: Path) -> None:
    """torch clears whatever its own import of numpy raises, a KeyboardInterrupt included: the run went on to
    train when Ctrl-C landed there. Its inputs are checked before torch is imported, so this is the first import."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               KERNELGUARD_FAULT="ctrl-c-in-torch-numpy-import",
               PYTHONPATH=os.pathsep.join([str(h.REPO / "tests" / "fault_hooks"), str(h.REPO), str(h.FAKE_PROVIDERS)]))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kernelguard", "train", *_argv(assets, out)], env=env,
                          capture_output=True, text=True, timeout=300, check=False,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (proc.returncode, proc.stderr.strip().splitlines()) == (
        130, ["kernelguard train: interrupted before training started; nothing was written."]), proc.stderr
    assert not out.exists()


def test_a_bad_numeric_environment_variable_is_one_usage_error_before_anything(
    assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELGUARD_ERROR_WAIT_S", "ten")
    monkeypatch.setenv("KERNELGUARD_IMPORT_PROBE", "forks")
    assert main([*_argv(assets, tmp_path / "out"), "--nproc-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kernelguard train: error: environment variable(s) kernelguard reads hold values it "
                          "cannot use (set each as expected below, or unset it: its default is fine):\n  "
                          "KERNELGUARD_ERROR_WAIT_S='ten': expected a number of seconds >= 0")
    assert "KERNELGUARD_IMPORT_PROBE='forks': expected fork, spawn or off" in err
    assert err.endswith("Fix: unset KERNELGUARD_ERROR_WAIT_S KERNELGUARD_IMPORT_PROBE\n")  # a command, nothing after
    assert not (tmp_path / "out").exists()


def test_a_profile_trace_under_a_plain_file_is_refused_before_any_rank_starts(
    assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "plain").write_text("x")
    trace = tmp_path / "plain" / "traces"
    assert main([*_argv(assets, tmp_path / "out"), "--nproc-per-node", "2", "--profile-trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert (f"kernelguard train: error: --profile-trace {trace}: {tmp_path / 'plain'} is a file, not a folder; "
            "--profile-trace names a folder.") in err and "Fix:" not in err
    assert not (tmp_path / "out").exists()


def test_nnodes_without_a_rendezvous_endpoint_is_a_usage_error(
    assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_argv(assets, tmp_path / "out"), "--nproc-per-node", "1", "--nnodes", "2"]) == 2
    err = capsys.readouterr().err
    assert "kernelguard train: error: --nnodes 2 needs to know where the nodes meet: no --rdzv-endpoint" in err
    assert "add --rdzv-endpoint HOST:PORT" in err and not (tmp_path / "out").exists()


def test_tens_of_thousands_of_layers_are_refused_before_they_are_built(
    assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = h.write_model_config(tmp_path / "deep", num_hidden_layers=50_000,
                                  layer_types=["linear_attention"] * 49_999 + ["full_attention"])
    assert main(["--dry-run", "--model", str(config), "--tokenizer", str(assets["tok"]), "--data",
                 str(assets["data"]), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "num_hidden_layers is 50,000; kernelguard train builds at most 1,024" in err


def test_a_family_whose_layers_cannot_keep_packed_examples_apart_is_refused_by_name(
    assets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Kimi-Linear's layer hands chunk_kda the batch's keywords as they are (cu_seq_lens_q, not cu_seqlens): a
    packed row would leak state. Refused before anything is built or written, with the one flag that trains it."""
    from transformers import AutoConfig

    if "kimi_linear" not in __import__("kernelguard.resolution", fromlist=["discovery"]).discovery.families():
        pytest.skip("this transformers has no kimi_linear")
    folder = tmp_path / "kimi"
    folder.mkdir()
    AutoConfig.for_model("kimi_linear").to_json_file(str(folder / "config.json"))
    argv = _argv(assets, tmp_path / "out")
    argv[argv.index(str(assets["model"]))] = str(folder)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (f"kernelguard train: error: --model {folder}: kernelguard train packs examples into one row, and "
            "kimi_linear cannot be packed: transformers' layer does not pass `cu_seqlens` to `chunk_kda`, so its "
            "state runs on from one packed example into the next.") in err
    assert "Fix: kernelguard train" in err and "--packing none" in err.split("Fix:")[1]
    assert not (tmp_path / "out").exists()
