"""The provider's failures and GARM's exit codes (garm-provider-common's
``execution/common/commands.go``): 0 success, 30 not found, 31 duplicate, 1 anything else.

A :class:`ProviderError`'s message becomes the runner's fault in GARM's database: one
sentence, never a secret.
"""

from __future__ import annotations

import enum

__all__ = ["ExitCode", "ProviderError"]


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1
    NOT_FOUND = 30
    DUPLICATE = 31


class ProviderError(Exception):
    """A call that fails: GARM stores ``message`` as the runner's fault."""

    def __init__(self, message: str, *, code: ExitCode = ExitCode.FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
