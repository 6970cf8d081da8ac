"""The export's tensors streamed to disk: a writer thread writes this rank's files while the caller fetches
(gathers, or reads from a checkpoint) the next tensors, at most ``IN_FLIGHT`` bytes held between fetch and disk.

Used by :mod:`kernelguard.train.output.export`; the tensors are its ``OutTensor`` rows (name, shape, dtype, key,
carried, nbytes). A collective fetch (the live FSDP2 model's gathers) is made by every rank for every trained
tensor in the same order, :func:`feed`'s; only the rank that writes a tensor keeps it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["IN_FLIGHT", "Gathered", "feed", "held_in_fp32", "stream_files"]

# Export bytes a rank holds on the host between fetching a tensor and having written it: enough for the writer
# thread to stream one tensor while the next is fetched; a larger tensor is fetched alone.
IN_FLIGHT = 1 << 30


def held_in_fp32(model: Any) -> frozenset[str]:
    """State-dict keys of the parameters FSDP2 computes in fp32 while it computes others in a lower precision
    (Qwen3.5's ``A_log`` / ``dt_bias`` in a bf16 run): the export keeps them fp32. Empty for a model that
    computes in one dtype, or that FSDP2 does not manage."""
    names = {id(m): n for n, m in model.named_modules()}
    compute: dict[str, torch.dtype] = {}
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            info = fsdp_param._module_info
            name = ".".join(filter(None, (names.get(id(info.module)), info.param_name)))
            for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):  # as get_model_state_dict names it
                name = name.replace(wrapper, "")
            held = fsdp_param.sharded_param.dtype
            wanted = getattr(group.mp_policy, "param_dtype", None)  # FSDP2 casts floating parameters only
            compute[name] = wanted if wanted is not None and held.is_floating_point else held
    if not any(d.is_floating_point and d.itemsize < 4 for d in compute.values()):
        return frozenset()
    return frozenset(k for k, d in compute.items() if d == torch.float32)


class Gathered:
    """Full tensors of the live FSDP2 model: each trained tensor cast to its export dtype on every rank's shard,
    then gathered whole (a collective: every rank asks for every trained tensor, in the same order, and only
    the rank that writes it keeps it); carried ones from the source safetensors."""

    collective = True

    def __init__(self, state: dict[str, Any], plan: Any, read_carried: Callable[[Any, Any], torch.Tensor]) -> None:
        self.state, self.plan, self.read_carried = state, plan, read_carried

    def __call__(self, t: Any, keep: bool = True) -> torch.Tensor | None:
        if t.carried:
            return self.read_carried(self.plan, t)
        value = self.state[t.key].detach().to(t.dtype)  # elementwise: cast-then-gather == gather-then-cast
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        return full.cpu() if keep else None


class _Abort(Exception):
    """The fetching thread stopped: the writer thread stops too."""


class _WriteBehind:
    """This rank's files, written by one thread while the caller fetches the next tensors: ``put`` each trained
    tensor of the files, in their order; carried ones the thread reads itself. At most ``budget`` bytes (or one
    tensor) are held between fetch and the end of their write; after a write error ``reserve`` says no, so that
    a collective fetch keeps pace with the other ranks, and ``close`` raises that error."""

    def __init__(self, files: list[tuple[Path, list[Any]]], source: Any, write: Callable[..., None],
                 budget: int) -> None:
        self.files, self.source, self.write, self.budget = files, source, write, budget
        self.queue: list[torch.Tensor] = []
        self.held = 0
        self.writing: Any | None = None
        self.error: BaseException | None = None
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="kernelguard-export-writer", daemon=True)
        self.thread.start()

    def reserve(self, nbytes: int) -> bool:
        """Wait until ``nbytes`` more fit (at once when nothing is held); False once writing has failed."""
        with self.cond:
            self.cond.wait_for(lambda: self.stopped or self.held == 0 or self.held + nbytes <= self.budget)
            if self.stopped:
                return False
            self.held += nbytes
            return True

    def put(self, value: torch.Tensor) -> None:
        with self.cond:
            self.queue.append(value)
            self.cond.notify_all()

    def _written(self) -> None:
        with self.cond:
            if self.writing is not None:
                self.held -= self.writing.nbytes
                self.writing = None
                self.cond.notify_all()

    def _fetch(self, t: Any) -> torch.Tensor:
        self._written()  # write_safetensors asks for the next tensor once the previous one is on disk
        if t.carried:
            return self.source(t)
        with self.cond:
            self.cond.wait_for(lambda: bool(self.queue) or self.stopped)
            if not self.queue:
                raise _Abort
            self.writing = t
            return self.queue.pop(0)

    def _run(self) -> None:
        try:
            for path, tensors in self.files:
                self.write(path, tensors, self._fetch)
                self._written()
        except _Abort:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the fetching thread by close()
            self.error = e
        with self.cond:
            self.stopped = True
            self.queue.clear()
            self.cond.notify_all()

    def close(self, *, abort: bool = False) -> None:
        if abort:
            with self.cond:
                self.stopped = True
                self.cond.notify_all()
        self.thread.join()
        if self.error is not None and not abort:
            raise self.error


def feed(shards: list[list[Any]], world: int) -> Iterator[tuple[Any, int]]:
    """Every trained tensor with the rank that writes it, the ranks' streams interleaved by bytes so that all
    ranks write at once (every rank computes the same order)."""
    streams = [[t for i, s in enumerate(shards) if i % world == r for t in s if not t.carried] for r in range(world)]
    sent, at = [0] * world, [0] * world
    while True:
        waiting = [r for r in range(world) if at[r] < len(streams[r])]
        if not waiting:
            return
        r = min(waiting, key=lambda r: (sent[r], r))
        t = streams[r][at[r]]
        at[r] += 1
        sent[r] += t.nbytes
        yield t, r


def stream_files(files: list[tuple[Path, list[Any]]], order: Iterator[tuple[Any, int]], source: Any, *,
                 rank: int, write: Callable[..., None], budget: int = IN_FLIGHT) -> None:
    """Write ``files`` (this rank's, each with its tensors) with ``write(path, tensors, fetch)`` on a thread,
    fetching the trained tensors from ``source`` in ``order`` ((tensor, writing rank) pairs, every rank's)."""
    writer = _WriteBehind(files, source, write, budget)
    try:
        for t, owner in order:
            if owner == rank and writer.reserve(t.nbytes):
                writer.put(source(t))
            elif source.collective:
                source(t, keep=False)
    except BaseException:
        writer.close(abort=True)
        raise
    writer.close()
