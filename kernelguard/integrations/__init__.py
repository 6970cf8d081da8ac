"""Adapters for the trainers people already use.

- :mod:`kernelguard.integrations.transformers`: ``KernelGuardCallback`` for ``transformers.Trainer`` and TRL's
  ``SFTTrainer`` (the same gate as ``kernelguard train``, before step 1), and ``register_varlen_attention()``
  for packed (padding-free) training without flash-attn.

Nothing is imported here: ``import kernelguard.integrations`` stays free of torch and transformers.
"""

__all__: list[str] = []
