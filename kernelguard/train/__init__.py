"""Packed FSDP2 fine-tuning that starts only once the guard passes. Entry point: ``kernelguard.train.__main__``."""
