"""What kind of work a GPU kernel does, from its name alone.

The step diagnosis (:mod:`kernelguard.diagnosis.verdict`) splits a profiled step's GPU time by class, and the
performance benches use the same table, so a kernel is counted the same way everywhere. Names are matched
lower-cased against ordered substring rules: the first rule that matches wins, so the specific ones (fused
GDN, conv, attention, optimizer, communication) come before the generic ones (GEMM, elementwise).

The rules come from the kernel names in real H200 traces of the fallback, the stock recipe and the product
(fla's Triton kernels, Dao's causal-conv1d, cuDNN / flash / torch varlen attention, cuBLAS / CUTLASS / nvjet
GEMMs, ATen's elementwise and reduction templates, Inductor's ``triton_{poi,red,per}`` kernels, the
``multi_tensor_apply`` optimizer kernels, NCCL). Anything else is ``other``.
"""

from __future__ import annotations

__all__ = ["FUSED_CLASSES", "KERNEL_CLASSES", "classify_kernel"]

# Ordered: the first class whose any substring occurs in the lower-cased name.
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "reducescatter",
                       "reduce_scatter", "sendrecv")),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "fusedadam", "adamw", "_adam_", "lion_", "sgd_")),
    ("copy", ("memcpy", "memset", "chunk_cat", "catarraybatchedcopy", "split_with_sizes_copy",
              "copy_kernel", "unrolled_elementwise_kernel<at::native::copy")),
    ("conv", ("causal_conv1d", "conv1d", "conv_depthwise", "depthwise", "convolution", "implicit_convolve",
              "cudnn::conv")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "mha_", "_mha", "varlen")),
    ("gdn", ("delta_rule", "gated_delta", "chunk_fwd_kernel", "chunk_bwd_kernel", "chunk_scaled_dot_kkt",
             "solve_tril", "recompute_w_u", "wy_repr", "merge_16x16", "chunk_local_cumsum", "fused_recurrent",
             "chunk_gla", "chunk_delta_h", "l2norm_fwd", "l2norm_bwd", "chunk_o", "chunk_dqkwg", "chunk_dv",
             "tilelang", "flash_qla")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "logsumexp")),
    ("norm", ("rms_norm", "rmsnorm", "layer_norm", "layernorm", "group_norm", "norm_fwd", "norm_bwd")),
    ("gemm", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "matmul", "wgmma", "splitk", "sm90_", "sm80_",
              "ampere_", "hopper_", "bmm")),
    ("elementwise", ("elementwise", "reduce", "triton_poi", "triton_red", "triton_per", "index", "scatter",
                     "gather", "fill", "cumsum", "softmax", "where", "cat", "sort", "arange", "vectorized",
                     "at::native", "pointwise", "unrolled", "clamp", "tensor_kernel")),
)

KERNEL_CLASSES: tuple[str, ...] = (*(name for name, _ in _RULES), "other")
# Classes that are the fast providers' own fused work: a step dominated by them is where the product wants it.
FUSED_CLASSES: frozenset[str] = frozenset({"gdn", "conv", "attention"})


def classify_kernel(name: str) -> str:
    """The class of the GPU kernel called ``name`` (one of :data:`KERNEL_CLASSES`)."""
    lowered = name.lower()
    for cls, needles in _RULES:
        if any(needle in lowered for needle in needles):
            return cls
    return "other"
