"""The layering of ARCHITECTURE.md, enforced: no kernelguard module imports one from a layer above it.

Every import counts, including the ones inside functions (they are how optional heavy work is deferred, not a
way around the layering). A new module must be placed in ``LAYERS`` before it can be imported by anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kernelguard

PACKAGE = Path(kernelguard.__file__).parent

# Lowest first. A module may import modules of its own layer or below.
LAYERS: list[tuple[str, set[str]]] = [
    ("data", {"errors", "capability", "geometry", "known_issues", "catalog", "decisions", "facts", "install",
              "terms"}),
    ("probes", {"env", "discovery", "providers", "providers.installed", "providers.hub",
                "providers.kernels_release", "providers.fatbin",
                "fla_refusal", "fla_autotune", "transformers_compat"}),
    ("decisions", {"policy", "resolver"}),
    ("compose", {"check", "report", "numerics", "numerics.shapes", "numerics.references", "numerics.results",
                 "numerics.cases", "numerics.run", "registry", "attention", "layer_guard", "tripwires",
                 "import_hook"}),
    ("runtime", {"api", "guard", "gate", "pytest_plugin", "integrations", "integrations.transformers",
                 "integrations.trl", "train"}),
    ("entry", {"cli", "__main__", "__init__", "numerics.__main__"}),
]


def _layer_of(module: str) -> int | None:
    if module.startswith("train.") or module == "train":
        module = "train"
    for index, (_, members) in enumerate(LAYERS):
        if module in members:
            return index
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package_parts = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("kernelguard"):
                target = node.module.removeprefix("kernelguard").lstrip(".")
            else:
                continue
            if target:
                found.add(target)
            else:  # from . import x
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kernelguard."):
                    found.add(alias.name.removeprefix("kernelguard."))
    return found


def _top(module: str) -> str:
    for candidate in (module, module.rsplit(".", 1)[0]):
        if _layer_of(candidate) is not None:
            return candidate
    return module


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(
        name for path in PACKAGE.rglob("*.py")
        if (name := _module_name(path)) and _layer_of(name) is None and not name.startswith("train")
    )
    assert unplaced == [], f"place these modules in a layer of tests/test_architecture.py: {unplaced}"


def test_no_module_imports_from_a_layer_above_it() -> None:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        own = _layer_of(name)
        if own is None:
            continue
        for imported in sorted(_imports(path, name)):
            layer = _layer_of(_top(imported))
            if layer is not None and layer > own:
                violations.append(f"{name} ({LAYERS[own][0]}) imports {imported} ({LAYERS[layer][0]})")
    assert violations == []
