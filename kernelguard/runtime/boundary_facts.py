"""What a model's layers can be given to keep a packed row's examples apart: read once, when the guard arms.

Per GDN kernel, the boundary keyword transformers feeds it (``cu_seq_lens_q`` -> ``cu_seqlens`` for the
gated-delta kernels, ``seq_idx`` for the conv) and whether the implementation transformers bound takes it; the
attention layers and their implementation; the decoder stacks where a batch's keywords reach those layers.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kernelguard.resolution import BOUNDARY_PARAMS, NO_BOUNDARY_PARAM, AllowPolicy, is_decode_only, transformers_calls
from kernelguard.resolution import transformers_compat as compat
from kernelguard.runtime.layer_guard import is_attention_layer

__all__ = [
    "BOUNDARY_PARAMS",
    "LAYER_DOES_NOT_PASS",
    "MODEL_DROPS",
    "GdnBoundaries",
    "cause_of",
    "decoder_stacks",
    "entry_facts",
    "gdn_boundaries",
    "unmendable",
]

LAYER_DOES_NOT_PASS = "transformers' layer does not pass"  # how a reason the batch cannot mend begins
MODEL_DROPS = "the model's own forward drops it"  # ... and another: the boundary never reaches the layers

# What a boundary-consuming kernel is, in a sentence's words: the layer family it serves, and the part of the
# layer that reads the boundary (a refusal names the layers by family, not as GDN whatever the model).
_FAMILY = {"chunk_gated_delta_rule": "GDN", "fused_recurrent_gated_delta_rule": "GDN", "chunk_kda": "KDA",
           "fused_recurrent_kda": "KDA", "mamba_chunk_scan_combined": "Mamba-2",
           "mamba_split_conv1d_scan_combined": "Mamba-2", "mamba_inner_fn": "Mamba", "selective_scan_fn": "Mamba"}
_PART = {"chunk_gated_delta_rule": ("gated-delta kernels",), "fused_recurrent_gated_delta_rule": ("gated-delta kernels",),
         "chunk_kda": ("KDA kernels",), "fused_recurrent_kda": ("KDA kernels",), "causal_conv1d_fn": ("conv",),
         "mamba_chunk_scan_combined": ("Mamba-2 scan",), "mamba_split_conv1d_scan_combined": ("conv", "Mamba-2 scan")}

@dataclass(frozen=True, slots=True)
class GdnBoundaries:
    """What the GDN layers of one model can be given: per batch keyword, whether every kernel fed from it
    accepts it, and why not. ``layers`` are the GDN layer paths, first one first; ``attention`` the attention
    layer paths and ``attention_impl`` their implementation (``config._attn_implementation``)."""

    layers: tuple[str, ...]
    # batch keyword ("cu_seq_lens_q" / "seq_idx") -> (kernel parameter, None when accepted, else the reason)
    feeds: dict[str, tuple[str, str | None]]
    attention: tuple[str, ...] = ()
    attention_impl: str | None = None
    # the model hands the position ids to transformers' causal-mask code (sdpa and eager see packing only there)
    mask_positions: bool = True
    # kernel parameter -> the kernels that read it, in the order the layers call them
    readers: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def family(self) -> str:
        """The layers' family in words ("GDN", "KDA", "Mamba-2", "GDN/KDA"; "conv" for short convolutions alone),
        from the kernels they call; "GDN" when the facts name no kernel."""
        families = dict.fromkeys(_FAMILY[k] for kernels in self.readers.values() for k in kernels if k in _FAMILY)
        return "/".join(families) or ("conv" if self.readers else "GDN")

    def _parts(self, param: str) -> list[str]:
        """The parts of a layer that read ``param``, in call order ("conv", "Mamba-2 scan")."""
        parts = list(dict.fromkeys(part for k in self.readers.get(param, ()) for part in _PART.get(k, ())))
        return parts or ["gated-delta kernels" if param == "cu_seqlens" else "conv"]

    def reader_words(self, param: str) -> str:
        """Who reads ``param`` and the verb, as a refusal says it: "its conv gets", "its KDA kernels get"."""
        parts = self._parts(param)
        plural = len(parts) > 1 or parts[0].endswith("s")
        return f"its {' and '.join(parts)} {'get' if plural else 'gets'}"

    def splits(self) -> str:
        """Where each boundary-reading part splits a row: "the gated-delta kernels by cu_seq_lens_q, the conv by
        seq_idx"."""
        said = [f"the {' and '.join(self._parts(param))} by {BOUNDARY_PARAMS[kernels[0]][1]}"
                for param, kernels in sorted(self.readers.items()) if kernels[0] in BOUNDARY_PARAMS]
        return ", ".join(said) or "the gated-delta kernels by cu_seq_lens_q, the conv by seq_idx"


def _accepts(closure: compat.FallbackClosure, param: str, policy: AllowPolicy) -> str | None:
    """None when the implementation transformers calls takes ``param``; else why it does not. A torch reference
    the policy refuses counts as taking it: its tripwire refuses the call first, with the install fix."""
    hub = compat.hub_func(closure)
    if hub is None and closure.is_torch_reference:
        if not policy.allows_site(closure.kernel, compat.import_failure(closure).issues):
            return None
        return f"`{closure.kernel}` runs its torch reference, which ignores `{param}`"
    impl = hub.forward if hub is not None else closure.implementation
    try:
        params = inspect.signature(impl).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it gets what the layer passes
        return None
    if param in params:
        return None
    # transformers' wrapper passes only the parameters named in the signature; a Hub layer gets every keyword.
    if hub is not None and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    where = hub or f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}"
    return f"`{closure.kernel}` -> {where} has no `{param}` parameter"


def _layer_passes(site: compat.GlobalSite, param: str) -> str | None:
    """None when the layer's call of the kernel hands it ``param`` (by name, or through ``**kwargs`` when the
    batch keyword has the same name); else why not. Read from the modeling source; unreadable: assumed passed."""
    source = getattr(sys.modules.get(site.module), "__file__", None)
    shape = transformers_calls.call_shape(source, site.name) if source else None
    keyword = BOUNDARY_PARAMS[site.closure.kernel][1]
    if shape is not None and param not in shape.keywords and not (shape.spreads and keyword == param):
        return f"{LAYER_DOES_NOT_PASS} `{param}` to `{site.closure.kernel}`"
    dropped = transformers_calls.submodule_call_drops(source, site.name, keyword) if source else None
    return f"{LAYER_DOES_NOT_PASS} `{keyword}` to `{site.closure.kernel}`: {dropped}" if dropped else None


def gdn_boundaries(layers: Iterable[tuple[str, Any]], policy: AllowPolicy, *, mode: str = "training") -> GdnBoundaries:
    """The boundary facts of the GDN and attention layers among ``layers`` ((path, module) pairs), under
    ``policy``."""
    paths: list[str] = []
    attention: list[str] = []
    impl: str | None = None
    mask_positions = True
    feeds: dict[str, tuple[str, str | None]] = {}
    readers: dict[str, tuple[str, ...]] = {}
    for path, module in layers:
        if is_attention_layer(module):
            attention.append(path)
            config = getattr(module, "config", None)
            impl = impl or str(getattr(config, "_attn_implementation", None) or "eager")
            source = getattr(sys.modules.get(type(module).__module__), "__file__", None)
            mask_positions = mask_positions and transformers_calls.mask_sees_positions(source) is not False \
                if source else mask_positions
        sites = [s for s in compat.layer_global_sites(module)
                 if s.closure.kernel in BOUNDARY_PARAMS or s.closure.kernel in NO_BOUNDARY_PARAM]
        sites = [s for s in sites if mode == "inference" or not is_decode_only(s.closure.kernel)]
        if not sites:
            continue
        paths.append(path)
        for site in sites:
            param = BOUNDARY_PARAMS.get(site.closure.kernel, (site.closure.kernel,))[0]
            if site.closure.kernel not in readers.get(param, ()):
                readers[param] = (*readers.get(param, ()), site.closure.kernel)
            if site.closure.kernel in NO_BOUNDARY_PARAM:  # keyed by its name: no batch keyword can feed it
                feeds[site.closure.kernel] = (site.closure.kernel, f"`{site.closure.kernel}` takes no boundary at "
                                              "all: its scan runs on from one packed example into the next")
                continue
            param, keyword = BOUNDARY_PARAMS[site.closure.kernel]
            why = _layer_passes(site, param) or _accepts(site.closure, param, policy)
            if keyword not in feeds or (why is not None and feeds[keyword][1] is None):
                feeds[keyword] = (param, why)
    return GdnBoundaries(tuple(paths), feeds, tuple(attention), impl, mask_positions, readers)


def unmendable(param: str, why: str) -> bool:
    """Whether no collator can give the kernel its boundary: the layer or the model drops it, or the kernel
    takes none."""
    return why.startswith((LAYER_DOES_NOT_PASS, MODEL_DROPS)) or param in NO_BOUNDARY_PARAM


def cause_of(param: str, why: str) -> str:
    """Why no collator can mend an :func:`unmendable` boundary, for the fix."""
    if why.startswith(LAYER_DOES_NOT_PASS):
        return "the model's own layer drops the boundary"
    if why.startswith(MODEL_DROPS):
        return "the model's own forward drops the boundary before its layers"
    return f"`{param}` takes no boundary"


def entry_facts(model: Any, facts: GdnBoundaries) -> GdnBoundaries | None:
    """The facts of a check at ``model``'s own entry when its ``forward`` calls its base model without passing
    the batch's keywords on (transformers' Mamba2ForCausalLM): every boundary is then dropped before the decoder
    stack, where the stack's own check sees one long sequence. None when the forward passes them on."""
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    base = getattr(model, prefix, None) if prefix else None
    if base is None or base is model:  # a base model itself: its forward hands the keywords to its layers
        return None
    source = getattr(sys.modules.get(type(model).__module__), "__file__", None)
    dropped = transformers_calls.dropped_keywords(source, type(model).__name__, prefix) if source else None
    if dropped is None or not facts.feeds:
        return None
    feeds = {k: (p, why if k in NO_BOUNDARY_PARAM else f"{MODEL_DROPS}: {dropped}") for k, (p, why) in facts.feeds.items()}
    return replace(facts, feeds=feeds)


_LAYER_INDEX = re.compile(r"\.\d+(?:\.|$)")


def decoder_stacks(model: Any, paths: Iterable[str]) -> list[tuple[str, Any]]:
    """The modules whose numbered ``layers`` hold ``paths`` (``model.layers.3.linear_attn`` -> ``model``): where a
    batch's position ids, mask and boundary keywords reach every GDN and attention layer, whichever entry point
    was called. ``model`` itself when a path has no numbered layer (a bare layer was guarded)."""
    found: dict[str, Any] = {}
    for path in paths:
        match = _LAYER_INDEX.search(path)
        if match is None:
            return [("", model)]
        holder = path[: match.start()].rsplit(".", 1)[0] if "." in path[: match.start()] else ""
        if holder not in found:
            try:
                found[holder] = model.get_submodule(holder) if holder else model
            except AttributeError:  # a path named after the root's class: the root holds the layers
                found[holder] = model
    return list(found.items()) or [("", model)]
