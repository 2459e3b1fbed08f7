"""`from fastsafetensors_rs.loader import SafeTensorsFileLoader`, as TGIS-style loaders import it."""

from .compat.loader import SafeTensorsFileLoader, fastsafe_open

__all__ = ["SafeTensorsFileLoader", "fastsafe_open"]
