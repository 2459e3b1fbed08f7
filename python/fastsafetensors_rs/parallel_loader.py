"""`from fastsafetensors_rs.parallel_loader import ParallelLoader`, as vLLM imports it."""

from .compat.parallel import ParallelLoader

__all__ = ["ParallelLoader"]
