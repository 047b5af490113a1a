"""m2r2: faster LLM decoding with Mixture of Multi-Rate Residuals."""

from m2r2.config import ModelConfig
from m2r2.errors import InputError, M2R2Error, SettingsError, UnknownNameError, UnsupportedModelError, WeightsError

__version__ = "0.1.0"

__all__ = [
    "InputError",
    "M2R2Error",
    "ModelConfig",
    "SettingsError",
    "UnknownNameError",
    "UnsupportedModelError",
    "WeightsError",
    "__version__",
]
