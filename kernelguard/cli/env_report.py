"""``kernelguard env``: the facts a GDN bug report needs, as one block to paste (``--json`` for machines).

``transformers env`` prints none of them: which Triton, which kernels window, which fla backend, which archs the
causal-conv1d build carries, which variables steer fla and Triton, and what serves each kernel. Everything here
comes from one ``kernelguard check`` (its probes and its resolution); nothing is decided here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from kernelguard.stack import CheckOptions, CheckResult, run_check

__all__ = ["VARIABLE_PREFIXES", "collect", "from_result", "render_env"]

VARIABLE_PREFIXES = ("FLA_", "TRITON_", "KERNELGUARD_")
# Distributions a GDN bug report names even when no kernel of this model resolves to them.
_EXTRAS = ("tilelang", "z3-solver", "flash-attn", "mamba-ssm")


def collect(*, model: str = "qwen3_5", archs: tuple[str, ...] = ()) -> dict[str, Any]:
    result = run_check(CheckOptions(model=model, mode="training", archs=archs))
    variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith(VARIABLE_PREFIXES)}
    return from_result(result, variables=variables)


def _kernelguard_version() -> str:
    from kernelguard.stack import kernelguard_version as version

    return version()


def from_result(result: CheckResult, *, variables: Mapping[str, str], kernelguard: str | None = None) -> dict[str, Any]:
    """The report's facts from a check ``result`` and the environment ``variables`` (pure: tests pass made-up ones)."""
    from kernelguard.resolution import kernels_version_window, transformers_source
    from kernelguard.stack import fla_backends

    env = result.env
    facts = result.facts
    window = facts.kernels_window if facts is not None else None
    if window is None and facts is None:
        try:
            window = kernels_version_window(transformers_source())
        except Exception:  # noqa: BLE001 - no transformers: the report says so below
            window = None
    conv = next((p for p in (facts.packages.values() if facts else ()) if p.import_name == "causal_conv1d"), None)
    return {
        "kernelguard": kernelguard or _kernelguard_version(),
        "python": env.python.value,
        "platform": f"{env.platform.value} {env.machine.value}, {env.glibc.value}",
        "torch": {"version": env.torch_version.value, "cuda": env.cuda_version.value, "hip": env.hip_version.value,
                  "cxx11_abi": env.cxx11_abi.value, "error": env.torch_error},
        "driver": env.driver.value,
        "gpus": [f"{g.index}: {g.name} (sm {g.capability})" for g in env.gpus],
        "triton": env.triton_version,
        "transformers": {"version": env.version_of("transformers") or result.resolution.requirements.transformers_version,
                         "kernels_window": list(window) if window else None,
                         "import_error": env.transformers_error},
        "kernels": env.version_of("kernels"),
        "fla": {"fla-core": env.version_of("fla-core"), "flash-linear-attention": env.version_of("flash-linear-attention"),
                "flash-qla": env.version_of("flash-qla"),  # fla hands it the whole GDN op when importable
                "backend": {arch: b.to_dict() for arch, b in fla_backends(result).items()}},
        "causal-conv1d": {
            "version": env.version_of("causal-conv1d"),
            "extensions": [{"file": e.path.rsplit("/", 1)[-1], "sass": _by_arch(e.sass), "ptx": _by_arch(e.ptx),
                            "load_error": e.load_error} for e in (conv.extensions if conv else ())],
        },
        "others": {name: env.version_of(name) for name in _EXTRAS},
        "variables": dict(variables),
        "target": [str(a) for a in result.resolution.target.archs],
        "providers": {v.kernel: (v.selected.provider if v.selected else None) for v in result.resolution.verdicts},
        # known-bad rows that matched a candidate (rejected, or allowed and serving): the first thing to look for
        "known_issues": sorted({i for v in result.resolution.verdicts for d in v.candidates for i in d.issues}),
        "model": f"{result.resolution.requirements.family.name}, {result.resolution.requirements.mode}"
                 + (", packed" if result.resolution.requirements.packed else ""),
    }


def _by_arch(targets: Iterable[str]) -> list[str]:
    """sm_80 before sm_100: by the number, as a reader expects."""
    return sorted(targets, key=lambda t: (int("".join(c for c in t if c.isdigit()) or 0), t))


def _or(value: object, missing: str = "not installed") -> str:
    return missing if value in (None, "") else str(value)


def render_env(report: Mapping[str, Any]) -> str:
    torch = report["torch"]
    cuda = f"CUDA {torch['cuda']}" if torch["cuda"] else (f"ROCm {torch['hip']}" if torch["hip"] else "no CUDA")
    abi = {True: "cxx11 ABI", False: "pre-cxx11 ABI"}.get(torch["cxx11_abi"], "ABI unknown")
    torch_line = f"{_or(torch['version'])} ({cuda}, {abi})" + (f" - import fails: {torch['error']}" if torch["error"] else "")
    window = report["transformers"]["kernels_window"]
    fla = report["fla"]
    backends = "; ".join(f"{'sm ' + arch if arch else 'no target arch'}: {b['label']}" for arch, b in fla["backend"].items())
    conv = report["causal-conv1d"]
    conv_archs = "; ".join(
        f"{e['file']}: {', '.join(e['sass'] + e['ptx']) or 'no GPU code read'}"
        + (f" (load fails: {e['load_error']})" if e["load_error"] else "") for e in conv["extensions"])
    lines = [
        "```text",
        f"kernelguard {report['kernelguard']} env",
        f"- Python: {report['python']} ({report['platform']})",
        f"- torch: {torch_line}",
        f"- GPU: {', '.join(report['gpus']) or 'none visible'}" + (f"; driver {report['driver']}" if report["driver"] else ""),
        f"- Triton: {_or(report['triton'])}",
        f"- transformers: {_or(report['transformers']['version'])}"
        + (f" (uses kernels in [{window[0]}, {window[1]}))" if window else "")
        + (f"; import fails: {report['transformers']['import_error']}"
           if report["transformers"].get("import_error") else ""),
        f"- kernels: {_or(report['kernels'])}",
        f"- fla: fla-core {_or(fla['fla-core'])}, flash-linear-attention {_or(fla['flash-linear-attention'])}"
        + (f", flash-qla {fla['flash-qla']}" if fla.get("flash-qla") else "")
        + (f"; GDN backend {backends}" if backends else ""),
        f"- causal-conv1d: {_or(conv['version'])}" + (f" ({conv_archs})" if conv_archs else ""),
        "- also: " + ", ".join(f"{name} {_or(v)}" for name, v in report["others"].items()),
        "- variables: " + (", ".join(f"{k}={v}" for k, v in report["variables"].items()) or "no FLA_* / TRITON_* / KERNELGUARD_*"),
        *([f"- known issues matched: {', '.join(report['known_issues'])} (kernelguard issues explains each)"]
          if report.get("known_issues") else []),
        f"- providers ({report['model']}; target {', '.join('sm ' + a for a in report['target']) or 'unknown'}):",
        *(f"    {kernel}: {provider or 'nothing (the torch reference would run)'}"
          for kernel, provider in report["providers"].items()),
        "```",
    ]
    return "\n".join(lines)
