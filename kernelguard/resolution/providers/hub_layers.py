"""Does a Hub kernel variant fit the call transformers makes, as the installed ``kernels`` judges it?

transformers maps each GDN op to a Kernel Hub repository and layer name (``chunk_gated_delta_rule`` ->
``kernels-community/fla``, layer ``chunk_gated_delta_rule``). ``kernelize()`` loads the variant, takes
``<variant>.layers.<layer_name>``, validates it and makes its ``forward`` the op. Two checks, each named when it
fails:

1. kernels' own verdict (:mod:`kernelguard.resolution.providers.kernels_verdict`): the installed kernels loads the variant
   as ``kernelize()`` would (its metadata checks, its layer lookup and layer validation, ``has_backward`` for a
   training kernelize) and its message is quoted when it refuses the layer or keeps transformers' torch
   reference instead (kernels 0.19 falls back for a layer without backward in training, where 0.16-0.18 raise);
2. the accepted layer's ``forward`` binds the call transformers makes (:class:`CallShape`: positional count,
   keywords, and in packed training the batch's packed-sequence keywords its ``**kwargs`` passes on), bound by
   Python itself (:meth:`inspect.Signature.bind`); kernels compares only parameter counts and kinds, and a
   mismatch fails at the first call (transformers #47526: "got multiple values for argument 'seq_idx'").

When kernels cannot be asked here (torch or kernels missing, a variant whose native library this machine cannot
load), both checks fall back to reading the variant's files with :mod:`ast`, and the result says so.
"""

from __future__ import annotations

import ast
import inspect
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..facts import HubLayerCheck
from ..packed_batch import BOUNDARY_KEYWORDS
from ..transformers_calls import CallShape, Parameter
from .kernels_verdict import KernelsVerdict, ask_kernels

__all__ = [
    "check_hub_layer",
    "variant_folder",
]



def variant_folder(location: str | None, variant: str | None) -> Path | None:
    """The chosen variant's folder, from a probe's location (a repository root, its build/, or the variant)."""
    if location is None or variant is None:
        return None
    base = Path(location)
    for candidate in (base / variant, base / "build" / variant, base):
        if candidate.name == variant and candidate.is_dir():
            return candidate
    return None


def check_hub_layer(kernel: str, repo_id: str, layer_name: str, folder: Path, call: CallShape, *, packed: bool,
                    training: bool = True, reference: tuple[Parameter, ...] | None = None) -> HubLayerCheck:
    """Both checks on the variant ``folder``; ``reference``: the parameters of the torch function the layer
    replaces (None: not found, so kernels cannot be asked)."""
    spread = tuple(k for k in BOUNDARY_KEYWORDS if k not in call.popped) if packed and call.spreads else ()
    keywords = (*call.keywords, *spread)
    shown = _describe(kernel, call, spread)
    if reference is None:
        verdict = KernelsVerdict(False, None, note=f"the torch reference `{call.function}` it replaces was not "
                                                   "found in transformers' modeling file")
    else:
        verdict = ask_kernels(folder, repo_id, layer_name, reference, training=training)

    def result(problem: str | None, file: str | None = None, judged_by: str | None = None) -> HubLayerCheck:
        note = None if verdict.asked else f"{verdict.note}; judged from the variant's source instead"
        missing = _MISSING_DEPENDENCY.search(problem or "")
        return HubLayerCheck(kernel, repo_id, layer_name, folder.name, shown, problem, file,
                             judged_by or _source_reading(), note, f"pip install {missing[1]}" if missing else None,
                             hands_to(folder))

    if not verdict.asked:
        problem, file = _check_source(layer_name, folder, call.positional, keywords)
        return result(problem, str(file) if file else None)
    judged_by = f"kernels {verdict.kernels_version}"
    mode = "training" if training else "inference"
    if verdict.fell_back:  # no error at load, but the op stays transformers' slow torch reference
        return result(f"check 1 (kernels accepts the layer) failed: kernels {verdict.kernels_version} does not use "
                      f"it for {mode}, so kernelize() falls back to transformers' torch reference: "
                      f"{verdict.refusal}", judged_by=judged_by)
    if verdict.refusal is not None:
        return result(f"check 1 (kernels accepts the layer) failed: kernels {verdict.kernels_version} refuses it "
                      f"for {mode}: {verdict.refusal}", judged_by=judged_by)
    forward = verdict.layer.forward
    file = inspect.getsourcefile(forward)
    try:
        inspect.signature(forward).bind(None, *[None] * call.positional, **dict.fromkeys(keywords))
    except TypeError as exc:
        return result(f"check 2 (its forward takes transformers' call) failed: `{layer_name}.forward` (kernels "
                      f"{verdict.kernels_version} accepts the layer) does not bind it: {exc}", file, judged_by)
    return result(None, file, judged_by)


# Backends a vendored copy of fla's dispatcher hands the whole op to whenever they import (fla-core 0.6.0's
# FlashQLABackend): the Hub build then runs that backend's code, and its known issues, with no fla installed.
HANDOFF_BACKENDS = ("flash_qla",)


def hands_to(folder: Path) -> tuple[str, ...]:
    """The backends of :data:`HANDOFF_BACKENDS` the variant's Python code imports (an import statement, or the
    name given to ``import_module`` / ``find_spec``), read with :mod:`ast` from the folder or its ZIP build."""
    found: set[str] = set()
    for file in _python_files(folder):
        tree = _parse(file)
        for node in ast.walk(tree) if tree is not None else ():
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else [])
            found.update(n.split(".")[0] for n in names if n.split(".")[0] in HANDOFF_BACKENDS)
    return tuple(sorted(found))


def _python_files(folder: Path) -> list[Any]:
    files: list[Any] = sorted(folder.rglob("*.py"))
    for archive in sorted(folder.glob("*.zip")):
        try:
            with zipfile.ZipFile(archive) as z:
                names = [n for n in z.namelist() if n.endswith(".py")]
        except (OSError, zipfile.BadZipFile):
            continue
        files += [zipfile.Path(archive, n) for n in names]
    return files


# kernels' refusal of a variant whose declared Python dependency does not import (kernels.python_deps)
_MISSING_DEPENDENCY = re.compile(r"requires Python dependency `([^`]+)`")


def _source_reading() -> str:
    return "kernelguard's reading of the variant's source"


def _check_source(layer_name: str, folder: Path, positional: int, keywords: tuple[str, ...]
                  ) -> tuple[str | None, Path | None]:
    """Both checks read from the variant's files with ast (kernels could not be asked): the problem and the file."""
    layers = _layers_files(folder)
    if not layers:
        return (f"check 1 (the layer exists) failed: variant {folder.name} has no `layers` module "
                "(no layers.py or layers/__init__.py), so kernels finds no layer in it"), None
    found = _find_class(layers, layer_name)
    if isinstance(found, str):
        return f"check 1 (the layer exists) failed: {found}", None
    cls, file = found
    forward = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    if forward is None:
        return (f"check 1 (the layer exists) failed: class `{layer_name}` in {_rel(file, folder)} has no "
                "`forward` of its own"), file
    problem = _bind(forward.args, positional, keywords)
    if problem is not None:
        return (f"check 2 (its forward takes transformers' call) failed: `{layer_name}.forward` in "
                f"{_rel(file, folder)} {problem}"), file
    return None, file


def _describe(kernel: str, call: CallShape, spread: tuple[str, ...]) -> str:
    parts = [f"{call.positional} positional"] + [f"{k}=" for k in (*call.keywords, *spread)]
    return f"{kernel}({', '.join(parts)})"


def _rel(file: Path, folder: Path) -> str:
    try:
        return str(file.relative_to(folder.parent))
    except (ValueError, AttributeError):  # a file inside a ZIP build (zipfile.Path): its own path names it
        return str(file)


def _layers_files(folder: Path) -> list[Path]:
    """Where kernels' ``<variant>.layers`` would come from: the variant package, one package folder in it, or
    (kernels 0.19's "zip" build layout) the ``<id>.zip`` archive beside its metadata, read in place."""
    roots: list[Any] = [folder, *sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file())]
    roots += [zipfile.Path(z) for z in sorted(folder.glob("*.zip"))]
    for root in roots:
        for candidate in (root / "layers.py", root / "layers" / "__init__.py"):
            if candidate.is_file():
                return [candidate]
    return []


def _parse(file: Path) -> ast.Module | None:
    try:
        return ast.parse(file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None


def _find_class(files: list[Path], name: str, depth: int = 0) -> tuple[ast.ClassDef, Path] | str:
    file = files[0]
    tree = _parse(file)
    if tree is None:
        return f"{file.name} of the variant cannot be parsed"
    defined = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            if node.name == name:
                return node, file
            defined.append(node.name)
        if isinstance(node, ast.ImportFrom) and node.level >= 1 and depth < 3:
            for alias in node.names:
                if (alias.asname or alias.name) != name:
                    continue
                target = _relative(file, node.level, node.module)
                if target is None:
                    return f"`{name}` is imported in {file.name} from a module the variant does not contain"
                return _find_class([target], alias.name, depth + 1)
            defined += [a.asname or a.name for a in node.names]
    listed = ", ".join(sorted(set(defined))) or "nothing"
    return f"the variant's `layers` ({file.name}) has no layer `{name}` (it defines: {listed})"


def _relative(file: Path, level: int, module: str | None) -> Path | None:
    base = file.parent
    for _ in range(level - 1):
        base = base.parent
    target = base.joinpath(*(module or "__init__").split("."))
    for candidate in (target.parent / f"{target.name}.py", target / "__init__.py"):  # zipfile.Path too
        if candidate.is_file():
            return candidate
    return None


@dataclass(frozen=True, slots=True)
class _Params:
    positional: list[str]  # positional-only + positional-or-keyword, after self
    positional_only: set[str]
    keyword_only: list[str]
    required: set[str]
    var_positional: bool
    var_keyword: bool


def _params(args: ast.arguments) -> _Params:
    posonly = [a.arg for a in args.posonlyargs]
    plain = [a.arg for a in args.args]
    positional = (posonly + plain)[1:]  # drop self
    defaults = len(args.defaults)
    required = set(positional[: len(positional) - defaults] if defaults else positional)
    kwonly = [a.arg for a in args.kwonlyargs]
    required |= {a for a, d in zip(kwonly, args.kw_defaults) if d is None}
    return _Params(positional, set(posonly) - {"self"}, kwonly, required, args.vararg is not None,
                   args.kwarg is not None)


def _bind(args: ast.arguments, positional: int, keywords: tuple[str, ...]) -> str | None:
    """Why Python would refuse ``forward(self, <positional>..., **{keywords})``, or None when it binds."""
    p = _params(args)
    if positional > len(p.positional) and not p.var_positional:
        return f"takes {len(p.positional)} positional arguments after self, but the call passes {positional}"
    filled = set(p.positional[:positional])
    for name in keywords:
        if name in filled:
            return f"got multiple values for argument '{name}': the call passes it by position and by name"
        if name in p.positional_only:
            return f"takes '{name}' by position only, but the call passes it by name"
        if name not in p.positional and name not in p.keyword_only and not p.var_keyword:
            return f"got an unexpected keyword argument '{name}' (no such parameter and no **kwargs)"
        filled.add(name)
    missing = sorted(p.required - filled)
    if missing:
        return f"is missing required argument(s) {', '.join(repr(m) for m in missing)} that the call does not pass"
    return None
