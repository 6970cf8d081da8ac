"""What serves each kernel on this stack, and why: the facts probed, the kernel table, the pure resolver, the fixes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernelguard import lazy_face

__all__ = [
    "ACCEPTED",
    "ALLOWED",
    "ALL_LATEST_VAR",
    "ATTENTION",
    "BOUNDARY_KEYWORDS",
    "CLI",
    "CU_SEQ_LENS_K",
    "CU_SEQ_LENS_Q",
    "DISTRIBUTION",
    "FALLBACK",
    "FLA_1077_GRID_LIMIT",
    "FLA_REFUSAL_FLAG",
    "HUB",
    "IGNORE_INDEX",
    "KNOWN_ISSUES",
    "MAX_LENGTH_K",
    "MAX_LENGTH_Q",
    "MODES",
    "OFFLINE_VARIABLES",
    "PACKAGE",
    "PACKAGES",
    "PACKED_REFERENCE",
    "PACKED_WITHOUT_BOUNDARIES",
    "POLICY_ITEMS",
    "PYTHON",
    "REFERENCE",
    "REJECTED",
    "SEARCH_CACHE_VARIABLE",
    "SELECTED",
    "SEQ_IDX",
    "SKIPPED",
    "VARLEN_ATTENTION",
    "AllowPolicy",
    "ComputeCapability",
    "Decision",
    "Environment",
    "Facts",
    "GdnDims",
    "HubLoad",
    "HubTarget",
    "PackageFacts",
    "Resolution",
    "Target",
    "allow_hint",
    "attention_dims",
    "boundary_arguments",
    "by_id",
    "call_shape",
    "call_sites",
    "catalog",
    "check_hub_layer",
    "command_lines",
    "corrected_command",
    "dangling_link",
    "discovery",
    "distribution_version",
    "estimated_params",
    "extra_command",
    "family_of_model_type",
    "field",
    "file_kind",
    "fix_alternatives",
    "fla_autotuners",
    "fla_backend",
    "fla_backend_command",
    "delta_rule_dims",
    "gdn_dims",
    "kda_dims",
    "geometry",
    "hub_endpoint",
    "hub_wrapper",
    "in_terms",
    "is_command",
    "is_decode_only",
    "keep_search_results",
    "kernels_funcs",
    "kernels_version_window",
    "layer_types",
    "lift_fla_hopper_refusal",
    "lift_for_accepted_issues",
    "load_pins",
    "offline_setting",
    "option_hint",
    "parse_all",
    "pin_command",
    "pin_for_this_gpu",
    "probe",
    "local_kernels_repos",
    "probe_hub_kernel",
    "probe_hub_load",
    "probe_package",
    "reference_parameters",
    "resolve",
    "resolve_use_hub",
    "saved_dataset",
    "search_note",
    "split_fix",
    "text_config",
    "transformers_calls",
    "transformers_compat",
    "transformers_source",
    "unreachable_hub",
    "usage_suggestion",
    "variant_folder",
    "with_corrected_command",
    "with_gpus",
    "with_value_replaced",
]

# Each module of this room and the names it offers the rest of kernelguard, loaded on first use.
_OFFERS = {
    "capability": ("ComputeCapability", "parse_all"),
    "catalog": ("is_decode_only", "MODES", "PACKAGES", "PACKED_REFERENCE", "VARLEN_ATTENTION"),
    "decisions": (
        "ACCEPTED",
        "ALLOWED",
        "Decision",
        "FALLBACK",
        "fix_alternatives",
        "HUB",
        "PACKAGE",
        "REFERENCE",
        "REJECTED",
        "SELECTED",
        "SKIPPED",
        "split_fix",
    ),
    "discovery": ("kernels_version_window", "transformers_source"),
    "env": ("distribution_version", "Environment", "probe", "with_gpus"),
    "facts": ("Facts", "HubLoad", "HubTarget"),
    "file_kinds": ("dangling_link", "file_kind", "saved_dataset"),
    "fla_autotune": (
        "fla_autotuners",
        "keep_search_results",
        "load_pins",
        "pin_for_this_gpu",
        "SEARCH_CACHE_VARIABLE",
        "search_note",
    ),
    "fla_refusal": ("FLA_REFUSAL_FLAG", "lift_fla_hopper_refusal", "lift_for_accepted_issues"),
    "geometry": (
        "attention_dims",
        "delta_rule_dims",
        "estimated_params",
        "field",
        "gdn_dims",
        "GdnDims",
        "kda_dims",
        "layer_types",
        "text_config",
    ),
    "hub_load": ("ALL_LATEST_VAR", "probe_hub_load", "resolve_use_hub"),
    "hub_reach": ("OFFLINE_VARIABLES", "hub_endpoint", "offline_setting", "unreachable_hub"),
    "install": ("DISTRIBUTION", "extra_command", "fla_backend_command", "pin_command"),
    "known_issues": ("by_id", "FLA_1077_GRID_LIMIT", "KNOWN_ISSUES"),
    "packed_batch": (
        "BOUNDARY_KEYWORDS",
        "boundary_arguments",
        "CU_SEQ_LENS_K",
        "CU_SEQ_LENS_Q",
        "IGNORE_INDEX",
        "MAX_LENGTH_K",
        "MAX_LENGTH_Q",
        "SEQ_IDX",
    ),
    "paste": ("command_lines", "corrected_command", "is_command", "with_corrected_command", "with_value_replaced"),
    "policy": ("AllowPolicy", "ATTENTION", "PACKED_WITHOUT_BOUNDARIES", "POLICY_ITEMS"),
    "providers.hub": ("local_kernels_repos", "probe_hub_kernel"),
    "providers.hub_layers": ("check_hub_layer", "variant_folder"),
    "providers.installed": ("PackageFacts", "probe_package"),
    "resolver": ("Resolution", "resolve", "Target"),
    "terms": ("allow_hint", "CLI", "in_terms", "option_hint", "PYTHON", "usage_suggestion"),
    "transformers_calls": ("call_shape", "reference_parameters"),
    "transformers_compat": ("call_sites", "family_of_model_type", "hub_wrapper"),
}

__getattr__ = lazy_face(__name__, _OFFERS)

if TYPE_CHECKING:
    from .capability import ComputeCapability, parse_all
    from .catalog import MODES, PACKAGES, PACKED_REFERENCE, VARLEN_ATTENTION, is_decode_only
    from .decisions import (
        ACCEPTED,
        ALLOWED,
        FALLBACK,
        HUB,
        PACKAGE,
        REFERENCE,
        REJECTED,
        SELECTED,
        SKIPPED,
        Decision,
        fix_alternatives,
        split_fix,
    )
    from .discovery import kernels_version_window, transformers_source
    from .env import Environment, distribution_version, probe, with_gpus
    from .facts import Facts, HubLoad, HubTarget
    from .file_kinds import dangling_link, file_kind, saved_dataset
    from .fla_autotune import (
        SEARCH_CACHE_VARIABLE,
        fla_autotuners,
        keep_search_results,
        load_pins,
        pin_for_this_gpu,
        search_note,
    )
    from .fla_refusal import FLA_REFUSAL_FLAG, lift_fla_hopper_refusal, lift_for_accepted_issues
    from .geometry import (
        GdnDims,
        attention_dims,
        delta_rule_dims,
        estimated_params,
        field,
        gdn_dims,
        kda_dims,
        layer_types,
        text_config,
    )
    from .hub_load import ALL_LATEST_VAR, probe_hub_load, resolve_use_hub
    from .hub_reach import OFFLINE_VARIABLES, hub_endpoint, offline_setting, unreachable_hub
    from .install import DISTRIBUTION, extra_command, fla_backend_command, pin_command
    from .known_issues import FLA_1077_GRID_LIMIT, KNOWN_ISSUES, by_id
    from .packed_batch import (
        BOUNDARY_KEYWORDS,
        CU_SEQ_LENS_K,
        CU_SEQ_LENS_Q,
        IGNORE_INDEX,
        MAX_LENGTH_K,
        MAX_LENGTH_Q,
        SEQ_IDX,
        boundary_arguments,
    )
    from .paste import (
        command_lines,
        corrected_command,
        is_command,
        with_corrected_command,
        with_value_replaced,
    )
    from .policy import ATTENTION, PACKED_WITHOUT_BOUNDARIES, POLICY_ITEMS, AllowPolicy
    from .providers.hub import local_kernels_repos, probe_hub_kernel
    from .providers.hub_layers import check_hub_layer, variant_folder
    from .providers.installed import PackageFacts, probe_package
    from .resolver import Resolution, Target, resolve
    from .terms import CLI, PYTHON, allow_hint, in_terms, option_hint, usage_suggestion
    from .transformers_calls import call_shape, reference_parameters
    from .transformers_compat import call_sites, family_of_model_type, hub_wrapper
