"""The per-call check of one model's packed rows (:class:`BoundaryCheck`), run where a batch reaches its decoder
stack (:mod:`kernelguard.runtime.boundaries` arms it). See that module for what is checked and when."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any

from kernelguard.errors import ConfigError, PackedWithoutBoundariesError
from kernelguard.resolution import (
    BOUNDARY_KEYWORDS,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    NO_BOUNDARY_PARAM,
    PACKED_WITHOUT_BOUNDARIES,
    PYTHON,
    AllowPolicy,
    allow_hint,
)
from kernelguard.runtime.boundary_facts import GdnBoundaries, cause_of, unmendable
from kernelguard.runtime.registry import REGISTRY, log_once
from kernelguard.runtime.segments import (
    RowSegments,
    examples_per_row,
    read_segments,
    signals_disagree_on_device,
)

__all__ = ["FIRST_CALLS", "FIX", "RECHECK_EVERY", "BoundaryCheck", "attention_blind_reason"]

FIX = "DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True), or padding_free=False"
FIRST_CALLS = 8  # every signal is read on each of a check's first calls ...
RECHECK_EVERY = 64  # ... and then on every RECHECK_EVERY-th call (a few device reads each); in between, the
# signals are compared on the device at every call and the first disagreement is read back at the next read
VARLEN_NAME = "kernelguard_varlen"  # kernelguard.runtime.attention.VARLEN_NAME (that module imports transformers)
WRONG = "The results are wrong, not only slow, and nothing else raises."
_OP = "kernelguard::check_packed_row"
_SEP_ROW, _SEP_FIELD = "\x1e", "\x1f"
_CHECK_IDS = itertools.count()


def attention_blind_reason(impl: str | None, seg: RowSegments, *, mask: bool, cache: bool,
                           mask_positions: bool = True) -> tuple[str, str] | None:
    """(why attention cannot see a packed row's boundaries, the fix), or None when it can.

    ``kernelguard_varlen`` reads ``cu_seq_lens_q`` or the restarting positions, whatever the mask; a flash
    implementation does too, unless an attention mask is given (it then unpads by the mask: one sequence per
    row); sdpa, eager and the rest see a packed row only through transformers' packed-mask detection, which
    reads the position ids and runs only without an attention mask and without a cache."""
    impl = impl or "eager"
    positions = seg.by_positions is not None
    if impl == VARLEN_NAME:
        if positions or seg.by_cu_seq_lens is not None:
            return None
        return (f"{impl} reads cu_seq_lens_q or restarting position_ids, and the batch has neither",
                "pass the collator's cu_seq_lens_q/k and position_ids with the batch")
    drop_mask = "drop the attention_mask from packed batches (an all-ones mask hides the boundaries)"
    if "flash" in impl or "/" in impl:
        if mask:
            return (f"{impl} is given an attention_mask, so it unpads by the mask (one sequence per row) and "
                    "ignores cu_seq_lens_q and the position ids", drop_mask)
        if positions or seg.by_cu_seq_lens is not None:
            return None
        return (f"{impl} reads cu_seq_lens_q or the position ids, and the batch has neither",
                "pass the collator's cu_seq_lens_q/k and position_ids with the batch")
    varlen = f"or a varlen attention (attn_implementation='flash_attention_2', or '{VARLEN_NAME}')"
    if seg.by_mask is not None:  # a causal block-diagonal 4-D mask: the boundaries are in it (they agree: checked)
        return None
    if mask:
        return (f"{impl} builds its mask from the attention_mask given, which has no boundaries (all ones)",
                f"{drop_mask}, {varlen}")
    if not positions:
        return (f"{impl} finds a packed row's boundaries only in its position_ids, and the batch has none "
                "(cu_seq_lens_q is not read by it)", f"pass position_ids that restart at 0 for each example, {varlen}")
    if not mask_positions:  # transformers' packed-mask detection reads the position ids its caller hands it
        return (f"{impl} finds a packed row's boundaries only in the position_ids given to transformers' mask code, "
                "and this model builds its causal mask without them",
                f"a varlen attention (attn_implementation='flash_attention_2', or '{VARLEN_NAME}'), or padded batches")
    if cache:
        return (f"{impl} finds a packed row's boundaries in its position_ids only without a cache, and this call "
                "builds one (use_cache=True, by the keyword or the model's config)",
                "pass use_cache=False when training on packed rows (with Trainer/TRL: model.config.use_cache = "
                "False)")
    return None


class BoundaryCheck:
    """The per-call check of one model: :meth:`check_call` with the arguments of a call of its decoder stack
    (``root``: the module whose forward receives them). ``probe``: called on each packed row the check reads
    (:mod:`kernelguard.runtime.equivalence`, which measures it when what it measured last changed), with
    ``(args, kwargs, segments)``."""

    def __init__(self, root: Any, facts: GdnBoundaries, policy: AllowPolicy, *, syntax: str = PYTHON,
                 allow_fix: str | None = None, probe: Callable[[Any, Any, RowSegments], Any] | None = None) -> None:
        self.facts = facts
        self.policy = policy
        self.key = f"boundaries-{next(_CHECK_IDS)}"
        self.calls = 0
        self.probe = probe
        self.quiet = False  # while the probe itself calls the model
        self._allow_fix = allow_fix or f"accept it explicitly with {allow_hint([PACKED_WITHOUT_BOUNDARIES], syntax)}"
        self._at = {name: _positional_index(root, name) for name in ("input_ids", "position_ids", "attention_mask")}
        self._names = _positional_names(root)
        self._first_bad: Any = None  # device int: the first call whose signals disagreed since the last read
        self._config = getattr(root, "config", None)
        self._op = _row_check_op()  # registered here, eagerly: dynamo cannot trace the registration
        REGISTRY.boundary_checks[self.key] = self

    def forget(self) -> None:
        REGISTRY.boundary_checks.pop(self.key, None)

    def _builds_cache(self, kwargs: dict[str, Any]) -> bool:
        """Whether this call builds or reads a cache, as the model decides it: the keyword, else the config's
        ``use_cache`` (Qwen3.5 checkpoints ship True: a call that omits the keyword builds one)."""
        if any(kwargs.get(k) is not None for k in ("cache", "past_key_values")):
            return True
        given = kwargs.get("use_cache")
        return bool(given if given is not None else getattr(self._config, "use_cache", False))

    def missing(self, kwargs: dict[str, Any]) -> list[tuple[str, str]]:
        """(kernel parameter, why) for each boundary this call's GDN kernels would not get."""
        out = []
        for keyword, (param, why) in sorted(self.facts.feeds.items()):  # cu_seq_lens_q (gated delta), then seq_idx
            if keyword in BOUNDARY_KEYWORDS and kwargs.get(keyword) is None:  # else a kernel no keyword feeds
                out.append((param, f"the batch has no `{keyword}`"))
            elif why is not None:
                out.append((param, why))
        return out

    def check_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.quiet:
            return
        missing = self.missing(kwargs)
        positions = _argument(args, kwargs, "position_ids", self._at["position_ids"])
        mask = _argument(args, kwargs, "attention_mask", self._at["attention_mask"])
        if _is_compiling():
            self._check_compiled(positions, mask, kwargs, missing)
            return
        _check_boundary_types(kwargs)
        self.calls += 1
        if not missing and not self._due():
            self._watch(positions, kwargs, mask)
            return
        ids = _argument(args, kwargs, "input_ids", self._at["input_ids"])
        seg = read_segments(positions, {**kwargs, "input_ids": ids}, mask)
        self._read_watch(seg)
        if seg.padded:
            return  # a padded batch: one example per row, as transformers' own mask code assumes
        disagreement = seg.disagreement()
        if disagreement is not None:
            self._refuse(self._disagree_error(disagreement, seg))
            return
        packed, accepted = seg.examples > 1, False
        if packed and missing:
            accepted = self.judge(seg.examples, seg.source, missing)
        cache = self._builds_cache(kwargs)
        blind = attention_blind_reason(self.facts.attention_impl, seg, mask=mask is not None, cache=cache,
                                       mask_positions=self.facts.mask_positions) \
            if packed and self.facts.attention else None
        if blind is not None:
            accepted = self._refuse(self._attention_error(seg, *blind)) or accepted
        # Several ranks run the probe in lockstep, on their first call whatever their row: its forwards gather
        # sharded parameters (FSDP), so every rank must run as many as the others.
        lockstep = _ranks() > 1
        if self.probe is not None and (packed or lockstep):  # a row every static check passed; the probe
            # measures it when what it last measured changed (kernelguard.runtime.equivalence.probe_key)
            args, kwargs = _as_keywords(self._names, args, kwargs)  # `model.model(input_ids, **rest)` too
            error = self.probe(args, kwargs, seg, lockstep=lockstep, blind=seg.masked_packed)
            if error is not None and packed and not accepted:
                self._refuse(error)

    def _due(self) -> bool:
        return self.calls <= FIRST_CALLS or self.calls % RECHECK_EVERY == 0

    def _watch(self, positions: Any, kwargs: dict[str, Any], mask: Any) -> None:
        """Between host reads: compare the signals on the device and keep the first call that disagreed."""
        import torch

        bad = signals_disagree_on_device(positions, kwargs, mask)
        if bad is None:
            return
        call = torch.full((), self.calls, device=bad.device)  # a fill kernel: torch.tensor() would copy and sync
        first = self._first_bad if self._first_bad is not None else torch.zeros_like(call)
        self._first_bad = torch.where((first == 0) & bad, call, first)

    def _read_watch(self, seg: RowSegments) -> None:
        """At a host read: refuse for the first call since the last read whose signals disagreed."""
        first, self._first_bad = self._first_bad, None
        at = int(first) if first is not None else 0
        if at:
            self._refuse(self._disagree_error(
                f"boundary signals disagreed at its call {at} (compared on the device at every call, read back "
                f"at call {self.calls}: position_ids, cu_seq_lens_q and seq_idx marked different example starts, "
                "or cu_seq_lens_q did not end at the row's length)", seg))

    def _check_compiled(self, positions: Any, mask: Any, kwargs: dict[str, Any], missing: list[tuple[str, str]]) -> None:
        """Inside a graph: count the examples of a row that lacks a boundary (the op runs on every call)."""
        if not missing:
            return
        cu_seq_lens = kwargs.get(CU_SEQ_LENS_Q)
        if cu_seq_lens is not None:  # its length is a shape: no device read
            self.judge(int(cu_seq_lens.shape[-1]) - 1, CU_SEQ_LENS_Q, missing)
        elif positions is not None and hasattr(positions, "dim") and mask is None:
            self._op(positions, self.key, _SEP_ROW.join(f"{p}{_SEP_FIELD}{why}" for p, why in missing))

    def judge(self, examples: int, source: str, missing: list[tuple[str, str]]) -> bool:
        """Refuse a row of several examples whose GDN kernels miss a boundary; True when the policy accepted it."""
        return examples > 1 and self._refuse(self._error(examples, source, missing))

    def _refuse(self, error: PackedWithoutBoundariesError) -> bool:
        """Raise ``error``, or log it once and return True when ``packed-without-boundaries`` accepts it."""
        if self.policy.allows_packed_without_boundaries():
            log_once(("packed-without-boundaries", self.key, error.details.get("kind")),
                     f"kernelguard: allowed ({PACKED_WITHOUT_BOUNDARIES}): {error.message}")
            return True
        raise error

    def _layers(self, layers: tuple[str, ...], kind: str) -> tuple[str, str]:
        first = layers[0] if layers else f"<{kind} layer>"
        n = len(layers) - 1
        return first, f" (and {n} more {kind} layer{'s' if n > 1 else ''})" if n > 0 else ""

    def _error(self, examples: int, source: str, missing: list[tuple[str, str]]) -> PackedWithoutBoundariesError:
        first, more = self._layers(self.facts.layers, self.facts.family)
        gets = " and ".join(
            why if p in NO_BOUNDARY_PARAM else f"{self.facts.reader_words(p)} no `{p}` ({why})" for p, why in missing
        )
        message = (
            f"kernelguard: {first}{more} got a packed row of {examples} examples (by its {source}) but "
            f"{gets}: recurrent and conv state would carry from each example into the next. {WRONG}"
        )
        # A layer that never hands its kernel the boundary (Kimi-Linear's chunk_kda) is not mended by a collator.
        fix = next((f"padded batches (padding_free=False, no DataCollatorWithFlattening): {cause_of(p, why)}, "
                    "which no collator can mend" for p, why in missing if unmendable(p, why)), FIX)
        return PackedWithoutBoundariesError(
            message, fix=f"{fix}; or {self._allow_fix}", layer=first, examples=examples,
            missing=tuple(p for p, _ in missing),
            details={"layers": list(self.facts.layers), "source": source, "kind": "missing"},
        )

    def _disagree_error(self, disagreement: str, seg: RowSegments) -> PackedWithoutBoundariesError:
        first, more = self._layers(self.facts.layers or self.facts.attention,
                                   self.facts.family if self.facts.layers else "attention")
        message = (
            f"kernelguard: {first}{more} got a packed row whose {disagreement}: each layer would split the row "
            f"where its own signal says ({self.facts.splits()}, attention by cu_seq_lens_q or position_ids), so "
            f"examples run into each other. {WRONG}"
        )
        fix = ("write every boundary from the same examples with one collator: " + FIX.split(", or ")[0]
               + f" (or TRL's padding_free=True, TRL >= 1.16); or {self._allow_fix}")
        return PackedWithoutBoundariesError(
            message, fix=fix, layer=first, examples=seg.examples, missing=(),
            details={"signals": {k: list(v) for k, v in seg.signals().items()}, "kind": "disagree"},
        )

    def _attention_error(self, seg: RowSegments, why: str, fix: str) -> PackedWithoutBoundariesError:
        first, more = self._layers(self.facts.attention, "attention")
        message = (
            f"kernelguard: {first}{more} got a packed row of {seg.examples} examples (by its {seg.source}) but "
            f"cannot see where they begin: {why}. Attention would reach across examples. {WRONG}"
        )
        return PackedWithoutBoundariesError(
            message, fix=f"{fix}; or {self._allow_fix}", layer=first, examples=seg.examples, missing=("attention",),
            details={"layers": list(self.facts.attention), "impl": self.facts.attention_impl, "kind": "attention"},
        )


def _check_boundary_types(kwargs: dict[str, Any]) -> None:
    """The kernels take ``cu_seq_lens_*`` as one 1-D integer tensor; anything else fails inside them with an
    error that names neither the keyword nor the collator (a list; a ``[1, N]`` stack that
    ``default_data_collator`` makes of a per-row list)."""
    import torch

    for key in (CU_SEQ_LENS_Q, CU_SEQ_LENS_K):
        value = kwargs.get(key)
        if value is None:
            continue
        tensor = isinstance(value, torch.Tensor)
        if tensor and value.dim() == 1 and not value.is_floating_point() and not value.is_complex():
            continue
        found = (f"a {value.dim()}-D {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
                 if tensor else f"a Python {type(value).__name__}")
        one_row = tensor and value.dim() == 2 and value.shape[0] == 1
        raise ConfigError(
            f"{key} is {found}; the GDN kernels and the varlen attention take one 1-D integer tensor of the "
            "examples' start offsets in the packed row, ending with its length (e.g. [0, 10, 16, 24]). A [1, N] "
            "tensor is what default_data_collator makes of a per-row list; DataCollatorWithFlattening("
            "return_flash_attn_kwargs=True) builds the 1-D one.",
            fix=f"batch[{key!r}] = batch[{key!r}][0]" if one_row
            else f"batch[{key!r}] = torch.tensor(batch[{key!r}], dtype=torch.int32)",
        )


def _positional_names(root: Any) -> list[str]:
    """The forward's parameters that a positional argument can fill, in order (after ``self``)."""
    try:
        params = list(inspect.signature(type(root).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in itertools.takewhile(lambda p: p.kind in kinds, params)]


def _as_keywords(names: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's positional arguments as keywords, when the forward's signature names them all (chunked-loss
    trainers call ``model.model(input_ids, **rest)``); else the call as it was."""
    if not args or len(args) > len(names) or set(names[: len(args)]) & set(kwargs):
        return args, kwargs
    return (), {**dict(zip(names, args)), **kwargs}


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


def _ranks() -> int:
    """The process group's size (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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
