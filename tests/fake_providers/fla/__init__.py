"""Test double for flash-linear-attention (``fla``): correct but slow, runs anywhere torch runs."""

__version__ = "0.6.0+kernelguard.fake"
# kernelguard's device hook: the devices this provider's kernels can run on.
__kernelguard_devices__ = ("cpu", "cuda")
