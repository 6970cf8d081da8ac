"""The one place that composes live probing, provider inspection and the pure resolver."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kernelguard.errors import ConfigError
from kernelguard.resolution import (
    AllowPolicy,
    ComputeCapability,
    Environment,
    Facts,
    HubLoad,
    PackageFacts,
    Resolution,
    Target,
    catalog,
    discovery,
    offline_setting,
    parse_all,
    probe,
    probe_hub_load,
    probe_package,
    resolve,
    resolve_use_hub,
    unreachable_hub,
    with_gpus,
)

__all__ = ["CONFIG_KEYS", "CheckOptions", "CheckResult", "load_pyproject_defaults", "run_check"]

CONFIG_KEYS = {"model", "mode", "arch", "allow", "packed", "hub"}


@dataclass(frozen=True, slots=True)
class CheckOptions:
    model: str = "qwen3_5"
    mode: str = "training"
    archs: tuple[str | ComputeCapability, ...] = ()
    allow: tuple[str, ...] | AllowPolicy = ()
    packed: bool | None = None  # default: packed for training
    hub: bool | None = None  # None: what the job's plain from_pretrained does (transformers 5.25+: Hub on)
    run: bool = False
    hub_repos: bool = False  # list every Hub repository the load fetches, with its cached commit (a lock records them)
    arch_source: str = "--arch"  # where ``archs`` came from, as the report names it


@dataclass(frozen=True, slots=True)
class CheckResult:
    options: CheckOptions
    env: Environment
    resolution: Resolution
    model_origin: str
    numerics: Any | None = None  # numerics.NumericsReport
    extra_notes: tuple[str, ...] = field(default_factory=tuple)
    facts: Facts | None = None  # what the resolver decided from (the lock reads its identities)
    spec: catalog.ModelSpec | None = None

    @property
    def ok(self) -> bool:
        return self.resolution.ok and (self.numerics is None or self.numerics.ok)


def load_pyproject_defaults(start: Path | None = None) -> dict[str, Any]:
    """``[tool.kernelguard]`` of the nearest pyproject.toml, validated."""
    directory = (start or Path.cwd()).resolve()
    for folder in (directory, *directory.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return _read_tool_table(candidate)
    return {}


def _read_tool_table(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"could not read {path}: {exc}", fix=f"fix the TOML syntax in {path}") from None
    tool = data.get("tool", {})
    if not isinstance(tool, dict):
        raise ConfigError(f"`tool` in {path} must be a table, found {type(tool).__name__} {tool!r}.",
                          fix=f"write [tool.kernelguard] as a table in {path}")
    table = tool.get("kernelguard", {})
    if not isinstance(table, dict):
        raise ConfigError(f"[tool.kernelguard] in {path} must be a table, found {type(table).__name__} {table!r}.",
                          fix=f'write it as a table in {path}: [tool.kernelguard] then arch = ["9.0"]')
    unknown = sorted(set(table) - CONFIG_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in [tool.kernelguard] of {path}.",
            fix=f"use only: {', '.join(sorted(CONFIG_KEYS))}",
        )
    return _validated(table, path)


def _validated(table: dict[str, Any], path: Path) -> dict[str, Any]:
    def bad(key: str, expected: str) -> ConfigError:
        return ConfigError(
            f"[tool.kernelguard] {key} in {path} must be {expected}, found {table[key]!r}.",
            fix='see README.md, Configuration (e.g. arch = ["9.0"], allow = ["fla-640-refusal"], packed = true)',
        )

    for key in ("arch", "allow"):
        if key not in table:
            continue
        value = table[key]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad(key, "a string or a list of strings (quote numbers: \"9.0\")")
        table[key] = value
    where = f"[tool.kernelguard] in {path}"
    if "arch" in table:
        table["arch"] = [str(a) for a in parse_all(table["arch"], source=f"arch of {where}:")]
    if "allow" in table:
        AllowPolicy.parse(table["allow"], source=f"allow of {where}")
    if table.get("mode", "training") not in catalog.MODES:
        raise bad("mode", " or ".join(repr(m) for m in catalog.MODES))
    for key in ("model", "mode"):
        if key in table and not isinstance(table[key], str):
            raise bad(key, "a string")
    for key in ("packed", "hub"):
        if key in table and not isinstance(table[key], bool):
            raise bad(key, "true or false")
    if "model" in table:
        table["model"] = _model_from(table["model"], path)
    return table


def _model_from(model: str, path: Path) -> str:
    """A model path in pyproject.toml means the file's folder, wherever the command runs: relative paths are
    made absolute against it (a family name or a Hub id stays as written)."""
    written = Path(model).expanduser()
    looks_like_path = model.startswith((".", "~", "/")) or model.endswith(".json")
    resolved = written if written.is_absolute() else (path.parent / written).resolve()
    if resolved.exists():
        return str(resolved)
    if looks_like_path:
        raise ConfigError(
            f"model {model!r} in [tool.kernelguard] of {path} is {resolved} (paths there are relative to that "
            "file's folder): no such file or folder.",
            fix=f"write the model folder's path relative to {path.parent} (or an absolute one) in {path}")
    return model


def _target(options: CheckOptions, env: Environment, load: HubLoad) -> Target:
    if options.archs:
        archs = parse_all(list(options.archs))
        source = options.arch_source
    elif env.gpus:
        archs = tuple(dict.fromkeys(g.capability for g in env.gpus))
        source = "visible GPU: " + ", ".join(f"{g.index}: {g.name}" for g in env.gpus)
    else:
        archs, source = (), "no GPU visible, no --arch"
    use_hub, hub_source = resolve_use_hub(options.hub, load)
    return Target(archs=archs, arch_source=source, allow=AllowPolicy.parse(options.allow), use_hub=use_hub,
                  hub_source=hub_source)


def _probe_packages(requirements: catalog.Requirements) -> dict[str, PackageFacts]:
    wanted: dict[str, tuple[catalog.PackageSpec, str]] = {}
    for req in requirements.kernels:
        if req.package_spec is not None and req.module is not None and req.module not in wanted:
            wanted[req.module] = (req.package_spec, req.kernel)
    if requirements.needs_varlen_attention:
        wanted["flash_attn"] = (catalog.PACKAGES["flash_attn"], "flash_attn_varlen_func")
    # Compiled packages first: their import probe forks only while CUDA is uninitialised, and importing a
    # Triton package (fla reads the GPU's name at import) initialises it.
    order = sorted(wanted, key=lambda module: not wanted[module][0].compiled)
    facts = {module: probe_package(wanted[module][0], module, wanted[module][1]) for module in order}
    return {module: facts[module] for module in wanted}


def _hub_target(env: Environment, capability: ComputeCapability | None) -> Any:
    """The facts kernels' variant resolver needs, taken from our probe so --arch works without a GPU."""
    from kernelguard.resolution import HubTarget

    if env.torch_version.value is None:
        return None
    cxx11 = env.cxx11_abi.value if isinstance(env.cxx11_abi.value, bool) else True
    return HubTarget(
        torch_version=env.torch_version.value,
        cuda_version=env.cuda_version.value,
        backend=f"rocm{''.join(env.hip_version.value.split('.')[:2])}" if env.hip_version.value else None,
        cxx11_abi=cxx11,
        cpu=env.machine.value or "x86_64",
        os="linux" if env.platform.value == "linux" else str(env.platform.value),
        gpu_capability=capability.as_tuple() if capability else None,
    )


def _with_reach(load: HubLoad, requirements: catalog.Requirements, target: Target) -> HubLoad:
    """``load`` with whether the Hub answers, asked (one bounded connection) only where the job's load would
    ask it: Hub kernels on, HF_HUB_OFFLINE off, a repository that LOCAL_KERNELS does not serve."""
    from kernelguard.resolution import local_kernels_repos

    repos = {req.hub.repo_id for req in requirements.kernels if req.hub is not None} - local_kernels_repos()
    if not target.use_hub or not load.kernels_usable or not repos or offline_setting(("HF_HUB_OFFLINE",)):
        return load
    return replace(load, unreachable=unreachable_hub())


def _with_fetched(load: HubLoad, spec: catalog.ModelSpec, target: Target, *, record: bool) -> HubLoad:
    """``load`` with every repository it fetches and the commit the local cache holds for each, asked where the
    load fetches from the cache alone (HF_HUB_OFFLINE on: the ones it lacks, and the command that downloads them)
    or where a lock records them (``record``); only where kernels loads at all. A repository LOCAL_KERNELS serves
    is there, with no cached commit."""
    offline = offline_setting(("HF_HUB_OFFLINE",))
    if not target.use_hub or not load.kernels_usable or not (offline or record):
        return load
    from kernelguard.resolution import (
        SOURCE_NOT_AVAILABLE,
        FetchedHubRepo,
        download_command,
        kernels_cache_dir,
        load_repos_isolated,
        local_kernels_repos,
        probe_hub_kernel,
    )

    repos = load_repos_isolated(spec.config or {"model_type": spec.family.model_types[0]})
    if repos is None:  # the model could not be built: the per-kernel probes still say what they can
        return load
    local, fetched, missing = local_kernels_repos(), [], []
    for repo in repos:
        probe = None if repo.repo_id in local else probe_hub_kernel(
            repo.repo_id, revision=repo.revision, version=repo.version, allow_untrusted=True)
        cached = probe is not None and probe.source != SOURCE_NOT_AVAILABLE
        fetched.append(FetchedHubRepo(repo.repo_id, repo.ref, probe.revision if cached and probe else None))
        if probe is not None and not cached:
            missing.append(repo)
    load = replace(load, fetched=tuple(fetched))
    if not offline or not missing:
        return load
    # only what the cache lacks: a cached or LOCAL_KERNELS-served repository needs no download
    return replace(load, offline_missing=tuple(f"{r.repo_id} ({r.ref})" for r in missing),
                   offline_download=download_command(missing, str(kernels_cache_dir())))


def _probe_hub(requirements: catalog.Requirements, target: Target, env: Environment, load: HubLoad
               ) -> dict[str, Any]:
    if not target.use_hub:
        return {}
    latest = load.all_latest is not None  # kernels then takes the newest cached vN, as the probe does unpinned
    from kernelguard.resolution import probe_hub_kernel

    repos = {req.hub.repo_id: req.hub for req in requirements.kernels if req.hub is not None}
    probes: dict[str, Any] = {}
    for repo_id, repo in sorted(repos.items()):
        # One probe per target arch: a variant must run on every GPU the job targets, not just the first.
        for capability in target.archs or (None,):
            probe = probe_hub_kernel(
                repo_id,
                target=_hub_target(env, capability),
                allow_untrusted=target.allow.allows_untrusted_hub(),
                revision=None if latest else repo.revision,
                version=None if latest else repo.version,
                check_arch=repo.check_arch,
            )
            probes[repo_id] = probe
            if probe.chosen_variant is None or probe.note:
                break  # the first arch that fails explains the rejection
    return probes


def _check_hub_layers(requirements: catalog.Requirements, probes: dict[str, Any]) -> dict[str, Any]:
    """For each mapped op whose repository resolved to a variant: the installed kernels accepts its layer for
    the check's mode, and the layer takes transformers' call (see :mod:`kernelguard.resolution.providers.hub_layers`)."""
    from kernelguard.resolution import call_shape, check_hub_layer, reference_parameters, variant_folder

    checks: dict[str, Any] = {}
    for req in requirements.kernels:
        probe = probes.get(req.hub.repo_id) if req.hub is not None else None
        trusted = probe is not None and probe.trusted  # the variant's code runs only for a trusted repository
        folder = variant_folder(probe.location, probe.chosen_variant) if trusted else None
        shape = call_shape(requirements.family.source, req.call_site)
        if req.hub is None or folder is None or shape is None:
            continue
        checks[req.kernel] = check_hub_layer(
            req.kernel, req.hub.repo_id, req.hub.layer_name, folder, shape, packed=requirements.packed,
            training=requirements.mode == "training",
            reference=reference_parameters(requirements.family.source, req.call_site),
        )
    return checks


def _torch_has_varlen(env: Environment) -> bool:
    if env.torch_error or env.torch_version.value is None:
        return False
    try:
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except (ImportError, ValueError):
        return False


def _validate_options(options: CheckOptions) -> None:
    if options.mode not in catalog.MODES:
        raise ConfigError(f"mode must be one of {', '.join(catalog.MODES)}, found {options.mode!r}.",
                          fix="use mode='training' (or --mode inference)")
    for name in ("packed", "hub", "run"):
        value = getattr(options, name)
        if not (isinstance(value, bool) or (name in ("packed", "hub") and value is None)):
            raise ConfigError(f"{name} must be True or False, found {value!r}.", fix=f"pass {name}=True or {name}=False")
    parse_all(list(options.archs))
    AllowPolicy.parse(options.allow)


def run_check(options: CheckOptions) -> CheckResult:
    _validate_options(options)  # usage errors must not wait for the probe
    source = discovery.transformers_source()
    spec = discovery.resolve_model(options.model, source)
    packed = options.mode == "training" if options.packed is None else options.packed
    requirements = catalog.requirements(spec, options.mode, packed=packed, transformers_version=source.version)
    env = probe(read_gpus=False)  # torch imported, CUDA not yet initialised: the import probes can fork
    packages = _probe_packages(requirements)
    env = with_gpus(env)
    window = discovery.kernels_version_window(source)
    hub_load = probe_hub_load(source.root, source.version, window, env.version_of("kernels"))
    target = _target(options, env, hub_load)
    hub_load = _with_fetched(_with_reach(hub_load, requirements, target), spec, target, record=options.hub_repos)
    hub = _probe_hub(requirements, target, env, hub_load)
    facts = Facts(
        env=env,
        packages=packages,
        hub=hub,
        hub_layers=_check_hub_layers(requirements, hub),
        kernels_window=window,
        hub_load=hub_load,
        transformers_min_versions={name: discovery.transformers_min_version(name, source) for name in catalog.PACKAGES},
        torch_varlen_attention=_torch_has_varlen(env),
        fla_backends=_probe_fla_backends(requirements, packages, target, env, spec),
    )
    resolution = resolve(facts, requirements, target)
    resolution = replace(resolution, notes=(*resolution.notes, *_fla_switch_notes(resolution)))
    numerics = _run_numerics(resolution, spec, env, target) if options.run else None
    return CheckResult(options, env, resolution, spec.origin, numerics, facts=facts, spec=spec)


def _fla_switch_notes(resolution: Resolution) -> list[str]:
    """What the fla switches set here change, for the kernels fla serves (a FLA_* variable is read at import)."""
    from kernelguard.resolution import switch_notes

    served = [v.kernel for v in resolution.verdicts if v.selected is not None and v.selected.provider.startswith("fla")]
    return switch_notes(os.environ, served) if served else []


def _probe_fla_backends(requirements: catalog.Requirements, packages: dict[str, PackageFacts], target: Target,
                        env: Environment, spec: catalog.ModelSpec) -> dict[str, Any]:
    """fla's own choice of backend for the GDN op on each target arch, when fla would serve it."""
    fla = [p for p in packages.values() if p.import_name == "fla" and p.import_error is None]
    if not fla:
        return {}
    from kernelguard.resolution import fla_backend, geometry

    config = _numerics_config(spec)
    dims = geometry.gdn_dims(config) if config is not None else None
    shape = fla_backend.GdnShape(
        key_dim=dims.key_dim if dims else requirements.key_head_dim,
        value_dim=dims.value_dim if dims else None,
        num_k_heads=dims.num_k_heads if dims else None,
        num_v_heads=dims.num_v_heads if dims else None,
    )
    return fla_backend.probe(target.archs, training=requirements.mode == "training", shape=shape,
                             triton_version=env.triton_version)


def _run_numerics(resolution: Resolution, spec: catalog.ModelSpec, env: Environment, target: Target) -> Any:
    if not env.gpus:
        raise ConfigError(
            "--run executes the kernels on a GPU, and no CUDA GPU is visible here.",
            fix="run `kernelguard check --run` on a GPU node, or drop --run",
        )
    from . import numerics

    kernels = [
        v.kernel for v in resolution.verdicts if v.selected is not None and v.selected.kind == "package"
    ]
    config = _numerics_config(spec)
    # The verdict is about this model: its own geometry, plus generic layouts at its key head dim (a stack
    # that is wrong only at other head dims is the known-issue table's business, not this job's).
    shapes = numerics.shapes_for_model(config, generic=False) if config is not None else []
    key_dim = resolution.requirements.key_head_dim or (shapes[0].key_dim if shapes else None)
    shapes += [s for s in numerics.generic_shapes() if key_dim is None or s.key_dim == key_dim]
    lift = target.allow.lifts_fla_refusal
    return numerics.run_numerics(kernels, config=config, device="cuda", shapes=shapes, lift_fla_hopper_refusal=lift)


def _numerics_config(spec: catalog.ModelSpec) -> Any:
    """The model's config object: from its config.json, or the family's defaults for a bare family name."""
    from types import SimpleNamespace

    if spec.config is not None:
        return SimpleNamespace(**spec.config)
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model(spec.family.model_types[0])
    except (ImportError, ValueError):  # transformers too old for this family: generic shapes only
        return None
