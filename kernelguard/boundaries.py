"""Packed rows that reach GDN layers without example boundaries: the check, and arming it on a model.

GDN layers never infer example boundaries from position ids: the gated-delta kernels read them from
``cu_seqlens`` (transformers passes the batch's ``cu_seq_lens_q``), the causal conv from ``seq_idx``. A row
packed by its position ids alone (``DataCollatorWithFlattening()`` with its defaults, TRL's
``padding_free=True``, a hand-written concatenating collator) runs as one long sequence: recurrent state and
the conv window carry from each example into the next, and nothing raises. Attention is not the problem:
transformers recovers its boundaries from the position ids.

A :class:`BoundaryWatch` is a forward pre-hook on the model's top module (the call a collator's batch
reaches). Per call it reads the call's keyword arguments: when the batch carries ``cu_seq_lens_q`` and
``seq_idx`` and every GDN kernel accepts its one (read once, at arming, from the implementation transformers
bound), it returns after a few dict reads. Otherwise it counts the examples in each row: from
``cu_seq_lens_q``'s length (no device read), else from ``position_ids`` (one device read per forward); no
position ids, or an attention mask (a padded batch: one example per row, as transformers' own mask code
assumes), means nothing to count. More than one example in a row raises
:class:`~kernelguard.errors.PackedWithoutBoundariesError` unless the policy holds ``packed-without-boundaries``.

Under ``torch.compile`` dynamo traces the hook: which boundaries are missing is decided at trace time (dynamo
guards the graph on which keyword arguments are None), and the count runs inside the graph as the custom op
``kernelguard::check_packed_row``, so every compiled call is checked and a refusal is raised from that op.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kernelguard import transformers_calls
from kernelguard import transformers_compat as compat
from kernelguard.catalog import is_decode_only
from kernelguard.errors import PackedWithoutBoundariesError
from kernelguard.policy import PACKED_WITHOUT_BOUNDARIES, AllowPolicy
from kernelguard.registry import REGISTRY, log_once
from kernelguard.terms import PYTHON, allow_hint

__all__ = [
    "BOUNDARY_PARAMS",
    "FIX",
    "BoundaryCheck",
    "BoundaryWatch",
    "GdnBoundaries",
    "ModelCallWatch",
    "examples_per_row",
    "gdn_boundaries",
    "watch_boundaries",
]

# Kernel -> (the kernel's boundary parameter, the batch keyword transformers feeds it from).
BOUNDARY_PARAMS: dict[str, tuple[str, str]] = {
    "chunk_gated_delta_rule": ("cu_seqlens", "cu_seq_lens_q"),
    "fused_recurrent_gated_delta_rule": ("cu_seqlens", "cu_seq_lens_q"),
    "chunk_kda": ("cu_seqlens", "cu_seq_lens_q"),
    "fused_recurrent_kda": ("cu_seqlens", "cu_seq_lens_q"),
    "causal_conv1d_fn": ("seq_idx", "seq_idx"),
}
FIX = "DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True), or padding_free=False"
_OP = "kernelguard::check_packed_row"
_SEP_ROW, _SEP_FIELD = "\x1e", "\x1f"


# ---------------------------------------------------------------------------------------- static facts ---
@dataclass(frozen=True, slots=True)
class GdnBoundaries:
    """What the GDN layers of one model can be given: per batch keyword, whether every kernel fed from it
    accepts it, and why not. ``layers`` are the GDN layer paths, first one first."""

    layers: tuple[str, ...]
    # batch keyword ("cu_seq_lens_q" / "seq_idx") -> (kernel parameter, None when accepted, else the reason)
    feeds: dict[str, tuple[str, str | None]]


def _accepts(closure: compat.FallbackClosure, param: str, policy: AllowPolicy) -> str | None:
    """None when the implementation transformers calls takes ``param``; else why it does not. A torch reference
    the policy refuses counts as taking it: its tripwire refuses the call first, with the install fix."""
    hub = compat.hub_kernel(closure)
    if hub is None and closure.is_torch_reference:
        if not policy.allows_site(closure.kernel, compat.import_failure(closure).issues):
            return None
        return f"`{closure.kernel}` runs its torch reference, which ignores `{param}`"
    impl = closure.func_module.forward if hub is not None else closure.implementation
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
    if shape is None or param in shape.keywords:
        return None
    keyword = BOUNDARY_PARAMS[site.closure.kernel][1]
    if shape.spreads and keyword == param:
        return None
    return f"transformers' layer does not pass `{param}` to `{site.closure.kernel}`"


def gdn_boundaries(layers: Iterable[tuple[str, Any]], policy: AllowPolicy, *, mode: str = "training") -> GdnBoundaries:
    """The boundary facts of the GDN layers among ``layers`` ((path, module) pairs), under ``policy``."""
    paths: list[str] = []
    feeds: dict[str, tuple[str, str | None]] = {}
    for path, module in layers:
        sites = [s for s in compat.layer_global_sites(module) if s.closure.kernel in BOUNDARY_PARAMS]
        sites = [s for s in sites if mode == "inference" or not is_decode_only(s.closure.kernel)]
        if not sites:
            continue
        paths.append(path)
        for site in sites:
            param, keyword = BOUNDARY_PARAMS[site.closure.kernel]
            why = _layer_passes(site, param) or _accepts(site.closure, param, policy)
            if keyword not in feeds or (why is not None and feeds[keyword][1] is None):
                feeds[keyword] = (param, why)
    return GdnBoundaries(tuple(paths), feeds)


# -------------------------------------------------------------------------------------------- counting ---
def examples_per_row(position_ids: Any) -> list[int]:
    """Examples in each row of a batch, by where its position ids do not continue (a restart at 0, a jump).
    ``position_ids``: [B, T], or [3 or 4, B, T] (multimodal rope: the first plane is the text positions)."""
    positions = position_ids[0] if position_ids.dim() == 3 else position_ids
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.shape[-1] < 2:
        return [1] * positions.shape[0]
    starts = (positions[:, 1:] != positions[:, :-1] + 1).sum(-1) + 1
    return [int(n) for n in starts.tolist()]


# ---------------------------------------------------------------------------------------------- check ---
_CHECK_IDS = itertools.count()


class BoundaryCheck:
    """The per-call check of one model: :meth:`check_call` with the arguments of a call of its top module."""

    def __init__(self, root: Any, facts: GdnBoundaries, policy: AllowPolicy, *, syntax: str = PYTHON,
                 allow_fix: str | None = None) -> None:
        self.facts = facts
        self.policy = policy
        self.key = f"boundaries-{next(_CHECK_IDS)}"
        self._allow_fix = allow_fix or f"accept it explicitly with {allow_hint([PACKED_WITHOUT_BOUNDARIES], syntax)}"
        self._positions_at = _positional_index(root, "position_ids")
        self._mask_at = _positional_index(root, "attention_mask")
        self._op = _row_check_op()  # registered here, eagerly: dynamo cannot trace the registration
        REGISTRY.boundary_checks[self.key] = self

    def forget(self) -> None:
        REGISTRY.boundary_checks.pop(self.key, None)

    def missing(self, kwargs: dict[str, Any]) -> list[tuple[str, str]]:
        """(kernel parameter, why) for each boundary this call's GDN kernels would not get."""
        out = []
        for keyword, (param, why) in sorted(self.facts.feeds.items()):  # cu_seq_lens_q (gated delta), then seq_idx
            if kwargs.get(keyword) is None:
                out.append((param, f"the batch has no `{keyword}`"))
            elif why is not None:
                out.append((param, why))
        return out

    def check_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        missing = self.missing(kwargs)
        if not missing:
            return
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        if cu_seq_lens is not None:  # its length is a shape: no device read
            self.judge(int(cu_seq_lens.shape[-1]) - 1, "cu_seq_lens_q", missing)
            return
        positions = _argument(args, kwargs, "position_ids", self._positions_at)
        if positions is None or not hasattr(positions, "dim"):
            return
        if _argument(args, kwargs, "attention_mask", self._mask_at) is not None:
            return  # a padded batch: one example per row, as transformers' own mask code assumes
        if _is_compiling():
            self._op(positions, self.key, _SEP_ROW.join(f"{p}{_SEP_FIELD}{why}" for p, why in missing))
        else:
            self.judge(max(examples_per_row(positions)), "position_ids", missing)

    def judge(self, examples: int, source: str, missing: list[tuple[str, str]]) -> None:
        if examples <= 1:
            return
        error = self._error(examples, source, missing)
        if self.policy.allows_packed_without_boundaries():
            log_once(("packed-without-boundaries", self.key),
                     f"kernelguard: allowed ({PACKED_WITHOUT_BOUNDARIES}): {error.message}")
            return
        raise error

    def _error(self, examples: int, source: str, missing: list[tuple[str, str]]) -> PackedWithoutBoundariesError:
        layers = self.facts.layers
        first = layers[0] if layers else "<GDN layer>"
        more = f" (and {len(layers) - 1} more GDN layer{'s' if len(layers) > 2 else ''})" if len(layers) > 1 else ""
        gets = " and ".join(
            f"{'its gated-delta kernels get' if p == 'cu_seqlens' else 'its conv gets'} no `{p}` ({why})"
            for p, why in missing
        )
        message = (
            f"kernelguard: {first}{more} got a packed row of {examples} examples (by its {source}) but "
            f"{gets}: recurrent and conv state would carry from each example into the next. The results are "
            "wrong, not only slow, and nothing else raises."
        )
        return PackedWithoutBoundariesError(
            message, fix=f"{FIX}; or {self._allow_fix}", layer=first, examples=examples,
            missing=tuple(p for p, _ in missing), details={"layers": list(layers), "source": source},
        )


# ---------------------------------------------------------------------------------------------- watches ---
class BoundaryWatch:
    """The check as a pre-hook on one model's top module; ``disarm()`` (or leaving ``with``) removes it."""

    def __init__(self, root: Any, facts: GdnBoundaries, policy: AllowPolicy, *, syntax: str = PYTHON,
                 allow_fix: str | None = None) -> None:
        self.check = BoundaryCheck(root, facts, policy, syntax=syntax, allow_fix=allow_fix)
        self.key = self.check.key
        self._handle: Any = root.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        REGISTRY.boundary_watches[self.key] = self

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def _before_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.check.check_call(args, kwargs)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.check.forget()
        REGISTRY.boundary_watches.pop(self.key, None)

    def __enter__(self) -> BoundaryWatch:  # noqa: PYI034 - final in practice
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()


_WATCH_IDS = itertools.count()


class ModelCallWatch:
    """The check on every transformers model called while armed, without a model in hand (the pytest plugin):
    ``PreTrainedModel.__call__`` is wrapped; each model's GDN facts are read at its first call. ``disarm()``
    restores the original where the wrapper is still ours."""

    def __init__(self, policy: AllowPolicy, *, syntax: str = PYTHON, allow_fix: str | None = None) -> None:
        from transformers import PreTrainedModel

        self.policy = policy
        self.key = f"models-{next(_WATCH_IDS)}"
        self.depth = 0  # model calls in progress (one thread: a forward of another thread is its own)
        self._options = {"syntax": syntax, "allow_fix": allow_fix}
        self._checks: weakref.WeakKeyDictionary[Any, BoundaryCheck | None] = weakref.WeakKeyDictionary()
        self._owner = PreTrainedModel
        self._original = PreTrainedModel.__dict__.get("__call__")
        inherited = self._original or PreTrainedModel.__call__
        watch = self

        def kernelguard_boundaries_call(model: Any, *args: Any, **kwargs: Any) -> Any:
            # The outermost model call only (a causal LM calls its base model, a PreTrainedModel too).
            if watch.depth or watch._wrapper is None:  # nested, or disarmed under a later watch's wrapper
                return inherited(model, *args, **kwargs)
            check = watch.check_for(model)
            if check is not None:
                check.check_call(args, kwargs)
            watch.depth += 1
            try:
                return inherited(model, *args, **kwargs)
            finally:
                watch.depth -= 1

        self._wrapper: Any = kernelguard_boundaries_call
        PreTrainedModel.__call__ = kernelguard_boundaries_call  # type: ignore[method-assign]
        REGISTRY.boundary_watches[self.key] = self

    def check_for(self, model: Any) -> BoundaryCheck | None:
        try:
            return self._checks[model]
        except KeyError:
            pass
        except TypeError:  # an unhashable model: no check rather than a crash
            return None
        facts = gdn_boundaries(((path or type(model).__name__, m) for path, m in model.named_modules()), self.policy)
        check = BoundaryCheck(model, facts, self.policy, **self._options) if facts.layers else None
        self._checks[model] = check
        return check

    @property
    def armed(self) -> bool:
        return self._wrapper is not None

    def disarm(self) -> None:
        if self._wrapper is not None and self._owner.__dict__.get("__call__") is self._wrapper:
            if self._original is None:
                del self._owner.__call__
            else:
                self._owner.__call__ = self._original  # type: ignore[method-assign]
        self._wrapper = None
        for check in list(self._checks.values()):
            if check is not None:
                check.forget()
        self._checks = weakref.WeakKeyDictionary()
        REGISTRY.boundary_watches.pop(self.key, None)

    def __enter__(self) -> ModelCallWatch:  # noqa: PYI034 - final in practice
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()


def watch_boundaries(model: Any, policy: AllowPolicy, *, mode: str = "training", syntax: str = PYTHON,
                     allow_fix: str | None = None) -> BoundaryWatch | None:
    """Arm the check on ``model`` (its top module); None when it has no GDN layer."""
    facts = gdn_boundaries(((path or type(model).__name__, m) for path, m in model.named_modules()), policy,
                           mode=mode)
    if not facts.layers:
        return None
    return BoundaryWatch(model, facts, policy, syntax=syntax, allow_fix=allow_fix)


def _positional_index(root: Any, name: str) -> int | None:
    """Where ``name`` sits among the forward's positional parameters (after ``self``), or None."""
    try:
        names = list(inspect.signature(type(root).forward).parameters)
    except (TypeError, ValueError):
        return None
    return names.index(name) - 1 if name in names[1:] else None


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, at: int | None) -> Any:
    value = kwargs.get(name)
    if value is None and at is not None and len(args) > at:
        value = args[at]
    return value


# ------------------------------------------------------------------------------------- torch.compile ---
def _is_compiling() -> bool:
    import torch

    return bool(torch.compiler.is_compiling())


def _row_check_op() -> Any:
    """The count as a custom op: opaque to dynamo, run with the real values on every compiled call. Declared
    as mutating its input so no graph drops it when the position ids are otherwise unused; it mutates nothing.
    Registered once per process (torch's op registry is the memo)."""
    import torch

    namespace = torch.ops.kernelguard
    if hasattr(namespace, "check_packed_row"):
        return namespace.check_packed_row

    @torch.library.custom_op(_OP, mutates_args=("position_ids",),
                             schema="(Tensor(a!) position_ids, str watch, str missing) -> ()")
    def check_packed_row(position_ids: Any, watch: str, missing: str) -> None:
        found = REGISTRY.boundary_checks.get(watch)
        if found is not None:  # `missing` was decided at trace time, under the graph's guards
            pairs = [row.split(_SEP_FIELD, 1) for row in missing.split(_SEP_ROW)]
            found.judge(max(examples_per_row(position_ids)), "position_ids", [(p, why) for p, why in pairs])

    return check_packed_row


