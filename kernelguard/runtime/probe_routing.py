"""Mixture-of-experts routing in the first-row probe (:mod:`kernelguard.runtime.equivalence`): a near tie is not a leak.

A router picks each token's top-k experts from its logits. When two experts' scores for a token are within
rounding of each other, the packed row and the example run alone can pick differently (bf16 rounding of a
longer row's matmuls is enough), and that token's output then differs by the two experts' difference - far
above any rounding tolerance, with nothing wrong in the row - and so, a little, does every later token that
reads it. A leak moves the router's input itself, so its logits differ beyond rounding as well.

So the probe records each router's logits, scores and choices in the packed run, and when it runs an example
alone, a router that chooses other experts for a token *whose logits agree with the packed run's to the dtype's
rounding floor* is given the packed run's choice and scores for that token (a replay of the tie, nothing else).
The example alone then computes what the packed row computed, to rounding, unless the row leaks. Tokens whose
logits moved beyond rounding are left as they are: what they show is the probe's finding.

Covered: transformers' top-k routers (a module named ``...Router`` with ``top_k`` whose output is ``(logits,
scores, indices)``: Qwen3-Next, Qwen3.5-MoE and the other current MoE families). A block that takes its top-k
from a plain ``gate`` Linear itself is not replayed: a tie there is still reported as a difference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Route", "record_hooks", "replay_hooks"]

Route = tuple[str, Any, Any, Any]  # (decoder layer, logits [tokens, experts], scores [tokens, k], chosen [tokens, k])


def _routers(layer: Any) -> list[Any]:
    return [m for m in layer.modules()
            if type(m).__name__.endswith("Router") and isinstance(getattr(m, "top_k", None), int)]


def _parts(output: Any) -> tuple[Any, Any, Any] | None:
    if isinstance(output, tuple) and len(output) == 3 and all(hasattr(x, "shape") for x in output):
        logits, scores, chosen = output
        return logits.reshape(-1, logits.shape[-1]), scores.reshape(logits.numel() // logits.shape[-1], -1), \
            chosen.reshape(logits.numel() // logits.shape[-1], -1)
    return None


def record_hooks(layers: list[tuple[str, Any]], routes: list[Route], spans: list[tuple[int, int]]) -> list[Any]:
    """Forward hooks recording, in call order, every router's logits, scores and choices on the tokens of
    ``spans`` of a one-row batch (one span after the other); returns the handles to remove."""
    import torch

    def record(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            parts = _parts(output)
            if parts is not None:
                routes.append((name, *(torch.cat([p.detach()[a:b] for a, b in spans]) for p in parts)))

        return hook

    return [router.register_forward_hook(record(name)) for name, layer in layers for router in _routers(layer)]


def replay_hooks(layers: list[tuple[str, Any]], packed: list[Route], *, start: int, floor: float,
                 replayed: dict[str, int]) -> list[Any]:
    """Forward hooks for one example run alone (its tokens at ``start`` in ``packed``): each router call takes
    the packed run's choice and scores for the tokens where it chose other experts while its logits agree with
    the packed run's to ``floor`` (relative L2); ``replayed`` counts them per decoder layer."""
    import torch

    calls = iter(packed)

    def replay(name: str) -> Callable[..., Any]:
        def hook(module: Any, args: Any, output: Any) -> Any:
            parts, seen = _parts(output), next(calls, None)
            if parts is None or seen is None or seen[0] != name:
                return None
            logits, scores, chosen = parts
            n = logits.shape[0]
            lp, sp, cp = (x[start:start + n] for x in seen[1:])
            if lp.shape != logits.shape or cp.shape != chosen.shape:
                return None
            flipped = (cp.sort(-1).values != chosen.sort(-1).values).any(-1)
            close = (lp.float() - logits.float()).norm(dim=-1) / logits.float().norm(dim=-1).clamp_min(1e-12) <= floor
            tied = flipped & close
            if not bool(tied.any()):
                return None
            replayed[name] = replayed.get(name, 0) + int(tied.sum())
            chosen = torch.where(tied[:, None], cp.to(chosen.dtype), chosen)
            scores = torch.where(tied[:, None], sp.to(scores.dtype), scores)
            return (output[0], scores.reshape(output[1].shape), chosen.reshape(output[2].shape))

        return hook

    return [router.register_forward_hook(replay(name)) for name, layer in layers for router in _routers(layer)]
