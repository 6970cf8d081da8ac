"""pytest plugin: a test during which a torch reference fallback was entered fails.

Enable for a run with ``pytest --kernelguard`` or the ini option ``kernelguard = true``; enable for one test
with ``@pytest.mark.kernelguard``; opt one test out with ``@pytest.mark.kernelguard(False)``.
Accepted fallbacks: ini ``kernelguard_allow`` (one item per line), ``--kernelguard-allow ITEM`` (repeatable),
and ``@pytest.mark.kernelguard(allow=[...])`` (added to the run-wide list); items as in :mod:`kernelguard.guard`.

Tripwires are armed in setup (on every loaded transformers modeling module) and removed in teardown. A test
that swallowed the :class:`~kernelguard.errors.KernelFallbackError` still fails: events are recorded and checked
after the call and after teardown. Loaded in every pytest run via the ``pytest11`` entry point, so nothing heavy
(torch, transformers) is imported unless the plugin is enabled.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import pytest

_MARKER = "kernelguard"


@dataclass(frozen=True, slots=True)
class Settings:
    enabled: bool
    allow: tuple[str, ...]


@dataclass(slots=True)
class _TestState:
    tripwires: Any
    allow: tuple[str, ...]
    seen: int  # events recorded before this test
    reported: int  # events already turned into a failure


settings_key = pytest.StashKey[Settings]()
_state_key = pytest.StashKey[_TestState]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kernelguard", "fail tests that run slow torch reference kernels")
    group.addoption("--kernelguard", action="store_true", default=None,
                    help="fail any test during which a kernel fell back to a torch reference path")
    group.addoption("--kernelguard-allow", action="append", default=[], metavar="ITEM",
                    help="accept this fallback (kernel name, 'attention', known-issue id); repeatable")
    parser.addini("kernelguard", type="bool", default=False,
                  help="enable kernelguard for every test (same as --kernelguard)")
    parser.addini("kernelguard_allow", type="linelist", default=[],
                  help="fallbacks kernelguard accepts (kernel name, 'attention', known-issue id)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kernelguard(enabled=True, *, allow=()): fail the test if a torch reference kernel fallback is entered; "
        "kernelguard(False) opts out",
    )
    flag = config.getoption("kernelguard", default=None)
    enabled = bool(flag) if flag is not None else bool(config.getini("kernelguard"))
    allow = tuple(config.getini("kernelguard_allow")) + tuple(config.getoption("kernelguard_allow", default=[]))
    config.stash[settings_key] = Settings(enabled=enabled, allow=allow)


def _item_settings(item: pytest.Item) -> tuple[bool, tuple[str, ...]]:
    base = item.config.stash.get(settings_key, Settings(False, ()))
    marker = item.get_closest_marker(_MARKER)
    if marker is None:
        return base.enabled, base.allow
    enabled = bool(marker.args[0]) if marker.args else bool(marker.kwargs.get("enabled", True))
    extra = marker.kwargs.get("allow", ())
    extra = (extra,) if isinstance(extra, str) else tuple(extra)
    return enabled, base.allow + extra


@pytest.hookimpl(tryfirst=True)  # before fixtures are set up: a fallback in a fixture counts too
def pytest_runtest_setup(item: pytest.Item) -> None:
    enabled, allow = _item_settings(item)
    if not enabled or importlib.util.find_spec("transformers") is None:
        return  # without transformers there is no reference path to fall back to
    from kernelguard.guard import arm_tripwires, fallback_events

    seen = len(fallback_events())
    item.stash[_state_key] = _TestState(arm_tripwires(allow=allow), allow, seen, seen)


def _new_failures(item: pytest.Item) -> list[Any]:
    state = item.stash.get(_state_key, None)
    if state is None:
        return []
    from kernelguard.guard import fallback_events

    events = fallback_events()[state.reported :]
    state.reported += len(events)
    return [e for e in events if not e.allowed]


def _failure(events: list[Any], when: str) -> Exception:
    from kernelguard.errors import KernelFallbackError

    first = events[0]
    title = (
        f"kernelguard: {len(events)} torch reference fallback(s) entered during {when} "
        "(failing even if the test caught the exception):"
    )
    lines = [title]
    for e in events:
        lines.append(f"  {e.layer}: {e.kernel} ({e.site}): {e.reason}")
    return KernelFallbackError("\n".join(lines), fix=first.fix, layer=first.layer, kernel=first.kernel,
                               reason=first.reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    __tracebackhide__ = True  # the failure is the message, not this hook's frame
    if _state_key not in item.stash:
        return (yield)
    try:
        result = yield
    except BaseException as exc:
        failures = _new_failures(item)
        from kernelguard.errors import KernelFallbackError

        if failures and not isinstance(exc, KernelFallbackError):
            raise _failure(failures, "setup or the test call") from exc
        raise
    failures = _new_failures(item)
    if failures:
        raise _failure(failures, "setup or the test call")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    __tracebackhide__ = True
    state = item.stash.get(_state_key, None)
    try:
        result = yield
    finally:
        if state is not None:
            state.tripwires.disarm()
            del item.stash[_state_key]
    if state is not None:
        from kernelguard.guard import fallback_events

        events = fallback_events()[state.reported :]
        failures = [e for e in events if not e.allowed]
        if failures:
            raise _failure(failures, "setup/teardown")
    return result


def pytest_report_header(config: pytest.Config) -> list[str]:
    s = config.stash.get(settings_key, Settings(False, ()))
    if not s.enabled:
        return []
    lines = [f"kernelguard: enabled (allow: {', '.join(s.allow) or 'nothing'})"]
    lines.extend(_provider_lines())
    return lines


def _provider_lines() -> list[str]:
    """Import-time choices of already-loaded transformers modules; else which fast providers are importable.

    Reads sys.modules and import specs only: nothing is imported here.
    """
    if "transformers" in sys.modules:
        from kernelguard import transformers_compat as compat

        choices: dict[str, str] = {}
        for site in compat.loaded_sites():
            c = site.closure
            choices.setdefault(c.kernel, "torch reference" if c.is_torch_reference
                               else f"{c.implementation.__module__} (package)")
        if choices:
            return [f"kernelguard providers: {k} -> {v}" for k, v in sorted(choices.items())]
    lines = []
    for package in ("fla", "causal_conv1d", "flash_attn", "kernels"):
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):
            found = False
        lines.append(f"kernelguard providers: {package}: {'importable' if found else 'not installed'}")
    return lines
