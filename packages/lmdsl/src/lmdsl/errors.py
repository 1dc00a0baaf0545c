"""Typed exceptions raised at lmdsl's public boundary."""

from __future__ import annotations


class LmdslError(Exception):
    """Base class of every error lmdsl raises on purpose."""


class ProgramError(LmdslError):
    """A primitive of a running program failed; `__cause__` holds the original exception.

    `ProgramState.error()` returns it, and reading a variable that the failed primitive (or any
    primitive after it) would have set raises it.
    """


class BackendError(LmdslError):
    """A backend call failed (HTTP status, malformed reply, unreachable endpoint)."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ConstraintNotSupportedError(LmdslError):
    """The backend cannot enforce a requested constraint (regex, JSON schema, select...)."""


class NoBackendError(LmdslError):
    """A program ran without a backend: pass `backend=` or call `set_default_backend`."""


class TraceError(LmdslError):
    """A program cannot be traced as written (for example an f-string over a traced argument)."""


class SpeculationError(LmdslError):
    """API speculative execution could not match the model's reply to the program's template."""


class ChatTemplateError(LmdslError):
    """Unknown chat template name, or a role used in a way the template does not allow."""
