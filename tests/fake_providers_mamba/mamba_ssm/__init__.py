"""Test double for mamba-ssm's Mamba-2 kernels (same signatures; pure torch over transformers' own reference;
honours ``seq_idx``: a packed row's examples never share a scan state or a conv window) and its Mamba-1 ones
(``ops.selective_scan_interface``: no boundary parameter, as the real ones). It needs the
causal-conv1d stand-in beside it (tests/fake_providers): its conv, and the way a stand-in tells transformers 5.25+
the devices it runs on."""

from __future__ import annotations

from causal_conv1d import _tell_transformers_the_devices

__version__ = "2.2.4+kernelguard.fake"
# kernelguard's device hook: the devices this provider's kernels can run on.
__kernelguard_devices__ = ("cpu", "cuda")

_tell_transformers_the_devices("mamba_ssm")
