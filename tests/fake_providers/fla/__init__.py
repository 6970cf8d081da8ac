"""Test double for flash-linear-attention (``fla``): correct but slow, runs anywhere torch runs."""

__version__ = "0.6.0+kernelguard.fake"
# kernelguard's device hook: the devices this provider's kernels can run on.
__kernelguard_devices__ = ("cpu", "cuda")


def _tell_transformers_the_devices(package: str) -> None:
    """transformers 5.25+ hands a pip package only inputs on the devices it lists for it
    (``hub_kernels._PACKAGE_SUPPORTED_DEVICES``: causal_conv1d on cuda, fla on cuda/xpu/mlu/npu); a stand-in that runs on CPU says so
    there too, as it does to kernelguard. transformers imports the package before it reads that table."""
    try:
        from transformers.integrations import hub_kernels
    except ImportError:
        return
    table = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if isinstance(table, dict):
        table[package] = tuple(dict.fromkeys((*table.get(package, ()), *__kernelguard_devices__)))


_tell_transformers_the_devices('fla')
