"""Every config and code snippet in README.md and docs/*.md parses, and the config snippets are accepted by the
reader that will consume them: TOML with tomllib, YAML with yaml.safe_load, JSON with json.loads, INI with
configparser (a section header required: a header-less fragment cannot be pasted anywhere as is), Python with
ast.parse. `[tool.kernelguard]` goes through kernelguard.stack.compose.load_pyproject_defaults, pytest settings
(`[pytest]`, `[tool.pytest.ini_options]`) through a real pytest run with the plugin, `kernelguard train` config
files through its own --config reader. Also: .ci/run runs exactly the README's test command."""

from __future__ import annotations

import ast
import configparser
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
CONFIG_LANGS = {"toml", "yaml", "yml", "json", "ini", "cfg", "python", "py"}
TEST_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[train,dev]' && .venv/bin/python -m pytest -q -n auto --maxprocesses 4"
MAIN_COMMAND_PREFIX = "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[train,dev]' && .venv/bin/kernelguard check"


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}:{self.lang}"


def snippets(paths: list[Path] = DOCS) -> list[Snippet]:
    found = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            found.append(Snippet(path, text.count("\n", 0, m.start()) + 1, m.group(1).lower(), m.group(2)))
    return found


def parse_problem(lang: str, text: str) -> str | None:
    """Why this snippet would not parse as what its fence says it is (None: it parses)."""
    try:
        if lang == "toml":
            tomllib.loads(text)
        elif lang in ("yaml", "yml"):
            yaml.safe_load(text)
        elif lang == "json":
            json.loads(text)
        elif lang in ("ini", "cfg"):
            configparser.ConfigParser(interpolation=None).read_string(text)
        elif lang in ("python", "py"):
            ast.parse(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError, configparser.Error, SyntaxError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


CONFIG_SNIPPETS = [s for s in snippets() if s.lang in CONFIG_LANGS]


def test_the_docs_have_config_snippets_to_check() -> None:
    langs = {s.lang for s in CONFIG_SNIPPETS}
    assert {"toml", "yaml", "json", "ini", "python"} <= langs, langs
    # No config shown in an unlabelled fence: those are never parsed, so a broken one would slip through.
    for s in snippets():
        if s.lang == "":
            assert not re.search(r"^\[(tool\.|pytest\])", s.text, re.MULTILINE), f"{s.id}: label this fence (toml/ini)"


@pytest.mark.parametrize("snippet", CONFIG_SNIPPETS, ids=lambda s: s.id)
def test_snippet_parses(snippet: Snippet) -> None:
    problem = parse_problem(snippet.lang, snippet.text)
    assert problem is None, f"{snippet.id}: {problem}\n{snippet.text}"


# The README's `[tool.pytest.ini_options]` snippet before this test existed: an ini-style fragment offered for
# pyproject.toml. Pasted into pyproject.toml it is "Invalid value (at line 3, column 20)"; the checks above must
# reject it in either labelling.
OLD_PYTEST_SNIPPET = "kernelguard = true\nkernelguard_allow =\n    causal_conv1d_fn\n    chunk_gated_delta_rule\n"


def test_the_old_invalid_pytest_snippet_would_have_been_caught() -> None:
    assert parse_problem("ini", OLD_PYTEST_SNIPPET) is not None  # no section header
    pasted = "[tool.pytest.ini_options]\n" + OLD_PYTEST_SNIPPET
    problem = parse_problem("toml", pasted)
    assert problem is not None and "line 3, column 20" in problem, problem


def _tables(lang: str, text: str) -> set[str]:
    return set(re.findall(r"^\[([^\]\n]+)\]", text, re.MULTILINE)) if lang in ("toml", "ini", "cfg") else set()


KERNELGUARD_TOML = [s for s in CONFIG_SNIPPETS if s.lang == "toml" and "tool.kernelguard" in _tables(s.lang, s.text)]
PYTEST_CONFIGS = [
    s for s in CONFIG_SNIPPETS
    if {"pytest", "tool.pytest.ini_options"} & _tables(s.lang, s.text)
]  # fmt: skip
TRAIN_CONFIGS = [s for s in CONFIG_SNIPPETS if s.path.name == "train.md" and s.lang in ("yaml", "toml", "json")]


def test_the_validated_kinds_are_all_present() -> None:
    assert KERNELGUARD_TOML and TRAIN_CONFIGS
    assert {s.lang for s in PYTEST_CONFIGS} >= {"ini", "toml"}


@pytest.mark.parametrize("snippet", KERNELGUARD_TOML, ids=lambda s: s.id)
def test_tool_kernelguard_snippet_is_read_by_check(snippet: Snippet, tmp_path: Path) -> None:
    from kernelguard.stack.compose import load_pyproject_defaults

    (tmp_path / "pyproject.toml").write_text(snippet.text)
    defaults = load_pyproject_defaults(tmp_path)
    assert defaults, f"{snippet.id}: [tool.kernelguard] read as empty"
    assert set(defaults) >= set(tomllib.loads(snippet.text)["tool"]["kernelguard"]) - {"allow"}


PROBE_CONFTEST = """
import json
def pytest_configure(config):
    print("KG_INI=" + json.dumps([config.getini("kernelguard"), list(config.getini("kernelguard_allow"))]))
"""


@pytest.mark.slow  # one short pytest subprocess per snippet (collection only, no torch import)
@pytest.mark.parametrize("snippet", PYTEST_CONFIGS, ids=lambda s: s.id)
def test_pytest_snippet_configures_the_plugin(snippet: Snippet, tmp_path: Path) -> None:
    name = "pytest.ini" if snippet.lang == "ini" else "pyproject.toml"
    (tmp_path / name).write_text(snippet.text)
    (tmp_path / "conftest.py").write_text(PROBE_CONFTEST)
    (tmp_path / "test_probe.py").write_text("def test_probe():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "--co", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-p", "kernelguard.integrations.pytest_plugin"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    if "Plugin already registered" in proc.stderr + proc.stdout:  # the entry point loaded it already
        cmd = cmd[:-2]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"{snippet.id}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert "PytestConfigWarning" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("KG_INI="))
    enabled, allow = json.loads(line[len("KG_INI="):])
    assert enabled is True, f"{snippet.id}: kernelguard not enabled"
    expected = re.findall(r"\b(causal_conv1d_fn|chunk_gated_delta_rule)\b", snippet.text)
    assert allow == expected, (snippet.id, allow)


@pytest.mark.parametrize("snippet", TRAIN_CONFIGS, ids=lambda s: s.id)
def test_train_config_snippet_is_read_by_kernelguard_train(snippet: Snippet, tmp_path: Path) -> None:
    from kernelguard.train.settings.config_cli import parse_command

    path = tmp_path / f"run.{snippet.lang}"
    path.write_text(snippet.text)
    cfg = parse_command(["--config", str(path)]).config
    values = tomllib.loads(snippet.text) if snippet.lang == "toml" else yaml.safe_load(snippet.text)
    flags = cfg.flags()
    assert flags["model"] == values["model"] and str(flags["output_dir"]) == values["output_dir"]
    assert flags["max_length"] == values["max_length"]
    assert flags["learning_rate"] == pytest.approx(values["learning_rate"])
    assert flags["allow"] == tuple(values["allow"])


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND in readme, "README.md lost its test command line"
    assert TEST_COMMAND in ci, ".ci/run no longer runs the README's test command byte for byte"
    assert any(line.startswith(MAIN_COMMAND_PREFIX) for line in readme), "README.md lost its main-job command"


def test_doc_links_point_at_files_that_exist() -> None:
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to missing {target}"


def test_bench_paths_named_in_docs_exist() -> None:
    for path in [*DOCS, ROOT / "bench" / "RESULTS.md", ROOT / "bench" / "gpu" / "README.md"]:
        for target in re.findall(r"\bbench/(?:cpu|gpu|lib)/[\w./-]+\.(?:py|sh)\b", path.read_text()):
            assert (ROOT / target).exists(), f"{path.relative_to(ROOT)} names missing {target}"


def test_check_run_timings_quoted_in_docs_are_the_measured_range() -> None:
    """Every `check --run` cold/warm figure in the docs and docker/README.md is the range bench/RESULTS.md
    derives from its measurements, so two pages cannot tell a user different times again."""
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    measured = re.search(r"the range\s+quoted in docs is \*\*(\d+-\d+) s cold, (\d+-\d+) s warm\*\*", results)
    assert measured, "bench/RESULTS.md no longer states the check --run range the docs quote"
    quoted = []
    for path in [*DOCS, ROOT / "docker" / "README.md"]:
        text = re.sub(r"\s+", " ", path.read_text().replace("\n#", " "))
        quoted += [(path.name, kind, value) for value, kind in re.findall(r"(\d+(?:[.-]\d+)?) s (cold|warm)\b", text)]
    assert {kind for _, kind, _ in quoted} == {"cold", "warm"}, quoted
    assert [q for q in quoted if q[2] != measured.group(1 if q[1] == "cold" else 2)] == []


_GUARD_EXAMPLE = """
import sys
sys.path.insert(0, {tests!r})
import tiny_models, kernelguard
model = tiny_models.tiny_model("qwen3_5", num_hidden_layers=48,
                               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12)
report = kernelguard.inspect(model, mode="training", packed=False,
                             allow=["chunk_gated_delta_rule", "causal_conv1d_fn"])
print(report.render())
"""


def test_the_guard_report_in_the_docs_is_what_inspect_renders() -> None:
    """docs/guard.md's example is produced here, in a process with no GDN package importable (CPU, as the page
    says); only the transformers version may differ (CI runs two)."""
    doc = ROOT / "docs" / "guard.md"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"COLUMNS": "100", "PYTHONPATH": str(ROOT),
                                                                        "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", _GUARD_EXAMPLE.format(tests=str(ROOT / "tests"))], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    actual = "```text\n" + proc.stdout + "```\n"
    marked = re.compile(r"(<!-- guard-output -->\n)(.*?)(<!-- /guard-output -->)", re.DOTALL)
    if os.environ.get("KERNELGUARD_UPDATE_GOLDEN"):
        doc.write_text(marked.sub(lambda m: m.group(1) + actual + m.group(3), doc.read_text()))
    found = marked.search(doc.read_text())
    assert found is not None, "docs/guard.md lost its <!-- guard-output --> block"
    version = re.compile(r"transformers \d+\.\d+\.\d+\S*")
    assert version.sub("transformers X", found.group(2)) == version.sub("transformers X", actual), (
        "regenerate with KERNELGUARD_UPDATE_GOLDEN=1 pytest tests/project/test_docs_snippets.py")
    assert len([line for line in actual.splitlines() if line.endswith(" layers")]) == 5


def test_the_version_the_tool_reports_is_the_changelogs_and_the_schema_pages() -> None:
    """`kernelguard --version`, CHANGELOG's newest heading and docs/json-schema.md name the same release."""
    import re

    import kernelguard

    repo = Path(__file__).resolve().parents[2]
    release = kernelguard.__version__.split(".dev")[0]
    heading = re.search(r"^## (\S+)", (repo / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert heading is not None and heading.group(1) == release, (heading, kernelguard.__version__)
    assert f"Version 2 ({release}; a checkout of main reports `{kernelguard.__version__}`)" in " ".join(
        (repo / "docs" / "json-schema.md").read_text().split())
