"""providers.installed.probe_package on real (fake) distributions in a tmp site dir, then the pure resolver.

Each test writes a ``*.dist-info`` (METADATA, RECORD, optional direct_url.json) plus the package files into
``site/`` and puts it first on sys.path. Compiled extensions are synthetic ELF files with a hand-made fatbin
(the arch reader parses them); a synthetic ELF cannot be dlopen'ed, so where a test needs the extension's
*import* to behave a certain way, a same-named ``.py`` module in ``shadow/`` (ahead of ``site/`` on sys.path)
stands in for the loaded extension. One test builds a real .so with gcc when a compiler is present.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from check_helpers import INSTALL, cuda_so, fatbin, isolated_provider_modules, make_env, write_distribution

from kernelguard.errors import ConfigError
from kernelguard.resolution import catalog, discovery
from kernelguard.resolution.catalog import PACKAGES
from kernelguard.resolution.providers import installed
from kernelguard.resolution.providers.installed import ExtensionFacts, PackageFacts, probe_package
from kernelguard.resolution.resolver import REJECTED, SELECTED, Facts, Target, resolve

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # ".cpython-311-x86_64-linux-gnu.so"
EXT = f"causal_conv1d_cuda{SUFFIX}"
SYMBOL = "_ZN3c1017RegisterOperatorsD1Ev"
UNDEFINED = f"/x/causal_conv1d_cuda.so: undefined symbol: {SYMBOL}"
CONV_INIT = (
    "import causal_conv1d_cuda  # noqa: F401\n\n\ndef causal_conv1d_fn(*args, **kwargs):\n    return None\n"
)
FORCE_REINSTALL = INSTALL["causal_conv1d"].replace("--no-cache-dir ", "--no-cache-dir --force-reinstall --no-deps ")
CAUSAL_WHEEL_URL = (
    "https://github.com/Dao-AILab/causal-conv1d/releases/download/v1.5.0.post8/"
    "causal_conv1d-1.5.0.post8+cu12torch2.6cxx11abiTRUE-cp311-cp311-linux_x86_64.whl"
)


@dataclass
class Site:
    site: Path
    shadow: Path

    def shadow_module(self, name: str, source: str) -> None:
        (self.shadow / f"{name}.py").write_text(source)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    paths = Site(tmp_path / "site", tmp_path / "shadow")
    paths.site.mkdir()
    paths.shadow.mkdir()
    with isolated_provider_modules():
        monkeypatch.syspath_prepend(str(paths.site))
        monkeypatch.syspath_prepend(str(paths.shadow))  # ahead of site/: stand-ins for extension modules
        yield paths


def probe_fla() -> PackageFacts:
    return probe_package(PACKAGES["fla"], "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")


def probe_conv(**kwargs: bool) -> PackageFacts:
    return probe_package(PACKAGES["causal_conv1d"], "causal_conv1d", "causal_conv1d_fn", **kwargs)


def decide(found: PackageFacts, kernel: str, archs: tuple[str, ...] = ("9.0",)) -> Any:
    """The package candidate's decision for qwen3_5 packed training on an H200 with torch 2.13 + CUDA 12.8."""
    facts = Facts(
        env=make_env(gpus=("9.0",)),
        packages={found.module: found},
        transformers_min_versions={name: discovery.transformers_min_version(name) for name in PACKAGES},
        torch_varlen_attention=True,
    )
    res = resolve(
        facts,
        catalog.requirements(discovery.resolve_model("qwen3_5"), "training", packed=True,
                             transformers_version=discovery.transformers_source().version),
        Target(archs=archs, arch_source="test"),
    )
    verdict = next(v for v in res.verdicts if v.kernel == kernel)
    return next(d for d in verdict.candidates if d.kind == "package")


def write_fla(
    site: Site,
    version: str,
    body: str = "def chunk_gated_delta_rule(*args, **kwargs):\n    return None\n",
    name: str = "flash-linear-attention",
) -> None:
    write_distribution(
        site.site,
        name,
        version,
        {
            "fla/__init__.py": f'__version__ = "{version}"\n',
            "fla/ops/__init__.py": "",
            "fla/ops/gated_delta_rule/__init__.py": body,
        },
    )


def write_conv(
    site: Site,
    version: str = "1.5.0",
    *,
    sass: tuple[int, ...] = (90,),
    direct_url: str | None = None,
    extension_source: str | None = None,
) -> Path:
    write_distribution(
        site.site,
        "causal-conv1d",
        version,
        {"causal_conv1d/__init__.py": CONV_INIT, EXT: cuda_so(sass)},
        direct_url=direct_url,
    )
    if extension_source is not None:
        site.shadow_module("causal_conv1d_cuda", extension_source)
    return (site.site / EXT).resolve()


# ------------------------------------------------------------------------------------------------ fla


def test_fla_too_old_for_transformers(site: Site) -> None:
    write_fla(site, "0.1.0")
    found = probe_fla()
    assert found == PackageFacts(
        import_name="fla",
        distribution="flash-linear-attention",
        version="0.1.0",
        module="fla.ops.gated_delta_rule",
        attribute="chunk_gated_delta_rule",
        import_error=None,
        devices=("cuda", "xpu"),
        devices_source="kernelguard default for this package",
        built_for_torch=None,
        extensions=(),
    )
    decision = decide(found, "chunk_gated_delta_rule")
    assert decision.status == REJECTED
    assert (
        decision.reason
        == "flash-linear-attention 0.1.0 is older than 0.2.2, the minimum transformers requires."
    )
    assert decision.fix == "pip install -U 'flash-linear-attention>=0.2.2'"


def test_fla_core_is_preferred_and_served(site: Site) -> None:
    write_fla(site, "0.6.0", name="fla-core")
    found = probe_fla()
    assert (found.distribution, found.version, found.import_error) == ("fla-core", "0.6.0", None)
    decision = decide(found, "chunk_gated_delta_rule", archs=("8.0",))
    assert decision.status == SELECTED
    assert decision.reason == "fla-core 0.6.0 imports fla.ops.gated_delta_rule.chunk_gated_delta_rule."


def test_fla_without_the_function_transformers_takes(site: Site) -> None:
    write_fla(site, "0.6.0", body="def fused_recurrent_gated_delta_rule(*args, **kwargs):\n    return None\n")
    found = probe_fla()
    error = "AttributeError: module 'fla.ops.gated_delta_rule' has no attribute 'chunk_gated_delta_rule'"
    assert found.import_error == error
    decision = decide(found, "chunk_gated_delta_rule")
    assert decision.status == REJECTED
    assert decision.reason == (
        "importing fla.ops.gated_delta_rule.chunk_gated_delta_rule fails exactly as "
        f"transformers would see it: {error}."
    )


def test_fla_import_failure_and_declared_devices(site: Site) -> None:
    write_fla(site, "0.6.0")
    (site.site / "fla/__init__.py").write_text(
        'raise OSError("libz3.so.4.15: cannot open shared object file")\n'
    )
    found = probe_fla()
    assert (found.version, found.import_error) == (
        "0.6.0",
        "OSError: libz3.so.4.15: cannot open shared object file",
    )
    assert found.devices_source == "kernelguard default for this package"


def test_source_checkout_without_distribution_reads_version_and_devices(site: Site) -> None:
    for relative, text in {
        "fla/__init__.py": '__version__ = "0.6.0"\n__kernelguard_devices__ = ("cpu", "cuda")\n',
        "fla/ops/__init__.py": "",
        "fla/ops/gated_delta_rule/__init__.py": "def chunk_gated_delta_rule():\n    pass\n",
    }.items():
        (site.site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site.site / relative).write_text(text)
    found = probe_fla()
    assert (found.distribution, found.version, found.import_error) == (None, "0.6.0", None)
    assert (found.devices, found.devices_source) == (("cpu", "cuda"), "fla.__kernelguard_devices__")


# ---------------------------------------------------------------------------------------- causal_conv1d


def test_extension_with_undefined_symbol(site: Site) -> None:
    so = write_conv(site, extension_source=f"raise ImportError({UNDEFINED!r})\n")
    found = probe_conv()
    assert found.distribution == "causal-conv1d" and found.version == "1.5.0"
    assert found.import_error == f"ImportError: {UNDEFINED}"
    assert found.built_for_torch is None
    [ext] = found.extensions
    assert (ext.path, ext.module, ext.load_error) == (
        str(so),
        "causal_conv1d_cuda",
        f"ImportError: {UNDEFINED}",
    )
    assert (ext.sass, ext.ptx, ext.arch_error) == (frozenset({"sm_90"}), frozenset(), None)
    decision = decide(found, "causal_conv1d_fn")
    assert decision.status == REJECTED
    assert decision.issues == ("extension-built-for-other-torch",)
    assert decision.reason == (
        f"its compiled extension does not load against the installed torch 2.13.0+cu128 (ImportError: {UNDEFINED}): "
        "built for another torch, found torch 2.13."
    )
    assert decision.fix == FORCE_REINSTALL


@pytest.mark.parametrize(
    "version, direct_url, built_for",
    [
        ("1.5.0.post8", CAUSAL_WHEEL_URL, "2.6"),
        ("1.5.0+cu12torch2.11cxx11abiTRUE", None, "2.11"),
        ("1.5.0", "https://download.pytorch.org/whl/causal_conv1d-1.5.0-cp311-cp311-linux_x86_64.whl", None),
    ],
)
def test_wheel_name_says_which_torch_it_was_built_for(
    site: Site, version: str, direct_url: str | None, built_for: str | None
) -> None:
    write_conv(site, version, direct_url=direct_url, extension_source=f"raise ImportError({UNDEFINED!r})\n")
    found = probe_conv()
    assert found.built_for_torch == built_for
    decision = decide(found, "causal_conv1d_fn")
    built = f"built for torch {built_for}" if built_for else "built for another torch"
    assert decision.reason.endswith(f"): {built}, found torch 2.13.")


def test_extension_loads_but_lacks_the_target_arch(site: Site) -> None:
    so = write_conv(site, sass=(80,), extension_source="LOADED = True\n")
    found = probe_conv()
    assert found.import_error is None
    assert found.extensions == (
        ExtensionFacts(
            path=str(so),
            module="causal_conv1d_cuda",
            load_error=None,
            sass=frozenset({"sm_80"}),
            ptx=frozenset(),
            arch_error=None,
            arch_method=found.extensions[0].arch_method,
        ),
    )
    rejected = decide(found, "causal_conv1d_fn", archs=("9.0",))
    assert rejected.status == REJECTED
    assert rejected.reason == (
        f"{EXT} cannot run on compute capability 9.0: built for sm_80 (SASS) and no PTX; "
        "needs sm_90 SASS or PTX <= compute_90"
    )
    assert rejected.fix == INSTALL["causal_conv1d"]
    served = decide(found, "causal_conv1d_fn", archs=("8.6",))
    assert served.status == SELECTED
    assert served.reason == (
        "causal-conv1d 1.5.0 imports causal_conv1d.causal_conv1d_fn; extensions load and "
        "contain sm_80 SASS and no PTX."
    )


def test_archs_are_read_without_loading_extensions(site: Site) -> None:
    write_conv(site, sass=(80, 86), extension_source=f"raise ImportError({UNDEFINED!r})\n")
    found = probe_conv(load_extensions=False)
    [ext] = found.extensions
    assert ext.load_error is None  # not tried
    assert ext.sass == frozenset({"sm_80", "sm_86"})
    assert found.import_error == f"ImportError: {UNDEFINED}"  # the package import itself still ran


def test_unloadable_synthetic_elf_is_a_load_error_not_a_crash(site: Site) -> None:
    write_distribution(
        site.site,
        "causal-conv1d",
        "1.5.0",
        {
            "causal_conv1d/__init__.py": "def causal_conv1d_fn(*args, **kwargs):\n    return None\n",
            f"causal_conv1d/_C{SUFFIX}": cuda_so((90,)),
        },
    )
    found = probe_conv()
    assert found.import_error is None
    [ext] = found.extensions
    assert ext.module == "causal_conv1d._C"
    assert ext.load_error is not None and ext.load_error.startswith("ImportError: ")
    assert ext.sass == frozenset({"sm_90"})
    decision = decide(found, "causal_conv1d_fn")
    assert decision.status == REJECTED
    assert decision.reason.startswith(
        "importing causal_conv1d.causal_conv1d_fn fails exactly as transformers would see it: ImportError: "
    )


def test_not_installed(site: Site) -> None:
    found = probe_conv()
    assert (found.distribution, found.version) == (None, None)
    assert found.import_error == "ModuleNotFoundError: No module named 'causal_conv1d'"
    decision = decide(found, "causal_conv1d_fn")
    assert decision.reason == "causal-conv1d is not installed (import 'causal_conv1d' failed)."


@pytest.mark.skipif(
    not (shutil.which("cc") and shutil.which("objcopy")), reason="needs a C compiler and objcopy"
)
def test_real_shared_object_with_undefined_libtorch_symbol(site: Site, tmp_path: Path) -> None:
    """A real dlopen failure: the .so needs a c10 symbol that the loaded libtorch does not export."""
    source = tmp_path / "ext.c"
    source.write_text(
        f"extern void {SYMBOL}(void);\nvoid *PyInit_causal_conv1d_cuda(void) {{ {SYMBOL}(); return 0; }}\n"
    )
    fat = tmp_path / "fatbin.bin"
    fat.write_bytes(fatbin((80, 90)))
    built = tmp_path / "built.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(source)], check=True, capture_output=True)
    subprocess.run(
        ["objcopy", "--add-section", f".nv_fatbin={fat}", str(built)], check=True, capture_output=True
    )
    write_distribution(
        site.site, "causal-conv1d", "1.5.0", {"causal_conv1d/__init__.py": CONV_INIT, EXT: built.read_bytes()}
    )
    found = probe_conv()
    assert found.import_error is not None and f"undefined symbol: {SYMBOL}" in found.import_error
    [ext] = found.extensions
    assert ext.load_error is not None and f"undefined symbol: {SYMBOL}" in ext.load_error
    assert ext.sass == frozenset({"sm_80", "sm_90"})
    decision = decide(found, "causal_conv1d_fn")
    assert decision.issues == ("extension-built-for-other-torch",)
    assert decision.fix == FORCE_REINSTALL


# ------------------------------------------------------------------------- extensions that kill the process

SEGFAULT = "import ctypes\nctypes.string_at(0)\n"  # reads address 0: SIGSEGV
ABORT = "import os\nos.abort()\n"  # SIGABRT, as a failed assert in a C++ static initialiser


@pytest.mark.parametrize("mode", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_extension_that_segfaults_on_import_is_reported_not_fatal(
    site: Site, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setenv("KERNELGUARD_IMPORT_PROBE", mode)
    so = write_conv(site, extension_source=SEGFAULT)
    found = probe_conv()  # we are still alive: the import ran in a child process
    assert found.import_error == f"crashes on import (signal 11: SIGSEGV) in {so}"
    [ext] = found.extensions
    assert ext.load_error == "crashes on import (signal 11: SIGSEGV)"
    assert ext.sass == frozenset({"sm_90"})  # the .so is still read for its archs
    assert "causal_conv1d" not in sys.modules  # never imported in-process
    decision = decide(found, "causal_conv1d_fn")
    assert decision.status == REJECTED
    assert f"crashes on import (signal 11: SIGSEGV) in {so}" in decision.reason


def test_package_code_that_aborts_after_its_extension_loaded(site: Site) -> None:
    write_conv(site, extension_source="LOADED = True\n")
    (site.site / "causal_conv1d/__init__.py").write_text(ABORT)
    found = probe_conv()
    assert found.import_error == "crashes on import (signal 6: SIGABRT) while importing causal_conv1d"
    [ext] = found.extensions
    assert ext.load_error is None  # the extension itself loads (in the child, then here)


def test_extensions_after_the_crashing_one_are_not_tried(site: Site) -> None:
    second = f"causal_conv1d_zz{SUFFIX}"
    write_distribution(
        site.site,
        "causal-conv1d",
        "1.5.0",
        {"causal_conv1d/__init__.py": CONV_INIT, EXT: cuda_so((90,)), second: cuda_so((90,))},
    )
    site.shadow_module("causal_conv1d_cuda", SEGFAULT)
    site.shadow_module("causal_conv1d_zz", "LOADED = True\n")
    found = probe_conv()
    errors = {Path(e.path).name: e.load_error for e in found.extensions}
    assert errors == {
        EXT: "crashes on import (signal 11: SIGSEGV)",
        second: f"not tried: importing {EXT} killed the probe first",
    }


def test_extension_that_hangs_is_killed_at_the_timeout(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(installed, "IMPORT_PROBE_TIMEOUT_S", 1.0)
    so = write_conv(site, extension_source="import time\ntime.sleep(600)\n")
    found = probe_conv()
    assert found.import_error == f"hangs on import (no result within 1 s) in {so}"


def test_a_process_with_cuda_initialised_is_not_forked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KERNELGUARD_IMPORT_PROBE", raising=False)
    monkeypatch.setattr(installed, "_cuda_initialized", lambda: False)
    assert installed._probe_mode() == "fork"
    monkeypatch.setattr(installed, "_cuda_initialized", lambda: True)
    assert installed._probe_mode() == "spawn"
    monkeypatch.setenv("KERNELGUARD_IMPORT_PROBE", "fork")  # an explicit choice wins
    assert installed._probe_mode() == "fork"


def test_a_misspelt_probe_mode_is_a_config_error(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELGUARD_IMPORT_PROBE", "forkk")
    write_conv(site, extension_source="LOADED = True\n")
    with pytest.raises(ConfigError) as caught:
        probe_conv()
    assert caught.value.message == "KERNELGUARD_IMPORT_PROBE='forkk' is not a probe mode; expected fork, spawn or off."


def test_probe_off_imports_in_process(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERNELGUARD_IMPORT_PROBE", "off")
    write_conv(site, extension_source=f"raise ImportError({UNDEFINED!r})\n")
    assert probe_conv().import_error == f"ImportError: {UNDEFINED}"


@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler")
def test_real_shared_object_aborting_in_a_static_initialiser(site: Site, tmp_path: Path) -> None:
    """A real .so whose constructor aborts at dlopen, before Python sees a module."""
    source = tmp_path / "ext.c"
    source.write_text(
        "#include <stdlib.h>\n__attribute__((constructor)) static void boom(void) { abort(); }\n"
        "void *PyInit_causal_conv1d_cuda(void) { return 0; }\n"
    )
    built = tmp_path / "built.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(source)], check=True, capture_output=True)
    write_distribution(
        site.site, "causal-conv1d", "1.5.0", {"causal_conv1d/__init__.py": CONV_INIT, EXT: built.read_bytes()}
    )
    found = probe_conv()
    so = (site.site / EXT).resolve()
    assert found.import_error == f"crashes on import (signal 6: SIGABRT) in {so}"


@pytest.mark.slow
def test_check_cli_survives_a_segfaulting_extension(site: Site, tmp_path: Path) -> None:
    """Through the real entry point: the report prints, the exit code says a kernel is missing."""
    so = write_conv(site, extension_source=SEGFAULT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_KERNELS")}
    env.update(
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONPATH=os.pathsep.join([str(site.shadow), str(site.site)]),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kernelguard", "check", "--model", "qwen3_5", "--arch", "9.0", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)  # the whole report printed
    assert {k["kernel"] for k in report["kernels"]} >= {"causal_conv1d_fn", "chunk_gated_delta_rule"}
    conv = next(k for k in report["kernels"] if k["kernel"] == "causal_conv1d_fn")
    package = next(c for c in conv["candidates"] if c["kind"] == "package")
    assert package["status"] == "rejected"
    assert f"crashes on import (signal 11: SIGSEGV) in {so}" in package["reason"]


def test_check_probes_compiled_packages_before_anything_initialises_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # Reading a GPU's capability (the environment probe) or importing fla initialises CUDA; an import probe
    # after that spawns a fresh interpreter that imports torch again (seconds) instead of forking.
    import importlib

    check, env = importlib.import_module("kernelguard.stack.compose"), importlib.import_module("kernelguard.resolution.env")
    events: list[str] = []
    real_probe, real_with_gpus = env.probe, env.with_gpus

    def probe(**kwargs: Any) -> Any:
        events.append(f"probe read_gpus={kwargs.get('read_gpus', True)}")
        return real_probe(**kwargs)

    def with_gpus(found: Any) -> Any:
        events.append("gpus")
        return real_with_gpus(found)

    def package(spec: Any, module: str, attribute: str, **kwargs: Any) -> PackageFacts:
        events.append(f"{module} ({'compiled' if spec.compiled else 'python'})")
        return PackageFacts(import_name=spec.import_name, distribution=None, version=None, module=module,
                            attribute=attribute, import_error="ModuleNotFoundError: not installed",
                            devices=spec.default_devices, devices_source="test")

    monkeypatch.setattr(check, "probe", probe)
    monkeypatch.setattr(check, "with_gpus", with_gpus)
    monkeypatch.setattr(check, "probe_package", package)
    seen: list[Any] = []
    real_resolve = check.resolve
    monkeypatch.setattr(check, "resolve", lambda facts, *args: seen.append(facts) or real_resolve(facts, *args))
    check.run_check(check.CheckOptions(model="qwen3_5", mode="training"))
    assert events == ["probe read_gpus=False", "causal_conv1d (compiled)", "flash_attn (compiled)",
                      "fla.ops.gated_delta_rule (python)", "gpus"]
    assert list(seen[0].packages) == ["causal_conv1d", "fla.ops.gated_delta_rule", "flash_attn"]  # as before
