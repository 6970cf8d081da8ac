"""Builders shared by the `kernelguard check` tests (resolver, installed provider, CLI).

Made-up facts (``make_env``, ``make_pkg``, ``make_ext``), a synthetic CUDA ELF writer (fatbin layout as in
``kernelguard/resolution/providers/fatbin.py``; same bytes as tests/resolution/test_fatbin.py builds), and fake installed
distributions written into a temporary site dir (``*.dist-info`` with METADATA and RECORD).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from kernelguard.resolution import catalog, discovery
from kernelguard.resolution.catalog import ModelSpec
from kernelguard.resolution.env import Environment, Fact, Gpu
from kernelguard.resolution.providers.installed import ExtensionFacts, PackageFacts
from kernelguard.resolution.resolver import Facts, Target

# ------------------------------------------------------------------------------------------- made-up facts

# kernelguard.resolution.install's command for make_env()'s defaults (torch 2.13.0+cu128, cxx11 ABI, Python 3.11.7, x86_64).
_CONV_WHEEL = ("https://github.com/Dao-AILab/causal-conv1d/releases/download/v1.7.0/"
               "causal_conv1d-1.7.0+cu12torch2.13cxx11abiTRUE-cp311-cp311-linux_x86_64.whl")
_CONV_NOTE = (f"  (It first tries the prebuilt wheel {_CONV_WHEEL}, then compiles against the installed torch "
              "2.13.0+cu128 with nvcc from a CUDA 12.x toolkit (CUDA_HOME), which takes several minutes.)")
# The commands alone: what guard, the callback and the trainer print too, followed by the notes for their torch.
COMMANDS = {
    "fla": "pip install 'flash-linear-attention>=0.6.0,<1'",
    "causal_conv1d": "pip install setuptools wheel ninja packaging && pip install --no-build-isolation "
    "--no-cache-dir 'causal-conv1d==1.7.0'",
}
INSTALL = {"fla": COMMANDS["fla"], "causal_conv1d": COMMANDS["causal_conv1d"] + _CONV_NOTE}
UNDEFINED_SYMBOL = "ImportError: /x/causal_conv1d_cuda.so: undefined symbol: _ZN3c1017RegisterOperatorsD1Ev"
EXT_SO = "causal_conv1d_cuda.cpython-311-x86_64-linux-gnu.so"


def make_env(
    *,
    torch: str | None = "2.13.0",
    cuda: str | None = "12.8",
    abi: bool | None = True,
    triton: str | None = "3.7.1",
    gpus: tuple[str, ...] = (),
    torch_error: str | None = None,
    kernels: str | None = "0.18.2",
    packages: Mapping[str, str | None] | None = None,
) -> Environment:
    """A made-up system. ``torch`` is the release; the version string gets the usual local tag."""
    local = f"+cu{cuda.replace('.', '')}" if cuda else "+cpu"
    torch_version = None if torch is None else f"{torch}{local}"
    installed: dict[str, str | None] = {
        "torch": torch_version,
        "triton": triton,
        "kernels": kernels,
        "transformers": "5.23.0",
        **(packages or {}),
    }
    return Environment(
        python=Fact("3.11.7", "made up"),
        platform=Fact("linux", "made up"),
        machine=Fact("x86_64", "made up"),
        glibc=Fact("glibc 2.35", "made up"),
        torch_version=Fact(torch_version, "torch.__version__"),
        torch_error=torch_error,
        cuda_version=Fact(cuda, "torch.version.cuda"),
        hip_version=Fact(None, "torch.version.hip"),
        cxx11_abi=Fact(abi, "torch.compiled_with_cxx11_abi()"),
        gpus=tuple(
            Gpu(i, "NVIDIA H200" if c == "9.0" else f"GPU sm {c}", c, "made up") for i, c in enumerate(gpus)
        ),
        driver=Fact(None, "made up"),
        packages={name: Fact(value, "made up") for name, value in installed.items()},
    )


def make_ext(
    sass: tuple[str, ...] = ("sm_90",),
    ptx: tuple[str, ...] = (),
    *,
    load_error: str | None = None,
    arch_error: str | None = None,
    name: str = EXT_SO,
) -> ExtensionFacts:
    return ExtensionFacts(
        path=f"/site-packages/{name}",
        module=name.split(".", 1)[0],
        load_error=load_error,
        sass=frozenset(sass),
        ptx=frozenset(ptx),
        arch_error=arch_error,
        arch_method="elf-fatbin",
    )


def make_pkg(
    import_name: str,
    version: str | None,
    *,
    module: str | None = None,
    attribute: str = "",
    distribution: str | None = None,
    import_error: str | None = None,
    devices: tuple[str, ...] = ("cuda",),
    built_for_torch: str | None = None,
    extensions: tuple[ExtensionFacts, ...] = (),
) -> PackageFacts:
    defaults = {
        "fla": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule", "fla-core"),
        "causal_conv1d": ("causal_conv1d", "causal_conv1d_fn", "causal-conv1d"),
        "flash_attn": ("flash_attn", "flash_attn_varlen_func", "flash-attn"),
    }[import_name]
    return PackageFacts(
        import_name=import_name,
        distribution=distribution or (defaults[2] if version else None),
        version=version,
        module=module or defaults[0],
        attribute=attribute or defaults[1],
        import_error=import_error,
        devices=devices,
        devices_source="made up",
        built_for_torch=built_for_torch,
        extensions=extensions,
    )


def find(resolution: Any, kernel: str, kind: str | None = None) -> Any:
    """The verdict for ``kernel`` or, with ``kind`` ("package", "hub", "torch", "reference"), its candidate."""
    verdict = next(v for v in resolution.verdicts if v.kernel == kernel)
    if kind is None:
        return verdict
    return next(d for d in verdict.candidates if d.kind == kind)


# ------------------------------------------------------------------------------------ synthetic CUDA ELF

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_CUBIN = 1, 2
_FLAGS_64BIT_LINUX = 0x11


def _fatbin_entry(kind: int, arch: int) -> bytes:
    payload = (b"\x7fELF" if kind == KIND_CUBIN else b".ver") + bytes(20)
    header = struct.pack(
        "<HHIQQHHIIIQ", kind, 0x0101, 64, len(payload), 0, 8, 1, arch, 0, 0, _FLAGS_64BIT_LINUX
    )
    return header.ljust(64, b"\0") + payload


def fatbin(sass: tuple[int, ...] = (), ptx: tuple[int, ...] = ()) -> bytes:
    body = b"".join(_fatbin_entry(KIND_CUBIN, a) for a in sass) + b"".join(
        _fatbin_entry(KIND_PTX, a) for a in ptx
    )
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def elf64(sections: list[tuple[str, bytes]]) -> bytes:
    """Minimal ELF64 little-endian shared object (not loadable: no program headers) with these sections."""
    names = b"\0" + b"".join(name.encode() + b"\0" for name, _ in sections) + b".shstrtab\0"
    body = bytearray()
    headers = [bytes(64)]
    name_offset = 1
    for name, data in [*sections, (".shstrtab", names)]:
        while (64 + len(body)) % 8:
            body.append(0)
        offset = 64 + len(body)
        headers.append(struct.pack("<IIQQQQIIQQ", name_offset, 1, 2, offset, offset, len(data), 0, 0, 8, 0))
        name_offset += len(name) + 1
        body += data
    while len(body) % 8:
        body.append(0)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = struct.pack(
        "<16sHHIQQQIHHHHHH",
        ident,
        3,
        62,
        1,
        0,
        0,
        64 + len(body),
        0,
        64,
        0,
        0,
        64,
        len(headers),
        len(headers) - 1,
    )
    return header + bytes(body) + b"".join(headers)


def cuda_so(sass: tuple[int, ...] = (), ptx: tuple[int, ...] = ()) -> bytes:
    return elf64([(".text", b"\xc3" * 16), (".nv_fatbin", fatbin(sass, ptx))])


# ----------------------------------------------------------------------------- fake installed distributions


def _record_line(relative: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{relative},sha256={digest},{len(data)}"


def write_distribution(
    site: Path,
    name: str,
    version: str,
    files: Mapping[str, str | bytes],
    *,
    direct_url: str | None = None,
) -> Path:
    """Install ``files`` (paths relative to ``site``) as distribution ``name`` the way pip leaves it."""
    site.mkdir(parents=True, exist_ok=True)
    lines = []
    for relative, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        target = site / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        lines.append(_record_line(relative, data))
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    meta = {"METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", "INSTALLER": "pip\n"}
    if direct_url is not None:
        meta["direct_url.json"] = json.dumps({"url": direct_url, "archive_info": {}})
    for file_name, text in meta.items():
        (info / file_name).write_text(text)
        lines.append(_record_line(f"{info.name}/{file_name}", text.encode()))
    lines.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(lines) + "\n")
    return info


PROVIDER_MODULES = ("fla", "causal_conv1d", "causal_conv1d_cuda")


def _ours(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PROVIDER_MODULES)


@contextmanager
def isolated_provider_modules() -> Iterator[None]:
    """Fake providers import fresh inside, and whatever was imported before is back afterwards."""
    saved: dict[str, ModuleType] = {n: m for n, m in sys.modules.items() if _ours(n)}
    for name in saved:
        del sys.modules[name]
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
        importlib.invalidate_caches()


# ------------------------------------------------------------------- `kernelguard check` in a subprocess
ALLOW_ALL = ("--allow", "chunk_gated_delta_rule", "--allow", "causal_conv1d_fn", "--allow", "attention")


def kg(
    *args: str,
    cwd: Path,
    pythonpath: tuple[Path, ...] = (),
    command: tuple[str, ...] | None = None,
) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "KERNELGUARD_PROBE_DRIVER", "LOCAL_KERNELS")
    }
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    # This checkout's kernelguard, not whichever one is installed (an editable install of another worktree).
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in pythonpath), str(Path(__file__).resolve().parents[1])])
    base = command or (sys.executable, "-m", "kernelguard")
    return subprocess.run(
        [*base, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def kg_json(*args: str, cwd: Path, rc: int, **kwargs: Any) -> dict[str, Any]:
    proc = kg("check", "--json", *args, cwd=cwd, **kwargs)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)  # stdout is exactly one JSON document
    return data


# ------------------------------------------------- the resolver's base case (tests/resolution/test_resolver.py)
# An H200 node (sm 9.0), torch 2.13 + CUDA 12.8, fla 0.6.0, causal-conv1d with sm_90 SASS, kernels inside
# transformers' window, qwen3_5 packed training.
CHUNK = "chunk_gated_delta_rule"
WINDOW = ("0.18.2", "0.19.0")
MIN_VERSIONS = {"fla": "0.2.2", "causal_conv1d": None, "mamba_ssm": None, "flash_attn": "2.3.3"}


def qwen(
    mode: str = "training", *, packed: bool | None = None, key_dim: int | None = None
) -> catalog.Requirements:
    spec = discovery.resolve_model("qwen3_5")
    if key_dim is not None:
        spec = ModelSpec(
            spec.family, {"model_type": "qwen3_5_text", "linear_key_head_dim": key_dim}, "config.json"
        )
    return catalog.requirements(
        spec, mode, packed=mode == "training" if packed is None else packed,
        transformers_version=discovery.transformers_source().version,
    )


def hopper_facts(**env: Any) -> Facts:
    return Facts(
        env=make_env(gpus=("9.0",), **env),
        packages={
            "fla.ops.gated_delta_rule": make_pkg("fla", "0.6.0"),
            "causal_conv1d": make_pkg("causal_conv1d", "1.6.0", extensions=(make_ext(("sm_90",)),)),
            "flash_attn": make_pkg(
                "flash_attn", None, import_error="ModuleNotFoundError: No module named 'flash_attn'"
            ),
        },
        kernels_window=WINDOW,
        transformers_min_versions=MIN_VERSIONS,
        torch_varlen_attention=True,
    )


BASE = hopper_facts()
H200 = Target(archs=("9.0",), arch_source="made up")
TRAIN = qwen()
