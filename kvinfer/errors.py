"""Typed errors: every user-facing failure names the parameter or thing at fault."""
from __future__ import annotations


class KvinferError(Exception):
    """Base class of errors a user can cause; the CLI prints them as one line."""


class ValidationError(KvinferError, ValueError):
    """A parameter has a value outside what it accepts."""

    def __init__(self, param: str, value: object, reason: str, message: str = ""):
        self.param = param
        self.value = value
        self.reason = reason
        super().__init__(message or f"invalid {param}={value!r}: {reason}")  # message: where no value is to blame


class ModelLoadError(KvinferError):
    """A model path, file or format cannot be loaded."""


class UnsupportedError(KvinferError):
    """An architecture, tensor type or feature that kvinfer does not implement."""


class RequestTooLargeError(KvinferError):
    """A request can never fit: longer than the context window or the KV budget."""

    def __init__(self, message: str, param: str = "prompt"):
        self.param = param
        super().__init__(message)
