"""transformers 5.25 loads Kernel Hub kernels by default: what `kernelguard check` decides from that.

Run under transformers 5.24 (the main venv) and 5.25 (.ci/run's 5.25 pass): the pure tests pin both releases'
facts; the CLI tests assert what the *installed* transformers does. kernels 0.19.x (5.25's window) is not on
the package index here, and its source is not in the public snapshots this was built from (newest there:
0.17.0.dev0), so "in window" is made-up facts, and at the CLI a stand-in: a ``kernels-0.19.1.dist-info`` record
first on the path over the installed kernels 0.17.2 code (the version is what transformers compares with its
window; whether the Hub lookups read 0.19's internals is tests/resolution/test_hub_provider.py's business).
"""

from __future__ import annotations

from dataclasses import replace
from importlib import metadata
from pathlib import Path

import pytest
from check_helpers import ALLOW_ALL, BASE, CHUNK, H200, TRAIN, find, kg, kg_json, make_env
from packaging.version import Version

from kernelguard.resolution import discovery
from kernelguard.resolution.decisions import REJECTED, SKIPPED
from kernelguard.resolution.facts import HubLoad
from kernelguard.resolution.hub_load import probe_hub_load, resolve_use_hub
from kernelguard.resolution.install import install_command
from kernelguard.resolution.resolver import resolve

REPO = Path(__file__).resolve().parents[2]  # this checkout, not an installed kernelguard
TRANSFORMERS = metadata.version("transformers")
HUB_DEFAULT = Version(TRANSFORMERS) >= Version("5.25.0")
MODELING_525 = '''
        use_kernels = kwargs.pop("use_kernels", None)
        if not _kernels_enabled():  # Default is enabled
            use_kernels = False
        elif use_kernels is None:
            use_kernels = True
'''
MODELING_524 = '        use_kernels = kwargs.pop("use_kernels", False)\n'
WINDOW_525 = ("0.19.1", "0.20.0")
KERNELS_FIX = ("pip install 'kernels>=0.19.1,<0.20.0'; or export USE_HUB_KERNELS=NO (transformers then loads "
               "without Hub kernels, as from_pretrained(..., use_kernels=False) does; kernelguard check --no-hub "
               "gives the pip packages' commands)")
DEFAULT_SOURCE = ("transformers 5.25.0's default: from_pretrained(use_kernels=None) means use_kernels=True unless "
                  "USE_HUB_KERNELS is false")


def load_525(kernels: str | None, env: str | None = None) -> HubLoad:
    return HubLoad("5.25.0", True, env, WINDOW_525, kernels, kernels_core=True)


@pytest.mark.parametrize(("text", "default_on"), [(MODELING_525, True), (MODELING_524, False), ("", False)])
def test_the_default_is_read_from_from_pretrained(tmp_path: Path, text: str, default_on: bool) -> None:
    (tmp_path / "modeling_utils.py").write_text(text)
    load = probe_hub_load(tmp_path, "5.x", WINDOW_525, "0.17.2", environ={"USE_HUB_KERNELS": "no"})
    assert (load.default_on, load.env_value, load.env_off) == (default_on, "no", True)


def test_the_installed_transformers_default() -> None:
    source = discovery.transformers_source()
    load = probe_hub_load(source.root, source.version, discovery.kernels_version_window(source), None, environ={})
    assert load.default_on is HUB_DEFAULT
    assert load.kernels_core is HUB_DEFAULT  # 5.25 requires kernels itself; 5.24 only in an extra


@pytest.mark.parametrize(
    ("asked", "env", "default_on", "expected"),
    [
        (None, None, True, (True, DEFAULT_SOURCE)),
        (None, "NO", True, (False, "USE_HUB_KERNELS=NO: transformers 5.25.0 loads without them")),
        (True, "0", True, (False, "USE_HUB_KERNELS=0: transformers 5.25.0 loads without them")),
        (False, None, True, (False, "--no-hub: the job loads with use_kernels=False")),
        (True, None, True, (True, "--hub: the job loads with use_kernels=True")),
        (None, None, False, (False, "transformers 5.25.0 loads with use_kernels=False by default")),
        (None, "YES", True, (True, DEFAULT_SOURCE)),
    ],
)
def test_resolve_use_hub(asked: bool | None, env: str | None, default_on: bool, expected: tuple[bool, str]) -> None:
    assert resolve_use_hub(asked, replace(load_525("0.17.2", env), default_on=default_on)) == expected


def _resolve_525(kernels: str | None, use_hub: bool = True):  # type: ignore[no-untyped-def]
    facts = replace(BASE, env=make_env(gpus=("9.0",), kernels=kernels), kernels_window=WINDOW_525,
                    hub_load=load_525(kernels))
    source = DEFAULT_SOURCE if use_hub else "USE_HUB_KERNELS=NO: transformers 5.25.0 loads without them"
    return resolve(facts, TRAIN, replace(H200, use_hub=use_hub, hub_source=source))


@pytest.mark.parametrize(
    ("kernels", "found"),
    [(None, "kernels is not installed"), ("0.17.2", "kernels 0.17.2 is installed"),
     ("0.20.0", "kernels 0.20.0 is installed")],
)
def test_525_without_a_usable_kernels_the_load_itself_fails(kernels: str | None, found: str) -> None:
    res = _resolve_525(kernels)
    assert res.load_error is not None and res.load_error.status == REJECTED
    assert res.load_error.reason == (
        f"{found}, so the model load raises before any kernel runs: from_pretrained(use_kernels=True) raises "
        "`ValueError: Kernels are not available. Please install a compatible version (0.19.1 <= version < "
        f"0.20.0)`. The job loads with Hub kernels: {DEFAULT_SOURCE}."
    )
    assert res.load_error.fix == KERNELS_FIX  # keeps the user's transformers: no "go back to 5.17"
    assert all(v.ok for v in res.verdicts)  # the pip packages would serve every kernel...
    assert not res.ok  # ...but the load raises first
    assert not any("silently" in note for note in res.notes)


def test_525_in_window_kernels_loads_and_the_hub_comes_first() -> None:
    res = _resolve_525("0.19.1")
    assert res.load_error is None
    hub = find(res, CHUNK, "hub")
    assert hub.status == REJECTED and hub.reason == "the Hub repository was not probed."  # past the window
    assert res.notes[0] == (f"Kernel Hub kernels are the first provider of every kernel: {DEFAULT_SOURCE}; "
                            "USE_HUB_KERNELS=NO or use_kernels=False loads without them (check that with --no-hub)")


def test_525_with_the_hub_switched_off_the_pip_packages_serve() -> None:
    res = _resolve_525("0.17.2", use_hub=False)
    assert res.load_error is None and res.ok
    assert find(res, CHUNK, "hub").status == SKIPPED
    assert find(res, CHUNK, "hub").reason.startswith(
        "not requested (USE_HUB_KERNELS=NO: transformers 5.25.0 loads without them): ")


def test_kernels_fix_when_transformers_requires_kernels_itself() -> None:
    advice = install_command("kernels", torch_version=None, cuda_version=None, kernels_window=WINDOW_525,
                             kernels_core=True)
    assert advice.fix_line() == KERNELS_FIX
    assert advice.commands == ("pip install 'kernels>=0.19.1,<0.20.0'", "export USE_HUB_KERNELS=NO")


def test_the_kernels_version_row_fixes_keep_the_users_transformers_first() -> None:
    from kernelguard.resolution.known_issues import by_id

    row = by_id("kernels-version")
    assert row is not None and row.fix.startswith("pip install 'kernels>=MIN,<MAX'")
    assert "USE_HUB_KERNELS=NO" in row.fix and "raises ValueError: Kernels are not available" in row.effect
    assert "transformers 5.17" not in row.fix  # every window holds a release: no older transformers to fall back to


def test_525_community_layers_are_read_as_hub_repos() -> None:
    text = '''
        add_kernels_community_layers(
            "fla",
            version=3,
            entries=[
                ("chunk_gated_delta_rule", "chunk_gated_delta_rule", ("cuda",), (Mode.TRAINING,)),
                ("RMSNormGated", "FusedRMSNormGated", ("cuda", "rocm", "xpu"), (Mode.TRAINING, Mode.INFERENCE)),
            ],
        )
        add_kernels_community_layers(
            "mamba-ssm",
            version=5,
            entries=[
                (name, name, ("cuda", "rocm", "xpu"), (Mode.TRAINING, Mode.INFERENCE))
                for name in (
                    "causal_conv1d_fn",
                    "causal_conv1d_update",
                )
            ],
        )
'''
    repos = discovery._community_layers(text)
    assert {k: (r.repo_id, r.layer_name, r.version) for k, r in repos.items()} == {
        "chunk_gated_delta_rule": ("kernels-community/fla", "chunk_gated_delta_rule", 3),
        "RMSNormGated": ("kernels-community/fla", "FusedRMSNormGated", 3),
        "causal_conv1d_fn": ("kernels-community/mamba-ssm", "causal_conv1d_fn", 5),
        "causal_conv1d_update": ("kernels-community/mamba-ssm", "causal_conv1d_update", 5),
    }


# ------------------------------------------------------------------ the CLI, under the installed transformers
def _kernels_stand_in(tmp_path: Path, version: str) -> Path:
    """A folder whose kernels metadata says ``version``: first on PYTHONPATH, it is the kernels kernelguard
    and transformers read the version of (the code imported stays the installed one)."""
    site = tmp_path / f"site-{version}"
    (info := site / f"kernels-{version}.dist-info").mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {version}\n")
    return site


# Older than every window transformers has had: "installed, but outside the window".
OUT_OF_WINDOW = "0.15.2"


def _kg_env(tmp_path: Path, *args: str, env: str | None = None, rc: int = 0,
            site: Path | None = None) -> dict:  # type: ignore[type-arg]
    import os

    saved = os.environ.get("USE_HUB_KERNELS")
    try:
        os.environ.pop("USE_HUB_KERNELS", None)
        if env is not None:
            os.environ["USE_HUB_KERNELS"] = env
        path = (site, REPO) if site is not None else (REPO,)
        return kg_json(*ALLOW_ALL, "--no-packed", *args, cwd=tmp_path, rc=rc, pythonpath=path)
    finally:
        os.environ.pop("USE_HUB_KERNELS", None)
        if saved is not None:
            os.environ["USE_HUB_KERNELS"] = saved


def test_cli_default_follows_the_installed_transformers(tmp_path: Path) -> None:
    kernels = OUT_OF_WINDOW
    window = discovery.kernels_version_window()
    assert window is not None and not (Version(window[0]) <= Version(kernels) < Version(window[1]))
    data = _kg_env(tmp_path, rc=1 if HUB_DEFAULT else 0, site=_kernels_stand_in(tmp_path, kernels))
    assert data["environment"]["packages"]["kernels"]["value"] == kernels
    if HUB_DEFAULT:
        assert data["load_error"]["provider"] == "from_pretrained(use_kernels=True)"
        assert data["load_error"]["fix"] == f"pip install 'kernels>={window[0]},<{window[1]}'"
        assert data["load_error"]["reason"].startswith(f"kernels {kernels} is installed, so the model load raises")
    else:
        assert data["load_error"] is None
        hub = next(c for k in data["kernels"] for c in k["candidates"] if c["kind"] == "hub")
        assert hub["reason"].startswith(
            f"not requested (transformers {TRANSFORMERS} loads with use_kernels=False by default): ")


def test_cli_in_window_kernels_stand_in_loads_and_lists_the_hub_first(tmp_path: Path) -> None:
    window = discovery.kernels_version_window()
    assert window is not None
    site = _kernels_stand_in(tmp_path, window[0])
    # 5.25+ loads Hub kernels by default, and offline (the suite's default) with an empty cache that load raises
    data = kg_json(*ALLOW_ALL, "--no-packed", cwd=tmp_path, rc=1 if HUB_DEFAULT else 0, pythonpath=(site, REPO))
    assert data["environment"]["packages"]["kernels"]["value"] == window[0]
    load = data["load_error"]
    assert (load is None) is not HUB_DEFAULT
    assert load is None or ("HF_HUB_OFFLINE=1 allows only the local cache" in load["reason"]
                            and "outside" not in load["reason"])
    chunk = next(k for k in data["kernels"] if k["kernel"] == "chunk_gated_delta_rule")
    first = chunk["candidates"][0]
    assert first["kind"] == "hub" and first["provider"].startswith("hub kernels-community/fla")
    assert (first["status"] == "rejected") is HUB_DEFAULT  # looked up (offline: no build here) only when on
    assert "outside" not in first["reason"]  # in the window


@pytest.mark.parametrize(("args", "env"), [(("--no-hub",), None), ((), "NO")])
def test_cli_hub_off_never_fails_on_the_load(tmp_path: Path, args: tuple[str, ...], env: str | None) -> None:
    data = _kg_env(tmp_path, *args, env=env)
    assert data["ok"] is True and data["load_error"] is None


def test_cli_text_names_the_load_and_its_fix(tmp_path: Path) -> None:
    site = _kernels_stand_in(tmp_path, OUT_OF_WINDOW)
    proc = kg("check", "--hub", "--no-packed", *ALLOW_ALL, cwd=tmp_path, pythonpath=(site, REPO))
    assert "Traceback" not in proc.stderr and "silently disabled" not in proc.stdout
    if HUB_DEFAULT:  # the load fails whatever is allowed, and the fix keeps transformers 5.25
        assert proc.returncode == 1 and "transformers==5.17" not in proc.stdout
        assert " ".join(proc.stdout.split()).endswith(
            "verdict: FAIL - the model load raises before any kernel runs (see model load above) (exit 1)")
        assert "model load                         FAIL  from_pretrained(use_kernels=True) raises" in proc.stdout
    else:  # 5.24: an explicit use_kernels=True raises the same ValueError; said in the kernels-version note
        assert proc.returncode == 0
        assert "from_pretrained(use_kernels=True) raises ValueError: Kernels are not available" in \
            " ".join(proc.stdout.split())
