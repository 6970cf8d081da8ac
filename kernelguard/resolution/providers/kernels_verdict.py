"""The installed ``kernels``' own verdict on a Hub variant's layer: loaded as ``kernelize()`` loads it, judged by
kernels itself, offline and on CPU.

``kernelize()`` takes ``<variant>.layers.<layer_name>``, validates it against the module it replaces (kernels'
``_validate_layer``: a torch layer, no constructor of its own, no members beyond ``has_backward`` /
``can_torch_compile``, a ``forward`` with as many parameters of the same kinds as the reference), checks that it
supports the mode it was registered for (``has_backward`` in training: 0.16-0.18 raise, 0.19 keeps the original
forward and logs it) and then swaps its ``forward`` in, or keeps the original one. Rather than re-implement any of that, kernelguard runs kernels' public ``kernelize`` on a
stand-in of the module transformers makes of the torch reference (kernels' own ``use_kernel_forward_from_hub``
applied to a function with the reference's signature), with a mapping to the chosen variant folder registered
for the requested mode, as transformers registers the GDN ops (``{Mode.TRAINING: ..., Mode.INFERENCE: ...}``).
Whatever kernels raises, or logs when it keeps the original forward, is its verdict, quoted.

Only the public API is used (``kernelize``, ``use_kernel_mapping``, ``use_kernel_forward_from_hub``, ``Mode``;
the same in kernels 0.16 through 0.19); the mapping's repository is an object of ours with kernels' repository
protocol (``load()`` returning the layer class), which loads the variant folder the probe chose for the target
(kernels' own repositories would choose for this machine). Its ``load()`` does what kernels' loader does:
kernels' metadata checks ("kernels-minver": 0.17+ refuse, 0.16 only warns; the declared "python-depends" import),
the variant package imported, its
``layers`` attribute read with kernels' own lookup where the release has it.

The variant's code runs: only ever for a repository the probe trusts (kernels-community, or
``--allow untrusted-hub-repo``), as ``kernelize()`` would run it at job start. When it cannot be imported here
(torch missing, a native library this machine cannot load), kernels cannot be asked: the caller says so and reads
the variant's source instead.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..transformers_calls import Parameter
from .kernels_release import KernelsRelease, import_kernels

__all__ = ["KernelsVerdict", "ask_kernels"]

_MODULE_PREFIX = "_kernelguard_hub_variant_"


@dataclass(frozen=True, slots=True)
class KernelsVerdict:
    """kernels' verdict on one variant's layer. ``asked`` False: kernels could not be asked here (``note`` says
    why); otherwise ``refusal`` is kernels' own message (None: it swaps the layer's forward in), and
    ``fell_back`` says kernelize() kept transformers' torch reference instead of raising (kernels 0.19 does so
    for a layer without backward in training: the slow path, not an error)."""

    asked: bool
    kernels_version: str | None
    refusal: str | None = None
    fell_back: bool = False
    layer: Any = None  # the layer class kernelize() would use, when accepted
    note: str | None = None


class _LoadFailed(Exception):
    """The variant could not be imported on this machine: an environment fact, not kernels' verdict."""


class _VariantRepository:
    """kernels' repository protocol for one variant folder: ``load()`` returns the layer class."""

    def __init__(self, kernels: KernelsRelease, repo_id: str, folder: Path, layer_name: str) -> None:
        self.kernels, self.repo_id, self.folder, self.layer_name = kernels, repo_id, folder, layer_name
        self.loaded: Any = None  # the layer class load() returned
        self.module_name = _MODULE_PREFIX + hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:16]

    def __str__(self) -> str:  # kernels' messages name the repository through str()
        return f"`{self.repo_id}` (variant {self.folder.name}), layer `{self.layer_name}`"

    def load(self) -> Any:
        metadata = self.kernels.metadata_type.read_from_file(self.folder / "metadata.json")
        if self.kernels.minver_refuses and self.kernels.minver_problem is not None:
            problem = self.kernels.minver_problem(metadata, self.folder)
            if problem:
                raise RuntimeError(problem)
        if self.kernels.python_deps_problem is not None:  # kernels checks them before importing the variant
            problem = self.kernels.python_deps_problem(metadata)
            if problem:
                raise ImportError(problem)
        module = self._import()
        self.loaded = self._layer(module)
        return self.loaded

    def _layer(self, module: ModuleType) -> Any:
        if self.kernels.get_kernel_layer is not None:
            return self.kernels.get_kernel_layer(self, module)
        if getattr(module, "layers", None) is None:  # the same lookup, for a release that hides its own
            raise ValueError(f"Kernel repo {self} does not define any layers.")
        layer = getattr(module.layers, self.layer_name, None)
        if layer is None:
            raise ValueError(f"Layer `{self.layer_name}` not found in kernel repo {self}.")
        return layer

    def _import(self) -> ModuleType:
        init = self.folder / "__init__.py"
        if not init.is_file():  # kernels' other layout: <variant>/<python name>/__init__.py
            init = next(iter(sorted(self.folder.glob("*/__init__.py"))), init)
        if not init.is_file():
            raise FileNotFoundError(f"No kernel module found at: `{self.folder}`")
        spec = importlib.util.spec_from_file_location(self.module_name, init)
        if spec is None or spec.loader is None:
            raise _LoadFailed(f"Python cannot load {init}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[self.module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # a variant may fail with anything on a machine it was not built for
            raise _LoadFailed(f"importing variant {self.folder.name} failed here: {type(exc).__name__}: {exc}") from exc
        return module

    def forget(self) -> None:
        for name in [n for n in sys.modules if n == self.module_name or n.startswith(self.module_name + ".")]:
            del sys.modules[name]


def ask_kernels(folder: Path, repo_id: str, layer_name: str, reference: tuple[Parameter, ...], *,
                training: bool) -> KernelsVerdict:
    """kernels' verdict on ``folder``'s layer ``layer_name`` replacing a function with ``reference``'s parameters,
    for a training (``Mode.TRAINING``) or inference (``Mode.INFERENCE``) kernelize. Never raises."""
    try:
        import torch  # noqa: F401 - kernels' layer validation needs torch.nn

        kernels = import_kernels()
        import kernels as api
    except Exception as exc:  # noqa: BLE001 - absent or broken: kernels cannot be asked
        return KernelsVerdict(False, None, note=f"kernels' layer validation cannot run here ({exc!r})")
    repo = _VariantRepository(kernels, repo_id, folder, layer_name)
    try:
        return _kernelize(api, kernels, repo, reference, training)
    except _LoadFailed as exc:
        return KernelsVerdict(False, kernels.version, note=f"kernels' layer validation cannot run here: {exc}")
    finally:
        repo.forget()


def _kernelize(api: Any, kernels: KernelsRelease, repo: _VariantRepository, reference: tuple[Parameter, ...],
               training: bool) -> KernelsVerdict:
    mode = api.Mode.TRAINING if training else api.Mode.INFERENCE
    stand_in = _reference_module(api, repo.layer_name, reference)
    original = type(stand_in).forward
    with _captured_logs() as records:
        try:
            # "cpu": the device only picks the mapping's entry, and a "cuda" entry would ask torch for the GPU's
            # capability; the layer checks do not depend on it.
            with api.use_kernel_mapping({repo.layer_name: {"cpu": {mode: repo}}}, inherit_mapping=False):
                api.kernelize(stand_in, mode=mode, device="cpu")
        except _LoadFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - kernels' refusal, whatever its type
            return KernelsVerdict(True, kernels.version, refusal=_one_line(str(exc)))
    swapped = getattr(stand_in.forward, "__func__", None)
    if swapped is not None and swapped is not original:
        return KernelsVerdict(True, kernels.version, layer=repo.loaded)
    said = [r.getMessage() for r in records if "fallback" in r.getMessage() or "original forward" in r.getMessage()]
    reason = "; ".join(said) or "kernelize() kept the original forward without saying why"
    return KernelsVerdict(True, kernels.version, refusal=_one_line(reason), fell_back=True)


def _reference_module(api: Any, layer_name: str, reference: tuple[Parameter, ...]) -> Any:
    """What transformers' ``use_kernel_func_from_hub_with_fallback`` makes of the torch reference: kernels'
    ``use_kernel_forward_from_hub(name)`` applied to a function (a ``Func`` module instance)."""

    def reference_function(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("kernelguard never calls the stand-in")

    reference_function.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(p.name, getattr(inspect.Parameter, p.kind),
                           default=None if p.has_default else inspect.Parameter.empty) for p in reference]
    )
    made = api.use_kernel_forward_from_hub(layer_name)(reference_function)
    return made() if inspect.isclass(made) else made


@contextmanager
def _captured_logs() -> Iterator[list[logging.LogRecord]]:
    """kernels says a fallback only at INFO (``logging.info("Layer does not support backward, using fallback")``),
    which the root logger drops by default: lower it for the call and keep what was said."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root, handler = logging.getLogger(), Keep(logging.INFO)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())
