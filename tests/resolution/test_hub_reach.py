"""Whether the Hub answers, asked once and only where the job's load would ask it (kernelguard.resolution.hub_reach).

kernels asks the Hub whether each repository's publisher is trusted before it loads anything, unless
HF_HUB_OFFLINE is set or LOCAL_KERNELS serves the repository; where the Hub cannot be reached, kernels 0.19 raises
"could not verify publisher trust status. Set trust_remote_code=True", a network failure worded as trust. `check`
predicts it. The Hub is played by a socket on this machine: listening (it answers) or closed (it does not).
"""

from __future__ import annotations

import socket
from pathlib import Path
from collections.abc import Iterator

import pytest

from kernelguard.resolution import unreachable_hub
from kernelguard.stack.compose import CheckOptions, run_check


@pytest.fixture
def listening() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


@pytest.fixture
def closed() -> int:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.close()
    return port


def test_the_probe_tells_an_answering_hub_from_a_closed_port_and_an_unknown_name(listening: int, closed: int) -> None:
    assert unreachable_hub(environ={"HF_ENDPOINT": f"http://127.0.0.1:{listening}"}) is None
    assert unreachable_hub(environ={"HF_ENDPOINT": f"http://127.0.0.1:{closed}"}) == (
        f"127.0.0.1:{closed} does not answer (ConnectionRefusedError: Connection refused)")
    assert unreachable_hub(environ={"HF_ENDPOINT": "https://kernelguard-no-such-host.invalid"}) in (
        "kernelguard-no-such-host.invalid does not resolve",
        "kernelguard-no-such-host.invalid:443 does not answer within 2 s")  # a resolver that hangs


def _load_error(monkeypatch: pytest.MonkeyPatch, port: int, **env: str) -> str | None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    error = run_check(CheckOptions(model="qwen3_5", hub=True, allow=("*",))).resolution.load_error
    return None if error is None else f"{error.reason}\nFix: {error.fix}"


def test_check_predicts_the_load_that_cannot_reach_the_hub_with_the_fixes_that_work(
    monkeypatch: pytest.MonkeyPatch, closed: int
) -> None:
    load = run_check(CheckOptions(model="qwen3_5", hub=False)).facts.hub_load  # type: ignore[union-attr]
    if load is None or not load.kernels_usable:  # the load never asks the Hub: test_..._only_where_kernels_can_load
        pytest.skip(f"kernels {load and load.kernels_version} is not one this transformers loads Hub kernels with")
    said = _load_error(monkeypatch, closed)
    assert said is not None and said.startswith(
        "the load asks the Hub whether each kernel's publisher is trusted before it loads it, and the Hub cannot be "
        f"reached from here (127.0.0.1:{closed} does not answer (ConnectionRefusedError: Connection refused)): "
        "from_pretrained raises `ValueError: Kernel repository ... could not verify publisher trust status`, a "
        "network failure, not a trust problem. The job loads with Hub kernels: --hub")
    assert said.endswith(
        "Fix: HF_HUB_OFFLINE=1 with the kernels in the local cache (downloaded where the Hub is reachable; "
        "`kernelguard check` with HF_HUB_OFFLINE=1 says whether they are there), or USE_HUB_KERNELS=NO "
        "(use_kernels=False) with the pip kernels. trust_remote_code=True only skips the trust request; the load's "
        "next Hub request (the kernel's versions) fails the same way")


def test_the_hub_is_not_asked_offline_or_for_local_kernels_and_an_answering_hub_is_fine(
    monkeypatch: pytest.MonkeyPatch, closed: int, listening: int
) -> None:
    """The controls: the same closed port, with the load not asking it; and a Hub that answers."""
    from kernelguard.resolution import discovery, load_repos_isolated

    # offline, every repository the load fetches served from a folder: nothing to ask, nothing missing. Asked as
    # check asks it (a child process); None: no Kernel Hub mapping without kernels (5.17), nothing is fetched.
    fetched = sorted({r.repo_id for r in load_repos_isolated({"model_type": "qwen3_5"}) or []})
    assert _load_error(monkeypatch, closed, HF_HUB_OFFLINE="1",
                       LOCAL_KERNELS=":".join(f"{r}=/nowhere" for r in fetched)) is None
    repos = {k.hub.repo_id for k in discovery.resolve_model("qwen3_5").family.kernels if k.hub is not None}
    assert _load_error(monkeypatch, closed, LOCAL_KERNELS=":".join(f"{r}=/nowhere" for r in sorted(repos))) is None
    assert _load_error(monkeypatch, listening) is None


def test_the_hub_is_asked_only_where_kernels_can_load(monkeypatch: pytest.MonkeyPatch, closed: int) -> None:
    """Without a kernels transformers accepts, the load never reaches the Hub (it raises for lack of kernels, or
    loads the pip kernels): saying the Hub is unreachable there names the wrong failure. Control: the same load
    with kernels inside the window is asked, and told."""
    from check_helpers import qwen

    from kernelguard.resolution.hub_load import probe_hub_load
    from kernelguard.resolution.resolver import Target
    from kernelguard.stack import compose

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    requirements = qwen()
    target = Target(use_hub=True)
    for kernels, asked in ((None, False), ("0.16.0", False), ("0.18.2", True)):
        load = probe_hub_load(Path("/nowhere"), "5.25.0", ("0.18.2", "0.19.0"), kernels, environ={})
        reach = compose._with_reach(load, requirements, target).unreachable
        assert (reach is not None) is asked, (kernels, reach)
