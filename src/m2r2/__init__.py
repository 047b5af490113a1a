"""m2r2: faster LLM decoding with Mixture of Multi-Rate Residuals."""

from m2r2.config import ModelConfig
from m2r2.errors import InputError, M2R2Error, SettingsError, UnknownNameError, UnsupportedModelError, WeightsError

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``from m2r2 import Engine`` without importing torch and every strategy on ``import m2r2``."""
    if name == "Engine":
        from m2r2.engine import Engine

        return Engine
    raise AttributeError(f"module 'm2r2' has no attribute {name!r}")


__all__ = [
    "Engine",
    "InputError",
    "M2R2Error",
    "ModelConfig",
    "SettingsError",
    "UnknownNameError",
    "UnsupportedModelError",
    "WeightsError",
    "__version__",
]
