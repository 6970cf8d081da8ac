"""Which model families ``kernelguard train`` packs, and why not the others: one answer per catalog family.

A packed row keeps its examples apart only where every kernel a layer runs in training is handed the row's
boundaries: the delta-rule kernels ``cu_seqlens`` (from ``cu_seq_lens_q``), the conv ``seq_idx``
(:data:`~kernelguard.resolution.packed_batch.BOUNDARY_PARAMS`). Read from the modeling source (ast, nothing
imported), so the answer follows the installed transformers: a release whose layer starts passing the boundary
makes its family packable with no change here. The same table renders docs/families.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from .catalog import Family, Requirements, is_decode_only
from .decisions import FALLBACK, Decision
from .packed_batch import BOUNDARY_PARAMS, NO_BOUNDARY_PARAM
from .transformers_calls import call_shape, dropped_keywords, mask_sees_positions, submodule_call_drops

__all__ = ["PACKED_ROWS", "FamilySupport", "family_table", "packed_rows_decision", "packing_support"]

PACKED_ROWS = "packed_rows"  # the Decision.kernel of a packed row's boundaries: not a kernel, the layers' calls


@dataclass(frozen=True, slots=True)
class FamilySupport:
    """One family: the kernels it needs in training and, when a packed row would leak, why."""

    family: str
    model_types: tuple[str, ...]
    kernels: tuple[str, ...]  # training kernels (decode-only ones left out)
    packed_problem: str | None  # None: kernelguard train packs it
    # its causal mask is built without the position ids: sdpa and eager see a packed row as one sequence, so only
    # a varlen attention (given cu_seq_lens) keeps its examples apart (the guard refuses the others)
    varlen_attention_only: bool = False

    @property
    def packs(self) -> bool:
        return self.packed_problem is None


def packing_support(family: Family) -> FamilySupport:
    """Whether a packed row of ``family``'s examples stays apart in every layer kernel that carries state."""
    kernels = tuple(k for k in family.kernels if not is_decode_only(k.kernel))
    problems = [f"{dropped}, so a batch's packed-sequence keywords never reach its layers" for dropped in (
        dropped_keywords(family.source, name) for name in _causal_lms(family.source)) if dropped]
    for req in kernels:
        if req.kernel in NO_BOUNDARY_PARAM:
            problems.append(f"`{req.kernel}` takes no boundary at all: its scan runs on from one packed example "
                            "into the next")
            continue
        if req.kernel not in BOUNDARY_PARAMS:
            problems.append(f"kernelguard cannot check that `{req.kernel}` keeps packed examples apart (no boundary "
                            "parameter it knows)")
            continue
        param, keyword = BOUNDARY_PARAMS[req.kernel]
        shape = call_shape(family.source, req.call_site)
        if shape is not None and param not in shape.keywords and not (shape.spreads and keyword == param):
            problems.append(f"transformers' layer does not pass `{param}` to `{req.kernel}`, so its state runs on "
                            "from one packed example into the next")
        elif dropped := submodule_call_drops(family.source, req.call_site, keyword):
            problems.append(f"{dropped}, so `{keyword}` never reaches `{req.kernel}` and its state runs on from one "
                            "packed example into the next")
    problem = "; ".join(dict.fromkeys(problems)) or None
    return FamilySupport(family.name, family.model_types, tuple(dict.fromkeys(k.kernel for k in kernels)), problem,
                         mask_sees_positions(family.source) is False)


def _causal_lms(source: str) -> list[str]:
    """The causal-LM classes a modeling file defines (the entry point a training batch is given to)."""
    import ast
    from pathlib import Path

    try:
        tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return []
    return [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("ForCausalLM")]


def packed_rows_decision(requirements: Requirements, *, allowed: bool) -> Decision | None:
    """For packed training of a family that cannot keep packed examples apart: the one fallback there is (a
    leaking row), selected only when ``packed-without-boundaries`` is allowed; None for any other job."""
    if not requirements.packed or requirements.mode != "training":
        return None
    support = packing_support(requirements.family)
    if support.packs:
        return None
    return Decision(
        PACKED_ROWS, f"transformers' {support.family} layers", "reference", FALLBACK,
        f"{support.packed_problem}: a packed row's examples are not kept apart and the results are wrong"
        + ("; explicitly allowed by --allow packed-without-boundaries." if allowed else
           " (accept it with --allow packed-without-boundaries)."),
        "padded batches (kernelguard check --no-packed; padding_free=False or no DataCollatorWithFlattening)",
    )


def family_table(families: dict[str, Family], transformers_version: str) -> str:
    """docs/families.md: every family with fast kernels in this transformers, and whether train packs it."""
    lines = [
        "# Model families with fast kernels",
        "",
        f"Generated from transformers {transformers_version} by `python -m kernelguard.resolution.family_support`"
        " (the list `kernelguard check --model`, its errors and `kernelguard train` share). `check`, `guard()`,"
        " the pytest plugin and the callback judge every family below; `kernelguard train` packs the families"
        " marked yes and refuses the others by name (train them with `--packing none`).",
        "",
        "| family | model types | kernels in training | `kernelguard train` packs it |",
        "|---|---|---|---|",
    ]
    for name in sorted(families):
        s = packing_support(families[name])
        verdict = f"no: {s.packed_problem}" if not s.packs else "yes" if not s.varlen_attention_only else (
            "yes, with a varlen attention (flash_attention_2 or kernelguard_varlen) only: its causal mask is built "
            "without the position ids, so sdpa and eager let a packed row's examples see each other")
        lines.append(f"| {name} | {', '.join(s.model_types)} | {', '.join(s.kernels)} | {verdict} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - writes the docs table
    import sys

    from .discovery import families, transformers_source

    sys.stdout.write(family_table(families(), transformers_source().version))
