"""The house ARCHITECTURE.md describes, enforced on kernelguard's own code: the rooms in their order, each room
entered only through its face, no circle of imports of any length, every dynamic import seen, ``train/``'s
stages in their order, small modules. Each rule is also run on a copy with a violation planted, which it must
name: a rule that cannot fail guards nothing.

Every import counts, including the ones inside functions (they are how optional heavy work is deferred, not a
way around the order).
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import architecture_rules as rules
import pytest

import kernelguard

PACKAGE = Path(kernelguard.__file__).parent
ARCHITECTURE = PACKAGE.parent / "ARCHITECTURE.md"
ROOMS = rules.rooms_from_doc(ARCHITECTURE)


def test_the_top_level_is_the_rooms_in_their_order_and_the_face() -> None:
    assert ROOMS == ["errors", "resolution", "stack", "runtime", "diagnosis", "train", "integrations", "cli"]
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name not in ("__pycache__", "py.typed"))
    assert entries == sorted([*ROOMS, "__init__.py", "__main__.py"]) and len(entries) <= 10


def test_the_tests_mirror_the_rooms() -> None:
    """A room's tests live in ``tests/<room>/``; what spans the house (architecture, public API, packaging, docs,
    bench tools) in ``tests/project/``; shared helpers and fixtures beside them in ``tests/``."""
    tests = Path(__file__).resolve().parents[1]
    folders = {f.parent.name for f in tests.glob("*/test_*.py")}
    assert folders <= {*ROOMS, "project"}, sorted(folders - {*ROOMS, "project"})
    assert sorted(f.name for f in tests.glob("test_*.py")) == []


def test_no_room_imports_a_room_above_it() -> None:
    assert rules.upward_imports(PACKAGE, ROOMS) == []


def test_code_outside_a_room_imports_only_its_face() -> None:
    assert rules.imports_past_a_face(PACKAGE, ROOMS) == []


def test_no_modules_import_each_other_through_a_circle_of_any_length() -> None:
    assert rules.circles(rules.edges(PACKAGE)) == []


def test_every_dynamic_import_is_seen() -> None:
    assert rules.unexplained_dynamic_imports(PACKAGE) == []
    stale = [m for m in rules.DYNAMIC_IMPORTS if m not in rules.modules(PACKAGE)]
    assert stale == []


def test_every_face_says_what_it_is_and_offers_what_its_modules_define() -> None:
    wrong = []
    for room in ROOMS:
        init = PACKAGE / room / "__init__.py"
        tree = ast.parse(init.read_text(encoding="utf-8"))
        if not ast.get_docstring(tree):
            wrong.append(f"{room}/__init__.py has no docstring")
        table, offered = rules.offers(PACKAGE, room)
        for name, where in table.items():
            module = f"{room}.{where}"
            if rules.is_module(PACKAGE, f"{room}.{name}"):
                wrong.append(f"{room} offers {name}, also the name of its module (importing it would replace it)")
            if name not in _defined(module):
                wrong.append(f"{room} offers {name} from {module}, which does not define it")
            if name not in offered:
                wrong.append(f"{room} offers {name} but leaves it out of __all__")
        if table and _typed(tree) != {(f".{where}", name) for name, where in table.items()}:
            wrong.append(f"{room}/__init__.py: the names under TYPE_CHECKING are not exactly its offers")
    assert wrong == []


def _typed(tree: ast.Module) -> set[tuple[str, str]]:
    """(module, name) of each import under a face's ``if TYPE_CHECKING:``, what type checkers read."""
    blocks = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"]
    return {("." * i.level + (i.module or ""), a.name) for b in blocks for i in b.body
            if isinstance(i, ast.ImportFrom) for a in i.names}


def _defined(module: str) -> set[str]:
    path = PACKAGE.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    found: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                found.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update((a.asname or a.name).split(".")[0] for a in node.names)
    return found


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The package and its ARCHITECTURE.md, copied: the files are only read, never imported."""
    shutil.copytree(PACKAGE, tmp_path / "kernelguard", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ARCHITECTURE, tmp_path / "ARCHITECTURE.md")
    return tmp_path / "kernelguard"


def _plant(path: Path, code: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + "\n\n" + code + "\n", encoding="utf-8")


def test_a_planted_upward_import_is_named(copy: Path) -> None:
    _plant(copy / "resolution" / "catalog.py", "def planted():\n    from kernelguard.runtime import REGISTRY\n")
    assert rules.upward_imports(copy, ROOMS) == [
        "resolution.catalog (resolution) imports runtime.registry (runtime)"]


def test_a_planted_circle_of_three_modules_is_named(copy: Path) -> None:
    for this, nxt in (("one", "two"), ("two", "three"), ("three", "one")):
        (copy / "stack" / f"planted_{this}.py").write_text(f"from .planted_{nxt} import X\nX = 1\n")
    assert rules.circles(rules.edges(copy)) == [
        ["stack.planted_one", "stack.planted_three", "stack.planted_two"]]
    assert rules.circles(rules.edges(PACKAGE)) == []  # the control: the same rule on the real code


def test_planted_importlib_imports_are_seen(copy: Path) -> None:
    _plant(copy / "resolution" / "catalog.py",
           "def planted(name):\n    import importlib\n    importlib.import_module(name)\n"
           "    return importlib.import_module('kernelguard.runtime.registry')\n")
    assert rules.unexplained_dynamic_imports(copy) == [
        "resolution.catalog: import_module / __import__ of a name computed at run time"]
    assert rules.upward_imports(copy, ROOMS) == [
        "resolution.catalog (resolution) imports runtime.registry (runtime)"]


def test_a_planted_import_past_a_face_is_named(copy: Path) -> None:
    _plant(copy / "runtime" / "gate.py", "def planted():\n    from kernelguard.resolution.catalog import MODES\n")
    _plant(copy / "runtime" / "registry.py", "def planted():\n    from kernelguard.stack import not_offered\n")
    assert rules.imports_past_a_face(copy, ROOMS) == [
        "runtime.gate imports kernelguard.resolution.catalog: past the face of resolution/",
        "runtime.registry imports ['not_offered'] from stack/, whose face does not offer it",
    ]


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
    graph = rules.edges(PACKAGE)
    for name in sorted(graph):
        own = _stage_of(name)
        for imported in sorted(graph[name]):
            stage = _stage_of(imported)
            if stage is not None and own is not None and stage > own:
                upward.append(f"{name} ({STAGES[own]}) imports {imported} ({STAGES[stage]})")
    assert upward == [], "a train/ stage imports only from its own stage or a lower one (ARCHITECTURE.md)"



def _spelled_outside(home: Path, words: set[str]) -> list[str]:
    """Every string constant equal to one of ``words`` in a module other than ``home``."""
    return sorted(
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}"
        for path in PACKAGE.rglob("*.py") if path != home
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words
    )


def test_the_packed_rows_keywords_are_spelled_only_in_their_home() -> None:
    """``resolution/packed_batch.py`` spells the boundary keywords once; everything else uses its names, so a
    keyword transformers renames is one edit, and no reader can check a name the builder never writes."""
    from kernelguard.resolution import BOUNDARY_KEYWORDS

    assert _spelled_outside(PACKAGE / "resolution" / "packed_batch.py", set(BOUNDARY_KEYWORDS)) == []


def test_the_interruption_lines_are_written_only_in_their_home() -> None:
    """Each line a command stopped while starting prints lives in ``errors/exit_codes.py``: the console script's
    first code, the commands and ``kernelguard train`` print the same words for the same signal."""
    from kernelguard.errors import INTERRUPTED_LINES

    lines = {line for said in INTERRUPTED_LINES.values() for line in said.values()}
    assert _spelled_outside(PACKAGE / "errors" / "exit_codes.py", lines) == []


def test_the_run_folders_file_names_are_spelled_only_in_their_home() -> None:
    """``train/common/run_folder.py`` names what a run writes; the stages that write, read, refuse to overwrite or
    export it use those names (a file named in one place and written under another is a resume that misses it)."""
    from kernelguard.train.common import run_folder as f

    names = {f.RUN_FILE, f.CONFIG_FILE, f.METRICS_FILE, f.METRICS_PLOT, f.LOCK_FILE, f.FINAL_TMP}
    assert _spelled_outside(PACKAGE / "train" / "common" / "run_folder.py", names) == []


def test_a_corrected_command_is_built_only_in_its_home() -> None:
    """A refusal's pasteable fix (``kernelguard COMMAND ARGS`` with a value replaced or a flag added) is built by
    ``resolution/paste.py`` for every command; the running run's own command line (the resume line) by
    ``train/common/command_line.py``. Anywhere else, an f-string around ``shlex.join`` is a second builder whose
    quoting and rules drift from the first."""
    homes = {PACKAGE / "resolution" / "paste.py", PACKAGE / "train" / "common" / "command_line.py"}
    builders = sorted(
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py") if path not in homes
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.JoinedStr) and any(
            isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Call)
            and ast.unparse(part.value.func) == "shlex.join" for part in node.values)
    )
    assert builders == []
