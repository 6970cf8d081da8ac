"""transformers installed but not importable (a broken dependency): `check` fails on it and `env` says so.

kernelguard reads transformers' files without importing it, so without an import probe a broken dependency
passed `check` while every job stopped at its first line. The breakage here is real: a `huggingface_hub` that
raises on import, first on PYTHONPATH, as a half-finished upgrade leaves it; the control runs without it.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from check_helpers import ALLOW_ALL, kg, kg_json

REPO = Path(__file__).resolve().parents[2]
TRANSFORMERS = metadata.version("transformers")
BROKEN = "ImportError: huggingface_hub is half-upgraded (made for this test)"


def _broken_dependency(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    (site / "huggingface_hub").mkdir(parents=True)
    message = BROKEN.split(": ", 1)[1]
    (site / "huggingface_hub" / "__init__.py").write_text(f"raise ImportError({message!r})\n")
    return site


def test_check_fails_on_the_import_and_gives_the_reinstall(tmp_path: Path) -> None:
    data = kg_json(*ALLOW_ALL, "--no-packed", cwd=tmp_path, rc=1, pythonpath=(_broken_dependency(tmp_path), REPO))
    load = data["load_error"]
    assert (load["provider"], load["status"]) == ("import transformers", "rejected")
    assert load["reason"] == (f"importing transformers {TRANSFORMERS} fails, so every job stops at its first "
                              f"line: {BROKEN}")
    assert load["fix"] == f"pip install --force-reinstall 'transformers=={TRANSFORMERS}'"
    assert data["environment"]["transformers_error"] == BROKEN


def test_the_same_check_passes_with_the_dependency_intact(tmp_path: Path) -> None:
    data = kg_json(*ALLOW_ALL, "--no-packed", cwd=tmp_path, rc=0, pythonpath=(REPO,))
    assert data["load_error"] is None and data["environment"]["transformers_error"] is None


def test_env_names_the_failing_import(tmp_path: Path) -> None:
    proc = kg("env", cwd=tmp_path, pythonpath=(_broken_dependency(tmp_path), REPO))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("- transformers:"))
    assert line.endswith(f"; import fails: {BROKEN}"), line
