"""pytest plugin: a test during which a torch reference fallback was entered fails.

Enable for a run with ``pytest --kernelguard`` or the ini option ``kernelguard = true``; enable for one test
with ``@pytest.mark.kernelguard``; opt one test out with ``@pytest.mark.kernelguard(False)``.
A test that skips itself after a fallback fails (the slow path ran); ``@pytest.mark.kernelguard(skip_ok=True)``
(or the ini option ``kernelguard_skip_ok = true``, for every test) lets such a test skip.
Accepted fallbacks: ini ``kernelguard_allow`` (one item per line), ``--kernelguard-allow ITEM`` (repeatable),
and ``@pytest.mark.kernelguard(allow=[...])`` (added to the run-wide list); items as in
:class:`kernelguard.resolution.policy.AllowPolicy` (kernel name, known-issue ID, ``attention``, ``*``). An unknown item is
a usage error listing the valid ones.

A transformers model called with a packed row whose GDN kernels get no example boundaries raises
:class:`kernelguard.errors.PackedWithoutBoundariesError` in the test (allow item ``packed-without-boundaries``).

Tripwires are armed in setup (on every loaded transformers modeling module, scanned once per process) and
removed in teardown. They record instead of raising, so a test runs on and then fails with ONE message naming
every kernel that fell back, each call site once with its count, and the fix in pytest's terms. A test that
caught the error, passed, or skipped itself after a fallback still fails (by contract: the slow path ran),
unless skip_ok lets a skip stand.
Loaded in every pytest run via the ``pytest11`` entry point, so nothing heavy (torch, transformers) is
imported unless the plugin is enabled.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kernelguard.errors import KernelFallbackError

__all__ = [
    "SKIP_OK_INI",
    "SKIP_OK_MARKER",
    "Settings",
    "fix_in_pytest_terms",
    "pytest_addoption",
    "pytest_configure",
    "pytest_report_header",
    "pytest_runtest_call",
    "pytest_runtest_makereport",
    "pytest_runtest_setup",
    "pytest_runtest_teardown",
    "settings_key",
]

_MARKER = "kernelguard"
SKIP_OK_MARKER = "@pytest.mark.kernelguard(skip_ok=True)"
SKIP_OK_INI = "kernelguard_skip_ok = true"
_MAX_SITES_SHOWN = 6  # per kernel; the rest is summed on one line


@dataclass(frozen=True, slots=True)
class Settings:
    enabled: bool
    policy: Any  # kernelguard.resolution.policy.AllowPolicy (imported lazily: the plugin loads in every pytest run)
    transformers: bool  # transformers is importable: without it there is no reference path to fall back to
    skip_ok: bool = False  # ini kernelguard_skip_ok: a test that skips after a fallback is reported skipped
    probe: bool = False  # --kernelguard-probe / ini kernelguard_probe: the first-row probe on each model
    # Parsed @pytest.mark.kernelguard(allow=...) lists: per session, so no process-wide cache outlives it.
    marker_policies: dict[tuple[str, ...], Any] = field(default_factory=dict, compare=False)

    @property
    def allow(self) -> tuple[str, ...]:
        return tuple(self.policy.values())


@dataclass(slots=True)
class _TestState:
    tripwires: Any
    boundaries: Any  # kernelguard.runtime.boundaries.ModelCallWatch, or None before transformers is imported
    reported: int  # index of the first registry event not yet turned into a failure
    skip_ok: bool = False  # a skip after a fallback stands (the marker's or the ini's skip_ok)
    failures: list[Any] = field(default_factory=list)  # events that failed the call phase


settings_key = pytest.StashKey[Settings]()
_state_key = pytest.StashKey[_TestState]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kernelguard", "fail tests that run slow torch reference kernels")
    group.addoption("--kernelguard", action="store_true", default=None,
                    help="fail any test during which a kernel fell back to a torch reference path")
    group.addoption("--kernelguard-allow", action="append", default=[], metavar="ITEM",
                    help="accept this fallback (kernel name, known-issue ID, 'attention', '*'); repeatable")
    group.addoption("--kernelguard-probe", action="store_true", default=None,
                    help="also run each model's first packed row example by example (kernelguard's first-row "
                         "probe): one extra no-grad forward of the row and of up to three examples per model")
    parser.addini("kernelguard", type="bool", default=False,
                  help="enable kernelguard for every test (same as --kernelguard)")
    parser.addini("kernelguard_allow", type="linelist", default=[],
                  help="fallbacks kernelguard accepts, one per line (kernel name, known-issue ID, 'attention')")
    parser.addini("kernelguard_probe", type="bool", default=False,
                  help="run the first-row probe on each model's first packed row (same as --kernelguard-probe)")
    parser.addini("kernelguard_skip_ok", type="bool", default=False,
                  help="a test that skips itself after a fallback is reported skipped instead of failed")


def _parse(values: Any, source: str) -> Any:
    from kernelguard.errors import ConfigError
    from kernelguard.resolution import AllowPolicy

    try:
        return AllowPolicy.parse(tuple(values), source=source)
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "kernelguard(enabled=True, *, allow=(), skip_ok=False): fail the test if a torch reference kernel "
        "fallback is entered; kernelguard(False) opts out; skip_ok=True lets a skip after a fallback stand",
    )
    flag = config.getoption("kernelguard", default=None)
    enabled = bool(flag) if flag is not None else bool(config.getini("kernelguard"))
    policy = _parse(config.getini("kernelguard_allow"), "ini option kernelguard_allow").merge(
        _parse(config.getoption("kernelguard_allow", default=[]), "--kernelguard-allow"))
    probe = config.getoption("kernelguard_probe", default=None)
    config.stash[settings_key] = Settings(enabled, policy, importlib.util.find_spec("transformers") is not None,
                                          bool(config.getini("kernelguard_skip_ok")),
                                          probe=bool(probe) if probe is not None else bool(config.getini("kernelguard_probe")))


def _marker_policy(settings: Settings, values: tuple[str, ...]) -> Any:
    policy = settings.marker_policies.get(values)
    if policy is None:
        from kernelguard.errors import ConfigError
        from kernelguard.resolution import AllowPolicy

        try:
            policy = AllowPolicy.parse(values, source="@pytest.mark.kernelguard(allow=...)")
        except ConfigError as e:  # the test's marker is wrong, not kernelguard: no traceback through our source
            wrong = str(e)
        else:
            settings.marker_policies[values] = policy
            return policy
        pytest.fail(f"usage error: {wrong}", pytrace=False)
    return policy


_MARKER_KEYWORDS = frozenset({"enabled", "allow", "skip_ok"})


def _item_settings(item: pytest.Item) -> tuple[bool, Any, bool]:
    base = item.config.stash[settings_key]
    marker = item.get_closest_marker(_MARKER)
    if marker is None:
        return base.enabled, base.policy, base.skip_ok
    unknown = sorted(set(marker.kwargs) - _MARKER_KEYWORDS)
    if unknown or len(marker.args) > 1:  # a typo (alow=) would otherwise be ignored and the allowance lost
        what = f"unknown keyword(s) {', '.join(unknown)}" if unknown else f"{len(marker.args)} positional arguments"
        pytest.fail(
            f"usage error: @pytest.mark.kernelguard got {what}; it takes kernelguard(enabled=True, *, "
            f"allow=[...], skip_ok=False) (keywords: {', '.join(sorted(_MARKER_KEYWORDS))})",
            pytrace=False,
        )
    enabled = bool(marker.args[0]) if marker.args else bool(marker.kwargs.get("enabled", True))
    skip_ok = bool(marker.kwargs.get("skip_ok", base.skip_ok))
    extra = marker.kwargs.get("allow", ())
    if not extra:
        return enabled, base.policy, skip_ok
    values = (extra,) if isinstance(extra, str) else tuple(extra)
    return enabled, base.policy.merge(_marker_policy(base, values)), skip_ok


@pytest.hookimpl(tryfirst=True)  # before fixtures are set up: a fallback in a fixture counts too
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not item.config.stash[settings_key].transformers:
        return
    enabled, policy, skip_ok = _item_settings(item)
    if not enabled:
        return
    from kernelguard.runtime import REGISTRY, arm_tripwires

    index = REGISTRY.open_window()
    tripwires = arm_tripwires(allow=policy, on_fallback="record")
    probe = item.config.stash[settings_key].probe
    item.stash[_state_key] = _TestState(tripwires, _watch_boundaries(policy, probe=probe), index, skip_ok)


_BOUNDARIES_ALLOW = ("accept it explicitly with @pytest.mark.kernelguard(allow=['packed-without-boundaries']) or "
                     "--kernelguard-allow packed-without-boundaries")


def _watch_boundaries(policy: Any, *, probe: bool = False) -> Any:
    """Packed rows without GDN boundaries raise in the test (kernelguard.runtime.boundaries), for every transformers
    model it calls; not before transformers is imported (the plugin never imports it for a test that does not)."""
    if "transformers.modeling_utils" not in sys.modules:
        return None
    from kernelguard.runtime import ModelCallWatch

    return ModelCallWatch(policy, allow_fix=_BOUNDARIES_ALLOW, probe=probe)


def _new_failures(state: _TestState) -> list[Any]:
    from kernelguard.runtime import REGISTRY

    events = REGISTRY.events_since(state.reported)
    state.reported += len(events)
    return [e for e in events if not e.allowed]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    __tracebackhide__ = True  # the failure is the message, not this hook's frame
    state = item.stash.get(_state_key, None)
    if state is None:
        return (yield)
    try:
        result = yield
    except BaseException as exc:  # a hook wrapper: re-raised as is, or as our failure from it (skips too)
        state.failures = _new_failures(state)
        if state.skip_ok and _is_skip(exc):
            state.failures = []  # skip_ok: the skip stands
        if state.failures and not isinstance(exc, _fallback_error_type()):
            raise _failure(state.failures, "setup or the test call", skipped=_is_skip(exc)) from exc
        raise
    state.failures = _new_failures(state)
    if state.failures:
        raise _failure(state.failures, "setup or the test call")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """unittest's skipTest and errors are recorded by pytest's unittest plugin and replace our call failure in
    the report; put ours back (a skip after a fallback still fails) or add it as a section."""
    report = yield
    state = item.stash.get(_state_key, None)
    if state is not None and call.when == "call" and state.failures and not (state.skip_ok and report.skipped):
        failure = _failure(state.failures, "setup or the test call", skipped=report.skipped)
        if report.skipped or report.passed:
            report.outcome = "failed"
            report.longrepr = _failure_repr(item, failure)
        elif _fallback_error_type().__name__ not in str(report.longrepr):
            report.sections.append(("kernelguard", str(failure)))
    _one_line_summary(report)
    return report


def _failure_repr(item: pytest.Item, failure: KernelFallbackError) -> Any:
    """The failure as pytest's own report type: the whole message in the failure section, its title as the
    crash line (the short summary, junit's message). A plain string would put all of it in both, and
    pytest-xdist sends this type between processes intact (anything else travels as a string)."""
    from _pytest._code.code import ExceptionChainRepr, ReprEntryNative, ReprFileLocation, ReprTraceback

    text = f"{type(failure).__name__}: {failure}"
    entry = ReprEntryNative([line + "\n" for line in text.split("\n")])
    crash = ReprFileLocation(item.location[0], (item.location[1] or 0) + 1, text)  # trimmed by _one_line_summary
    return ExceptionChainRepr([(ReprTraceback([entry], None, "native"), crash, None)])


def _one_line_summary(report: pytest.TestReport) -> None:
    """On CI (the CI or BUILD_NUMBER variable) pytest's short summary prints a failure's whole message, so our
    twenty-line explanation would appear twice; the summary gets the title line, the failure section the rest."""
    if not report.failed:  # every report of every test passes here, plugin enabled or not
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", "")
    title = message.split("\n", 1)[0]
    if "KernelFallbackError: kernelguard:" in title and title != message:
        crash.message = title


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    __tracebackhide__ = True
    state = item.stash.get(_state_key, None)
    try:
        result = yield
    finally:
        if state is not None:
            state.tripwires.disarm()
            if state.boundaries is not None:
                state.boundaries.disarm()
            del item.stash[_state_key]
    if state is not None:
        failures = _new_failures(state)
        if failures:
            raise _failure(failures, "teardown")
    return result


def _fallback_error_type() -> type[KernelFallbackError]:
    from kernelguard.errors import KernelFallbackError

    return KernelFallbackError


def _is_skip(exc: BaseException) -> bool:
    unittest = sys.modules.get("unittest")
    return isinstance(exc, pytest.skip.Exception) or (unittest is not None and isinstance(exc, unittest.SkipTest))


# ------------------------------------------------------------------------------------------ message ---
def _failure(events: list[Any], when: str, *, skipped: bool = False) -> KernelFallbackError:
    """One error naming every kernel that fell back, each call site once with its count, and the fix."""
    by_kernel: dict[str, list[Any]] = {}
    for e in events:
        by_kernel.setdefault(e.kernel, []).append(e)
    kernels = list(by_kernel)
    calls = sum(e.count for e in events)
    title = (
        f"kernelguard: the torch reference path of {', '.join(kernels)} ran during {when} "
        f"({len(kernels)} kernel(s), {len(events)} call site(s), {calls} call(s))"
    )
    lines = [title]
    for kernel, sites in by_kernel.items():
        lines.extend(_kernel_lines(kernel, sites))
    lines.append(_contract_line(skipped))
    first = events[0]
    return _fallback_error_type()(
        "\n".join(lines), fix=fix_in_pytest_terms(kernels, [e.fix for e in events], _cuda_available()),
        layer=first.layer, kernel=first.kernel, reason=first.reason,
        details={"kernels": kernels, "sites": [(e.layer, e.site, e.count) for e in events]},
    )


def _kernel_lines(kernel: str, sites: list[Any]) -> list[str]:
    issues = sorted({i for e in sites for i in e.issues})
    known = f" [known issue: {', '.join(issues)}]" if issues else ""
    lines = [f"  {kernel}: {sites[0].reason}{known}"]
    for e in sites[:_MAX_SITES_SHOWN]:
        lines.append(f"    {e.layer} -> {e.site} ({e.count} call{'s' if e.count != 1 else ''})")
    rest = sites[_MAX_SITES_SHOWN:]
    if rest:
        lines.append(f"    ... and {len(rest)} more call site(s) ({sum(e.count for e in rest)} calls)")
    return lines


def _contract_line(skipped: bool) -> str:
    if skipped:
        return (
            "The test then skipped itself (pytest.skip / skipTest), but only after the torch reference had run: "
            "it fails, because the slow path ran and a skip does not undo that.\n"
            f"  To let it skip, add one line above the test: {SKIP_OK_MARKER}\n"
            f"  (for every test: {SKIP_OK_INI} in pytest.ini), or skip before the first forward."
        )
    return "A test fails when a fallback ran, even if it caught the error or passed (the slow path ran)."


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")  # a fallback ran, so torch is loaded; never import it here
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_available())


def fix_in_pytest_terms(kernels: list[str], install_fixes: list[str], cuda: bool) -> str:
    """The fix in pytest's terms: install (GPU CI) or allow via option / ini / marker (CPU CI)."""
    from kernelguard.resolution import split_fix

    # One command per line, alone (it pastes as one command); what it assumes on the line under it.
    installs = "".join(
        f"\n      {command}" + (f"\n        ({note})" if note else "")
        for command, note in (split_fix(f) for f in dict.fromkeys(f for f in install_fixes if f))
    )
    options = " ".join(f"--kernelguard-allow {k}" for k in kernels)
    ini = "\n".join(["      kernelguard_allow ="] + [f"          {k}" for k in kernels])
    marker = f"@pytest.mark.kernelguard(allow={kernels!r})"
    if cuda:
        return (
            f"install the fast kernels:{installs}\n"
            f"  or accept these fallbacks: pytest {options}; or in pytest.ini / [tool.pytest.ini_options]:\n"
            f"{ini}\n  or for this test only: {marker}"
        )
    return (
        "this machine has no CUDA device: these kernels cannot run here, the torch reference is the only path.\n"
        "  CPU CI: allow them in pytest.ini (or [tool.pytest.ini_options] in pyproject.toml; anything not "
        f"listed still fails):\n      kernelguard = true\n{ini}\n"
        f"    (or pytest --kernelguard {options}, or {marker} on the test)\n"
        f"  GPU CI (strict: no allow list): install the fast kernels{installs}"
    )


# ------------------------------------------------------------------------------------------- header ---
def pytest_report_header(config: pytest.Config) -> list[str]:
    s = config.stash.get(settings_key, None)
    if s is None or not s.enabled:
        return []
    lines = [f"kernelguard: enabled (allow: {', '.join(s.allow) or 'nothing'})"]
    lines.extend(_provider_lines())
    return lines


def _provider_lines() -> list[str]:
    """Import-time choices of already-loaded transformers modules; else which fast providers are importable.

    Reads sys.modules and import specs only: nothing is imported here.
    """
    if "transformers" in sys.modules:
        from kernelguard.resolution import transformers_compat as compat

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
