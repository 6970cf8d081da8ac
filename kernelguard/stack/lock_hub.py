"""The Kernel Hub repositories a lock records: every one the job's load fetches (both modes), the ref kernels asks
for and the commit the image's cache holds for it.

kernels resolves a version to its ``vN`` branch, and a branch moves: a node whose cache holds another commit of
the same ``vN`` runs another build than the image verified, with every version the lock pins unchanged. So the
commit is compared wherever the lock has one; copying the image's cache restores it (a fresh download takes
whatever the branch holds now).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["hub_repo_differences", "hub_repo_entries"]

# (what, the lock's value, this node's value, the fix): stack_lock makes each one a Difference
Found = tuple[str, str, str, str]


def hub_repo_entries(result: Any) -> list[dict[str, Any]] | None:
    """What the lock records of ``result``'s Hub load; None where the check did not list it (Hub kernels off,
    kernels unusable, or the model could not be built to ask)."""
    fetched = getattr(getattr(result.facts, "hub_load", None), "fetched", None)
    if not result.resolution.target.use_hub or fetched is None:
        return None
    return [{"repo": r.repo_id, "ref": r.ref, "commit": r.commit} for r in fetched]


def hub_repo_differences(locked: Sequence[Mapping[str, Any]] | None, here: Sequence[Mapping[str, Any]] | None,
                         *, transformers: str | None, cache_dir: str) -> list[Found]:
    """Every repository whose ref or cached commit differs; nothing where either side did not list them (a lock
    written with the Hub off or by an older kernelguard, or a node that cannot load Hub kernels: its kernels line
    says so)."""
    if locked is None or here is None:
        return []
    had, has = {e["repo"]: e for e in locked}, {e["repo"]: e for e in here}
    pin = f"pip install 'transformers=={transformers}'" if transformers else "install the image's transformers"
    why = f"(transformers' kernel mapping and the model's layers decide what the load fetches): {pin}"
    out: list[Found] = []
    for repo in sorted(set(had) | set(has)):
        a, b = had.get(repo), has.get(repo)
        if a is None or b is None or a["ref"] != b["ref"]:
            out.append((f"Hub repository {repo}", _fetched(a), _fetched(b), why))
        elif a.get("commit") and a.get("commit") != b.get("commit"):
            out.append((
                f"Hub repository {repo} ({a['ref']}) commit", str(a["commit"])[:12],
                str(b["commit"])[:12] if b.get("commit") else "not in the kernel cache",
                (f"copy the image's kernel cache ({cache_dir}) to this node: a download of {a['ref']} takes the "
                 f"build that branch holds now, not necessarily commit {str(a['commit'])[:12]}")))
    return out


def _fetched(entry: Mapping[str, Any] | None) -> str:
    return f"fetched at {entry['ref']}" if entry is not None else "not fetched"
