"""Test double for mamba-ssm's Mamba-2 kernels (same signatures; pure torch over transformers' own reference;
honours ``seq_idx``: a packed row's examples never share a scan state or a conv window)."""

from __future__ import annotations

__version__ = "2.2.4+kernelguard.fake"
# kernelguard's device hook: the devices this provider's kernels can run on.
__kernelguard_devices__ = ("cpu", "cuda")


def _tell_transformers_the_devices(package: str) -> None:
    """transformers 5.25+ hands a pip package only inputs on the devices it lists for it; a stand-in that runs
    on CPU says so there too (as the causal_conv1d stand-in does)."""
    try:
        from transformers.integrations import hub_kernels
    except ImportError:
        return
    table = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if isinstance(table, dict):
        table[package] = tuple(dict.fromkeys((*table.get(package, ()), *__kernelguard_devices__)))


_tell_transformers_the_devices("mamba_ssm")
