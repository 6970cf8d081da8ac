"""`kernelguard train --nnodes 2`: a rank that fails on one node is named — node, rank, host and the real
cause — by the launcher of every node, not the connection errors it left on the others
(kernelguard.train.failures)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import train_helpers as h

from kernelguard.train import failures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(args: list[str], node: int, port: int, *, fakes: bool) -> subprocess.Popen[str]:
    env = dict(os.environ)
    paths = [str(h.REPO)] + ([str(h.FAKE_PROVIDERS)] if fakes else [])
    env.update(
        PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
        TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="",
    )
    launcher = ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(node),
                "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "kernelguard.train", *args, *launcher],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(h.REPO),
    )


@pytest.mark.slow
def test_a_guard_refusal_on_node_1_is_named_by_both_launchers(tmp_path: Path) -> None:
    """Node 1 lacks the fast kernels (no fla/causal-conv1d on its path), a real multi-node fault: its rank
    refuses to start (exit 3) while rank 0 on node 0, past its own guard, loses its peer in the next
    collective. Both launchers print the refusal once, name node 1 / rank 1, and exit 3."""
    assets = h.write_train_assets(tmp_path, rows=40)
    out = tmp_path / "shared-out"
    args = ["--model", str(assets["model"]), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
            "--output-dir", str(out), "--max-length", "256", "--param-dtype", "fp32", "--no-progress",
            "--allow", "attention", "--max-steps", "1"]  # fmt: skip
    port = _free_port()
    nodes = [_node(args, 0, port, fakes=True), _node(args, 1, port, fakes=False)]
    results = [p.communicate(timeout=150) for p in nodes]
    host = socket.gethostname()
    for node, (proc, (_, err)) in enumerate(zip(nodes, results)):
        assert proc.returncode == 3, f"node {node}:\n{err}"
        assert err.count("kernelguard train: refused to start (exit 3).") == 1, f"node {node}:\n{err}"
        assert f"happened first on node 1 (host {host}), rank 1 (pid " in err, f"node {node}:\n{err}"
        assert "Traceback" not in err and "ChildFailedError" not in err, f"node {node}:\n{err}"
    assert "rank 0 on node 0 then lost a peer" in results[0][1], results[0][1]
    records = sorted((out / failures.ERRORS_DIR).iterdir())
    assert [p.name for p in records if not p.name.endswith(".json")] == []  # no half-written record
    by_name = {p.name: json.loads(p.read_text()) for p in records}
    assert by_name["node-1-rank-1.json"]["exit_code"] == 3 and by_name["node-1-rank-1.json"]["type"] == "GuardRefused"
    assert not (out / "checkpoints").exists() and not (out / "final").exists() and not (out / "final.tmp").exists()


def _record(rank: int, node: int, t: float, **fields: Any) -> dict[str, Any]:
    return {"rank": rank, "node": node, "host": f"h{node}", "pid": 100 + rank, "time": t, "exit_code": 1,
            "crash": True, "message": f"rank {rank} failed", "report": None, **fields}  # fmt: skip


@pytest.mark.parametrize(
    ("type_", "error"),
    [
        ("RuntimeError", "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1"),
        ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1933, remote process exited or there was a network error"),
        ("RuntimeError", "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)"),
        ("ConnectionResetError", "[Errno 104] Connection reset by peer"),
        ("RuntimeError", "rank 0 failed: ValueError('x')"),
    ],
)  # fmt: skip
def test_lost_peers_are_classified_as_consequences(type_: str, error: str) -> None:
    assert failures.is_secondary(_record(0, 0, 1.0, type=type_, error=error))
    assert not failures.is_secondary(_record(0, 0, 1.0, type=type_, error=error, crash=False))  # kernelguard's


def test_the_earliest_root_cause_wins_over_earlier_lost_peers() -> None:
    lost = _record(0, 0, 5.0, type="RuntimeError", error="Connection reset by peer")
    cause = _record(3, 1, 7.0, type="ValueError", error="bad value", frame="train.py:3 in f")
    later = _record(2, 1, 9.0, type="KeyError", error="'x'")
    assert failures.first_cause([lost, later, cause]) is cause
    line = failures.where_line(cause, [lost, later, cause])
    assert line.startswith("kernelguard train: this failure happened first on node 1 (host h1), rank 3 (pid 103)")
    assert "in train.py:3 in f; rank 0 on node 0 then lost a peer (RuntimeError: Connection reset" in line
    shared = [_record(r, r // 2, 1.0 + r / 100, crash=False, message="refused") for r in (3, 1, 2)]
    assert failures.first_cause(shared)["rank"] == 1  # one refusal every rank raised: its lowest rank
    assert failures.first_cause([lost]) is None


def test_records_are_written_atomically_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failures.SHARED_ERRORS_ENV, str(tmp_path / "errs"))
    monkeypatch.setenv("GROUP_RANK", "1")
    try:
        raise ValueError("bad shard")
    except ValueError as e:
        path = failures.write_record({"rank": 5, "exit_code": 1, "message": "m", "crash": True}, e)
    assert path is not None and path.name == "node-1-rank-5.json"
    assert [p.name for p in (tmp_path / "errs").iterdir()] == ["node-1-rank-5.json"]
    (tmp_path / "errs" / ".node-0-rank-0.json.9.tmp").write_text("{")  # a writer still at work
    [rec] = failures.read_records(tmp_path / "errs")
    assert (rec["node"], rec["type"], rec["error"]) == (1, "ValueError", "bad shard")
    assert rec["frame"].endswith("in test_records_are_written_atomically_and_read_back")
    cause, _ = failures.wait_for_cause(tmp_path / "errs", since=time.time() - 60)
    assert cause is not None and cause["rank"] == 5
    failures.clear()
    assert not (tmp_path / "errs").exists()


def test_a_launcher_that_hears_from_no_other_node_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernelguard.train import launch
    lost = _record(0, 0, 5.0, type="RuntimeError", error="Connection closed by peer")
    launch._say_unshared(tmp_path, [lost], local={0})
    err = capsys.readouterr().err
    assert f"no rank of another node left an error record in {tmp_path}" in err
    assert "where --output-dir is not shared by the nodes, none can arrive" in err
    other = _record(1, 1, 6.0, type="RuntimeError", error="Connection reset by peer")
    launch._say_unshared(tmp_path, [lost, other], local={0})  # the other node's ranks only lost peers too
    assert capsys.readouterr().err == ""
