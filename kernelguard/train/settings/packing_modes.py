"""``--packing``: how a step's examples reach the model, and the two deliberate controls without boundaries."""

from __future__ import annotations

__all__: list[str] = [
    "LEAKY",
    "LEAKY_WARNING",
    "NAIVE",
    "NAIVE_WARNING",
    "NO_BOUNDARIES",
    "PACKED",
    "PACKING_MODES",
    "NO_PACKING",
    "check_control_allowed",
    "eval_layout",
]


# How a step's examples reach the model (``--packing``): the packed blocks with their boundaries; the same
# examples as a right-padded [examples, longest] batch with an attention mask (what training without packing
# does); or the packed blocks with their boundaries WITHHELD - position ids only, as a stock flattening collator
# sends by default - a deliberate bug that leaks GDN state and conv inputs across examples, kept as the
# negative control that shows a quality comparison can fail; or ``naive``, what plain concatenation gives a user:
# no boundaries anywhere (no cu_seq_lens, no seq_idx) and positions running on across the block, so attention
# too sees the examples before, and GDN state and conv inputs leak. Both controls keep the packed block's labels
# (the same tokens scored); both need --allow packed-without-boundaries.
PACKED, NO_PACKING, LEAKY, NAIVE = "packed", "none", "leaky", "naive"


PACKING_MODES = (PACKED, NO_PACKING, LEAKY, NAIVE)


NO_BOUNDARIES = (LEAKY, NAIVE)


LEAKY_WARNING = (
    "WARNING: --packing leaky is a deliberate bug for quality checks: example boundaries are withheld from the "
    "GDN layers and attention (position ids only), so GDN state and conv inputs leak across examples; never "
    "train a model you keep this way (its held-out loss is measured with the boundaries, as the model is used). "
    "It needs --allow packed-without-boundaries, which the guard otherwise requires for such rows"
)


NAIVE_WARNING = (
    "WARNING: --packing naive is a deliberate bug for quality checks: examples are concatenated with no "
    "boundaries at all (no cu_seq_lens, no seq_idx, positions not reset), so attention, GDN state and conv "
    "inputs all reach across examples; never train a model you keep this way (its held-out loss is measured "
    "with the boundaries, as the model is used)"
)


def check_control_allowed(packing: str, *, allowed: bool) -> None:
    """Refuse a control without boundaries unless ``--allow packed-without-boundaries`` accepts it."""
    from kernelguard.errors import ConfigError

    if packing in NO_BOUNDARIES and not allowed:
        what = "every example boundary" if packing == NAIVE else "the example boundaries of the GDN layers"
        raise ConfigError(
            f"--packing {packing} withholds {what} from the model: a deliberate bug that trains across "
            "examples, kept only as a negative control for quality comparisons.",
            fix="train with --packing packed; to run the control, add --allow packed-without-boundaries",
        )


def eval_layout(packing: str) -> str:
    """The layout held-out loss is measured in for a run trained in ``packing``: the run's own, except that
    the controls without boundaries (leaky, naive) are measured with them. A model is used one conversation at a time, so that is
    the loss a user of the control's model would get; measured leaky, the control mostly grades its leak."""
    return PACKED if packing in NO_BOUNDARIES else packing
