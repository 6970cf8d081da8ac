"""The rules of ARCHITECTURE.md, read from a package folder's own code: rooms in order, faces, no circles, every
dynamic import seen. A function of the folder, so tests can run it on a copy with a violation planted."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Modules whose import_module / __import__ takes a name computed at run time, and what those names are: none of
# them can name a kernelguard module, which the test cannot see through. Any other such call is a violation.
DYNAMIC_IMPORTS = {
    "": "lazy_face, and through it the public functions from the rooms' faces (the package's own _OFFERS)",
    "resolution.kernels_funcs": "the modules of kernels' Func copies that transformers' layers call",
    "resolution.providers.installed": "the third-party kernel packages a provider names",
    "resolution.transformers_compat": "the kernel package a transformers decorator's closure names",
    "resolution.providers.kernels_release": "kernels' own modules, by release",
    "resolution.fla_autotune": "the fla modules its pins name (only names starting with fla.)",
    "stack.numerics.references": "transformers' modeling modules and the kernel packages they import",
}


@dataclass(frozen=True)
class Import:
    target: str  # the module imported, relative to the package ("" the package itself)
    names: tuple[str, ...]  # for `from target import names`; () for `import target`
    dynamic: bool = False


def module_name(package: Path, path: Path) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(package: Path) -> dict[str, Path]:
    return {module_name(package, p): p for p in sorted(package.rglob("*.py")) if "__pycache__" not in p.parts}


def is_module(package: Path, dotted: str) -> bool:
    base = package.joinpath(*dotted.split(".")) if dotted else package
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _literal(node: ast.Call) -> str | None:
    if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def _is_dynamic_import(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def imports(package: Path, name: str, path: Path) -> Iterator[Import]:
    """Every import of ``name`` (function-level ones and literal import_module / __import__ calls included),
    relative to the package; a dynamic one whose name is computed has target "?"."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    own = [p for p in own if p]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = own[: len(own) - (node.level - 1)]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module == "kernelguard" or (node.module or "").startswith("kernelguard."):
                target = node.module.removeprefix("kernelguard").lstrip(".")
            else:
                continue
            yield Import(target, tuple(a.name for a in node.names))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "kernelguard" or alias.name.startswith("kernelguard."):
                    yield Import(alias.name.removeprefix("kernelguard").lstrip("."), ())
        elif _is_dynamic_import(node):
            literal = _literal(node)
            if literal is None:
                yield Import("?", (), dynamic=True)
            elif literal == "kernelguard" or literal.startswith("kernelguard."):
                yield Import(literal.removeprefix("kernelguard").lstrip("."), (), dynamic=True)
            elif literal.startswith("."):
                yield Import("?", (), dynamic=True)  # relative: resolved against an argument the test cannot read


def offers(package: Path, face: str) -> tuple[dict[str, str], list[str]]:
    """A face's offers as name -> the module of its room that defines it (its ``_OFFERS``, module -> names; the
    package's own names rooms' faces) and its ``__all__``."""
    path = package.joinpath(*face.split(".")) / "__init__.py" if face else package / "__init__.py"
    table: dict[str, str] = {}
    names: list[str] = []
    if not path.is_file():  # a module, not a folder: no face
        return table, names
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id == "_OFFERS" and node.value is not None:
                    table = {n: module for module, names in ast.literal_eval(node.value).items() for n in names}
                elif isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
                    names = list(ast.literal_eval(node.value))
    return table, names


def defining_module(package: Path, face: str, name: str) -> str | None:
    """The module a face's ``name`` comes from: a submodule, an entry of its offers, or None (the face itself)."""
    sub = f"{face}.{name}" if face else name
    if is_module(package, sub):
        return sub
    table, _ = offers(package, face)
    if name not in table:
        return None
    full = f"{face}.{table[name]}" if face else table[name]
    if (package.joinpath(*full.split(".")) / "__init__.py").is_file():  # the package's own offers name rooms' faces
        return defining_module(package, full, name) or full
    return full


def edges(package: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports, a face's offered names followed to the module that defines them."""
    mods = modules(package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for imp in imports(package, name, path):
            if imp.target == "?":
                continue
            if not imp.names:
                graph[name].add(imp.target)
                continue
            for alias in imp.names:
                found = defining_module(package, imp.target, alias)
                graph[name].add(found if found is not None else imp.target)
    for name in graph:
        # The package's own __init__ ("") is the one module every other needs loaded first (Python imports a
        # package before any of its modules), so an import of it (its __version__, lazy_face) closes no circle.
        graph[name] -= {name, ""}
        graph[name] &= set(mods)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, directly or through others (Tarjan's strongly connected
    components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def rooms_from_doc(architecture: Path) -> list[str]:
    """ARCHITECTURE.md's rooms block, lowest first: the first word of each line that does not start with a space."""
    text = architecture.read_text(encoding="utf-8")
    block = text.split("<!-- rooms -->", 1)[1].split("<!-- /rooms -->", 1)[0].strip().strip("`").strip()
    return [line.split()[0] for line in block.splitlines() if line.strip() and not line[0].isspace()][::-1]


def room_of(module: str) -> str:
    return module.split(".")[0] if module and module not in ("__main__",) else ""


def upward_imports(package: Path, rooms: list[str]) -> list[str]:
    """Imports from a room above the importer's own (the package's own modules, "", stand above every room)."""
    order = {room: i for i, room in enumerate(rooms)}
    bad = []
    for name, targets in sorted(edges(package).items()):
        own = room_of(name)
        for target in sorted(targets):
            there = room_of(target)
            if own and there and there != own and order.get(there, -1) > order.get(own, -1):
                bad.append(f"{name} ({own}) imports {target} ({there})")
    return bad


def imports_past_a_face(package: Path, rooms: list[str]) -> list[str]:
    """Code outside a room that imports one of its modules, or a name its face does not offer."""
    bad = []
    for name, path in modules(package).items():
        own = room_of(name)
        for imp in imports(package, name, path):
            there = room_of(imp.target)
            if imp.target == "?" or not there or there == own or there not in rooms:
                continue
            if imp.target != there:
                bad.append(f"{name} imports {'kernelguard.' + imp.target}: past the face of {there}/")
                continue
            _, offered = offers(package, there)
            missing = [a for a in imp.names if a not in offered]
            if missing or not imp.names:
                bad.append(f"{name} imports {missing or ['the whole room']} from {there}/, whose face does not offer it")
    return bad


def unexplained_dynamic_imports(package: Path) -> list[str]:
    bad = []
    for name, path in modules(package).items():
        for imp in imports(package, name, path):
            if imp.dynamic and imp.target == "?" and name not in DYNAMIC_IMPORTS:
                bad.append(f"{name}: import_module / __import__ of a name computed at run time")
    return bad
