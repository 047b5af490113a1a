"""Typed errors. The CLI prints their message on one line and exits non-zero.

Every check on user input raises one of these *before* torch sees the input, so users never get a
shape error from deep inside a matmul.
"""


class M2R2Error(Exception):
    """Base class of every error m2r2 raises on purpose."""


class UnsupportedModelError(M2R2Error):
    """The model's architecture or config is not one m2r2 implements."""


class WeightsError(M2R2Error):
    """Model or adapter weights are missing, truncated, corrupt or do not fit the model."""


class InputError(M2R2Error):
    """A prompt is empty or does not fit the context window."""


class SettingsError(M2R2Error):
    """A generation or benchmark setting is out of range (temperature < 0, top_p > 1, ...)."""


class UnknownNameError(M2R2Error):
    """An unknown dataset, method or model name."""
