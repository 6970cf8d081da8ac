"""The layering of ARCHITECTURE.md, enforced: no kernelguard module imports one from a layer above it.

Every import counts, including the ones inside functions (they are how optional heavy work is deferred, not a
way around the layering). A new module must be placed in ``LAYERS`` before it can be imported by anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kernelguard

PACKAGE = Path(kernelguard.__file__).parent

ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"


def _layers_from_doc() -> list[tuple[str, set[str]]]:
    """ARCHITECTURE.md's layer block, lowest first: a line starting with a layer name opens it, an indented
    line continues it."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    block = text.split("<!-- layers -->", 1)[1].split("<!-- /layers -->", 1)[0].strip().strip("`").strip()
    layers: list[tuple[str, set[str]]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        words = line.split()
        if line[0].isspace():
            layers[-1][1].update(words)
        else:
            layers.append((words[0], set(words[1:])))
    return layers[::-1]


LAYERS = _layers_from_doc()


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
            # `from pkg import name`: name is a submodule or an attribute of pkg; count the submodule when it is
            # one, so `from . import references` inside numerics/ is an import of numerics.references.
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if (PACKAGE / Path(*sub.split("."))).with_suffix(".py").exists()
                          or (PACKAGE / Path(*sub.split("."))).is_dir() else target or sub)
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


def test_the_layer_table_names_only_modules_that_exist() -> None:
    modules = {_module_name(path) for path in PACKAGE.rglob("*.py")}
    stale = sorted(m for _, members in LAYERS for m in members if m not in modules and m != "train")
    assert [name for name, _ in LAYERS] == ["data", "probes", "decisions", "compose", "runtime", "entry"]
    assert stale == [], f"ARCHITECTURE.md places modules that do not exist: {stale}"


def test_no_two_modules_import_each_other() -> None:
    names = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: {i for i in _imports(path, name) if i in names} for name, path in names.items()}
    circles = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a != b and a in graph[b]})
    assert circles == []


def test_modules_and_functions_stay_small() -> None:
    big, long = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > 460:
            big.append(f"{path.relative_to(PACKAGE)} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 65:
                long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert big == [] and long == []


def test_every_module_declares_its_public_names() -> None:
    def declarations(path: Path) -> int:  # module-level `__all__ = ...` / `__all__: list[str] = ...`
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets = [t for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
        targets += [n.target for n in tree.body if isinstance(n, ast.AnnAssign)]
        return sum(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)

    wrong = sorted(
        f"{path.relative_to(PACKAGE)} ({count})" for path in PACKAGE.rglob("*.py")
        if path.name != "__main__.py" and (count := declarations(path)) != 1
    )
    assert wrong == [], "each module declares __all__ exactly once"


def _stages_from_doc() -> list[str]:
    """ARCHITECTURE.md's ``train/`` stage block, lowest first: the first word of each line is a stage, named as
    its folder in ``kernelguard/train/`` (``run``: the files in ``train/`` itself)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    block = text.split("<!-- train stages -->", 1)[1].split("<!-- /train stages -->", 1)[0].strip().strip("`").strip()
    return [line.split()[0] for line in block.splitlines() if line.strip() and not line[0].isspace()][::-1]


STAGES = _stages_from_doc()


def _stage_of(module: str) -> int | None:
    """The stage index of a ``train.`` module (``run`` for the files in train/ itself), None outside train/."""
    parts = module.split(".")
    if parts[0] != "train":
        return None
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / "train" / parts[1]).is_dir()):
        return STAGES.index(parts[1]) if parts[1] in STAGES else -1
    return STAGES.index("run")


def test_every_train_folder_is_a_stage_and_every_stage_a_folder() -> None:
    folders = {p.parent.name for p in (PACKAGE / "train").glob("*/__init__.py")}
    assert STAGES[-1] == "run", "the run files (train/ itself) are the top stage"
    assert sorted(folders) == sorted(s for s in STAGES if s != "run")


def test_no_train_stage_imports_a_stage_above_it() -> None:
    upward = []
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        name = _module_name(path)
        own = _stage_of(name)
        for imported in sorted(_imports(path, name)):
            stage = _stage_of(imported)
            if stage is not None and own is not None and stage > own:
                upward.append(f"{name} ({STAGES[own]}) imports {imported} ({STAGES[stage]})")
    assert upward == [], "a train/ stage imports only from its own stage or a lower one (ARCHITECTURE.md)"
