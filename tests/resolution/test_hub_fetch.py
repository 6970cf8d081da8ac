"""What a Hub-kernel load fetches (kernelguard.resolution.hub_fetch), and ``check`` predicting the offline load
that raises because the local cache lacks one of them: every repository, both modes, one download line."""

from __future__ import annotations

from pathlib import Path

import pytest
from check_helpers import kg_json

from kernelguard.resolution import FetchedRepo, download_command, load_repos


def _repos(tiny: object) -> list[FetchedRepo]:
    try:
        return load_repos(tiny.tiny_config("qwen3_5"))  # type: ignore[attr-defined]
    except ImportError as exc:  # transformers defines its mapping only with kernels installed (5.17)
        pytest.skip(str(exc))


def test_a_qwen3_5_load_fetches_its_gdn_and_conv_kernels_in_both_modes_and_more_for_inference(tiny: object) -> None:
    repos = {r.repo_id: r for r in _repos(tiny)}
    fla, conv = repos["kernels-community/fla"], repos["kernels-community/mamba-ssm"]
    assert "chunk_gated_delta_rule" in fla.layers and set(fla.modes) == {"inference", "training"}
    assert "causal_conv1d_fn" in conv.layers
    # what only the eval-mode load fetches: kernels' inference mapping (the recurrent decode kernel at least)
    assert any(r.modes == ("inference",) for r in repos.values()) or "fused_recurrent_gated_delta_rule" in fla.layers
    assert all(r.version is not None or r.revision for r in repos.values())


def test_the_download_line_names_each_ref_and_the_cache() -> None:
    repos = [FetchedRepo("kernels-community/fla", 3, None, ("chunk_gated_delta_rule",), ("training",)),
             FetchedRepo("org/pinned", None, "abc123", ("X",), ("inference",))]
    assert download_command(repos, "/c ache") == (
        "hf download kernels-community/fla --repo-type kernel --revision v3 --cache-dir '/c ache' && "
        "hf download org/pinned --repo-type kernel --revision abc123 --cache-dir '/c ache'")


def _cache(cache: Path, repo: FetchedRepo, commit: str = "c" * 40) -> None:
    """``repo``'s ref in kernels' cache, pointing at ``commit`` (as `hf download --revision vN` leaves it)."""
    storage = cache / f"kernels--{repo.repo_id.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / repo.ref).write_text(commit)
    (storage / "snapshots" / commit / "build" / "torch213-cxx11-cpu-x86_64-linux").mkdir(parents=True)


def test_offline_check_fails_the_load_until_every_repository_is_cached(
    tmp_path: Path, fake_providers: Path, monkeypatch: pytest.MonkeyPatch, tiny: object
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    repos = _repos(tiny)
    args = ("--model", "qwen3_5", "--hub", "--allow", "attention")
    data = kg_json(*args, cwd=tmp_path, rc=1, pythonpath=(fake_providers,))
    load = data["load_error"]
    assert load is not None and load["provider"] == "from_pretrained(use_kernels=True)"
    for repo in repos:
        assert f"{repo.repo_id} ({repo.ref})" in load["reason"]
    assert load["fix"] == download_command(repos, str(cache))
    assert load["fix_note"] == "run where the Hub is reachable; or USE_HUB_KERNELS=NO with the pip kernels"
    for repo in repos[1:]:
        _cache(cache, repo)
    one = kg_json(*args, cwd=tmp_path, rc=1, pythonpath=(fake_providers,))["load_error"]
    assert one is not None and f"lacks {repos[0].repo_id} ({repos[0].ref}): " in one["reason"]
    assert one["fix"] == download_command(repos[:1], str(cache))  # only what the cache lacks
    _cache(cache, repos[0])
    assert kg_json(*args, cwd=tmp_path, rc=0, pythonpath=(fake_providers,))["load_error"] is None


def test_online_or_without_hub_kernels_nothing_is_predicted_from_the_cache(
    tmp_path: Path, fake_providers: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "empty"))
    data = kg_json("--model", "qwen3_5", "--no-hub", "--allow", "attention", cwd=tmp_path, rc=0,
                   pythonpath=(fake_providers,))
    assert data["load_error"] is None


def test_a_lock_records_every_fetched_repository_and_refuses_a_cache_whose_branch_moved(
    tmp_path: Path, fake_providers: Path, monkeypatch: pytest.MonkeyPatch, tiny: object
) -> None:
    """A lock written with Hub kernels on (`kernelguard lock` sets hub_repos) records each repository the load
    fetches with the commit the image's cache holds; `check --lock` on a cache where one vN branch now points
    elsewhere names that repository. The real check in this process: the meta build in its child, the cache read
    where kernels reads it."""
    import json

    from kernelguard.errors import LockMismatch
    from kernelguard.stack.compose import CheckOptions, run_check
    from kernelguard.stack.stack_lock import verify_lock, write_lock

    cache = tmp_path / "cache"
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    repos = _repos(tiny)
    for repo in repos:
        _cache(cache, repo)
    image = run_check(CheckOptions(model="qwen3_5", hub=True, allow=("attention",), hub_repos=True))
    assert image.ok, image.resolution
    lock = write_lock(image, tmp_path / "kg.lock")
    recorded = json.loads(lock.read_text())["hub_repos"]
    assert recorded == [{"repo": r.repo_id, "ref": r.ref, "commit": "c" * 40} for r in repos]
    assert verify_lock(lock).ok  # the control: the image's own cache
    _cache(cache, repos[-1], commit="d" * 40)  # the branch moved and the node downloaded it again
    with pytest.raises(LockMismatch) as moved:
        verify_lock(lock)
    assert moved.value.differences == (
        f"Hub repository {repos[-1].repo_id} ({repos[-1].ref}) commit: lock says cccccccccccc, here dddddddddddd; "
        f"restore: copy the image's kernel cache ({cache}) to this node: a download of {repos[-1].ref} takes the "
        "build that branch holds now, not necessarily commit cccccccccccc",)
