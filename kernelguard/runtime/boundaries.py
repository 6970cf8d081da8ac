"""Packed rows whose layers cannot keep the examples apart: the check, armed where the batch is consumed.

GDN layers never infer example boundaries from position ids: the gated-delta kernels read them from
``cu_seqlens`` (transformers passes the batch's ``cu_seq_lens_q``), the causal conv from ``seq_idx``. Attention
reads ``cu_seq_lens_q`` (a varlen or flash implementation) or the restarting position ids (sdpa / eager, through
transformers' packed-mask detection, only when no attention mask and no cache is given). A row packed with a
signal missing, with signals that disagree, or with an attention implementation that cannot see the boundaries
runs as one long sequence somewhere: recurrent state, the conv window or attention carry from each example into
the next, and nothing raises.

The check guards that invariant where it is consumed: a forward pre-hook on each *decoder stack* (the module
whose ``layers`` hold the GDN and attention layers: ``model.model``, ``model.model.language_model``), so it runs
whichever entry point is called (the causal LM, ``model.model(...)`` for hidden states, a wrapper whose
``forward(batch)`` calls the model). Per call (:class:`BoundaryCheck`):

* every boundary signal present must give the same example starts (:mod:`kernelguard.runtime.segments`): position-id
  restarts, ``cu_seq_lens_q/k``, ``seq_idx``; an attention mask is a padding mask only when it masks something;
* more than one example in a row: every GDN kernel must get its boundary keyword, and the attention
  implementation must see the boundaries;
* the first packed row is also run example by example (:mod:`kernelguard.runtime.equivalence`), when enabled.

The signals are read on the first calls of each check and then on every ``RECHECK_EVERY``-th call (a device read
each; a row that lacks a keyword a GDN kernel needs is counted on every call). Refusals raise
:class:`~kernelguard.errors.PackedWithoutBoundariesError` unless the policy holds ``packed-without-boundaries``
(``attention`` accepts a slow attention, never a blind one).

Under ``torch.compile`` dynamo traces the hook: which boundaries are missing is decided at trace time (dynamo
guards the graph on which keyword arguments are None), and the count runs inside the graph as the custom op
``kernelguard::check_packed_row``, so every compiled call is checked for missing boundaries and a refusal is
raised from that op; the agreement, attention and equivalence checks run on eager calls.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

from kernelguard.resolution import PYTHON, AllowPolicy
from kernelguard.runtime.boundary_check import BoundaryCheck
from kernelguard.runtime.boundary_facts import GdnBoundaries, decoder_stacks, entry_facts, gdn_boundaries
from kernelguard.runtime.equivalence import FirstRowProbe, probing
from kernelguard.runtime.registry import REGISTRY

__all__ = ["BoundaryWatch", "ModelCallWatch", "watch_boundaries"]


# ---------------------------------------------------------------------------------------------- watches ---
class BoundaryWatch:
    """The check as a pre-hook on each decoder stack of one model (``stacks``: (path, module) pairs); ``disarm()``
    (or leaving ``with``) removes it."""

    def __init__(self, stacks: list[tuple[str, Any]], facts: GdnBoundaries, policy: AllowPolicy, *,
                 syntax: str = PYTHON, allow_fix: str | None = None, probe: bool = True,
                 entry: tuple[Any, GdnBoundaries] | None = None) -> None:
        # ``entry``: the model and its facts when its forward drops the batch's keywords before the stacks: a
        # check at its own entry too (where the boundaries are still seen), without a probe of its own
        stacks = [("", entry[0]), *stacks] if entry is not None else stacks
        self.stacks = [path for path, _ in stacks]
        self.modules = [module for _, module in stacks]
        self.checks = [BoundaryCheck(module, entry[1] if entry is not None and module is entry[0] else facts, policy,
                                     syntax=syntax, allow_fix=allow_fix) for _, module in stacks]
        self.probes: list[FirstRowProbe] = []
        for (path, module), check in zip(stacks, self.checks) if probe else ():
            if entry is not None and module is entry[0]:
                continue
            check.probe = FirstRowProbe(module, path, quiet=_silencer(check))
            self.probes.append(check.probe)
        self.check = self.checks[0]
        self.key = self.check.key
        self._handles: list[Any] = [
            module.register_forward_pre_hook(check_hook(check), with_kwargs=True)
            for (_, module), check in zip(stacks, self.checks)
        ]
        REGISTRY.boundary_watches[self.key] = self

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for check in self.checks:
            check.forget()
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

    def __init__(self, policy: AllowPolicy, *, syntax: str = PYTHON, allow_fix: str | None = None,
                 probe: bool = False) -> None:
        from transformers import PreTrainedModel

        self.policy = policy
        self.probe = probe  # the first-row probe on each model's first packed row (the plugin's option)
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
        facts = entry_facts(model, facts) or facts  # its forward drops the keywords: they never reach a layer
        check = BoundaryCheck(model, facts, self.policy, **self._options) if facts.layers else None
        if check is not None and self.probe:
            check.probe = FirstRowProbe(model, "", quiet=_silencer(check))
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


def _silencer(check: BoundaryCheck) -> Any:
    def quiet(on: bool) -> None:
        check.quiet = on

    return quiet


def check_hook(check: BoundaryCheck) -> Any:
    def before_forward(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not probing():
            check.check_call(args, kwargs)

    return before_forward


def watch_boundaries(model: Any, policy: AllowPolicy, *, mode: str = "training", syntax: str = PYTHON,
                     allow_fix: str | None = None, probe: bool = True) -> BoundaryWatch | None:
    """Arm the check on the decoder stacks of ``model``; None when it has no GDN layer. ``probe``: run the first
    packed row example by example (:class:`kernelguard.runtime.equivalence.FirstRowProbe`)."""
    named = [(path or type(model).__name__, m) for path, m in model.named_modules()]
    facts = gdn_boundaries(named, policy, mode=mode)
    if not facts.layers:
        return None
    root_name = type(model).__name__
    paths = [p.removeprefix(root_name + ".") if p.startswith(root_name + ".") else p
             for p in (*facts.layers, *facts.attention) if p != root_name]
    stacks = decoder_stacks(model, paths) if paths else [("", model)]
    entry = entry_facts(model, facts) if all(module is not model for _, module in stacks) else None
    # guard() called again on a model: the new watch replaces the old one on the same stacks (one check each)
    ours = {id(module) for _, module in stacks}
    for old in [w for w in REGISTRY.boundary_watches.values() if isinstance(w, BoundaryWatch)]:
        if ours & {id(module) for module in old.modules}:
            old.disarm()
    return BoundaryWatch(stacks, facts, policy, syntax=syntax, allow_fix=allow_fix, probe=probe,
                         entry=(model, entry) if entry is not None else None)
