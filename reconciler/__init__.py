"""reconciler: admission control for self-hosted CI runners on Incus.

``reconciler.__version__`` is the installed distribution's version, read from its
metadata on first use: ``pyproject.toml``'s ``version`` is the one place it is written.
"""

from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    # looked up lazily: importlib.metadata costs a few milliseconds that the GARM
    # provider, started once per call, should not pay unless it is asked its version
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("reconciler")
        except PackageNotFoundError:  # a bare checkout on sys.path, never installed
            return "0+unknown"
    raise AttributeError(f"module 'reconciler' has no attribute {name!r}")
