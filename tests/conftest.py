"""Shared fixtures. Each block is owned by one area; add new fixtures in a labelled block of your own."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

# Every test sees a terminal width only where it sets one (monkeypatch.setenv("COLUMNS", ...)): pytest-xdist's
# workers export COLUMNS=80, which a serial run does not have, and kernelguard fits its messages to it.
os.environ.pop("COLUMNS", None)
# No test asks the Hugging Face Hub anything: `check` with Hub kernels on asks whether the Hub answers, which
# offline it does not; a test about that asking unsets HF_HUB_OFFLINE itself (tests/resolution/test_hub_reach.py).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))  # so tests can `import tiny_models`


# ---------------------------------------------------------------------------------------------------------
# Fake fast-kernel providers (owner: runtime guard). tests/fake_providers/{fla,causal_conv1d}.
# ---------------------------------------------------------------------------------------------------------
FAKE_PROVIDERS_DIR = TESTS_DIR / "fake_providers"
FAKE_MAMBA_DIR = TESTS_DIR / "fake_providers_mamba"
_PURGED_PREFIXES = ("fla", "causal_conv1d", "mamba_ssm", "transformers.models.")


def _is_purged(name: str) -> bool:
    return any(name == p or name.startswith(p if p.endswith(".") else p + ".") for p in _PURGED_PREFIXES)


def _reset_auto_mappings() -> None:
    """transformers' Auto* classes keep the modeling modules they resolved (``_LazyAutoMapping._modules``); a
    class already handed out (``from transformers import AutoModelForCausalLM``) would keep returning models
    built with the old kernel choice. Emptying the caches makes them import the current modules again."""
    mappings = []
    auto = sys.modules.get("transformers.models.auto.modeling_auto")
    mappings += list(vars(auto).values()) if auto is not None else []
    # An Auto class cached on the top-level package may come from an earlier (purged) modeling_auto.
    top = sys.modules.get("transformers")
    cached = list(vars(top).values()) if top is not None else []  # a copy: lookups may import and add names
    mappings += [v.__dict__.get("_model_mapping") for v in cached if isinstance(v, type)]
    for value in mappings:
        if type(value).__name__ != "_LazyAutoMapping":  # never getattr on lazy objects: it may import
            continue
        cache = getattr(value, "_modules", None)
        if isinstance(cache, dict):
            cache.clear()


def _purge_modules() -> dict[str, ModuleType]:
    """Drop fla*/causal_conv1d*/transformers.models.* so the next import re-runs transformers'
    import-time kernel choice (its decorator tries `import fla...` exactly once, at module import)."""
    _reset_auto_mappings()
    # A copy: another thread (a tokenizer or tracker worker) may import while we look.
    removed = {name: mod for name, mod in list(sys.modules.items()) if _is_purged(name)}
    for name in removed:
        sys.modules.pop(name, None)
    return removed


def _restore_modules(saved: dict[str, ModuleType]) -> None:
    _purge_modules()
    sys.modules.update(saved)
    _reset_auto_mappings()
    # `from pkg import sub` reads the parent's attribute first: point parents back at the saved children.
    for name, mod in saved.items():
        parent_name, _, child = name.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is not None:
            try:
                setattr(parent, child, mod)
            except (AttributeError, TypeError):
                pass


@pytest.fixture
def fresh_transformers_models() -> Iterator[None]:
    """transformers modeling modules are re-imported fresh inside the test (no fakes) and restored after."""
    saved = _purge_modules()
    try:
        yield
    finally:
        _restore_modules(saved)


@pytest.fixture
def disarmed_after() -> Iterator[None]:
    """Disarm every guard the test armed: the registry is process-wide, and a guard left armed would judge the
    next test's model."""
    yield
    from kernelguard.runtime.registry import REGISTRY

    REGISTRY.reset()


@pytest.fixture
def fake_providers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Put the fake `fla` / `causal_conv1d` first on sys.path and make transformers choose again.

    Import model classes *inside* the test (e.g. `tiny_models.tiny_model`), never at test-module import:
    a class imported before this fixture ran carries the choice made without the fakes.
    """
    saved = _purge_modules()
    monkeypatch.syspath_prepend(str(FAKE_PROVIDERS_DIR))
    # transformers 5.25+: the stand-ins add "cpu" to transformers' own device table when imported; put it back
    hub_kernels = sys.modules.get("transformers.integrations.hub_kernels")
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    saved_devices = dict(devices) if isinstance(devices, dict) else None
    try:
        yield FAKE_PROVIDERS_DIR
    finally:
        _restore_modules(saved)
        if saved_devices is not None and isinstance(devices, dict):
            devices.clear()
            devices.update(saved_devices)


@pytest.fixture
def fake_mamba(fake_providers: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake providers and the Mamba stand-in (``mamba_ssm``: Mamba-2 and Mamba-1 kernels): kept apart from ``fake_providers`` so the
    tests of a machine without mamba-ssm keep that machine. Import model classes inside the test."""
    monkeypatch.syspath_prepend(str(FAKE_MAMBA_DIR))
    return FAKE_MAMBA_DIR


@pytest.fixture
def tiny() -> object:
    """`tests/tiny_models.py` as a fixture: `tiny.tiny_model("qwen3_5")`, `tiny.tiny_config(...)`."""
    import tiny_models

    return tiny_models


# --------------------------------------------------------------------------- end of runtime-guard block ---


@pytest.fixture
def cpu_varlen() -> Iterator[None]:
    """torch's varlen_attn is CUDA-only: run kernelguard_varlen on the exact per-segment SDPA reference."""
    from kernelguard.runtime import attention

    saved = attention.varlen_impl()
    attention.set_varlen_impl(attention.reference_varlen_attn)
    try:
        yield
    finally:
        attention.set_varlen_impl(saved)


@pytest.fixture
def gloo_one_rank() -> Iterator[None]:
    """A one-rank gloo process group in this process (FSDP2 and collectives on CPU), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
