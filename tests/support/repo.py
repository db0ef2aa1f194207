"""The repository's checkout, for tests that read its files (docs, schemas, compose,
deploy, scripts) or run its scripts."""

from __future__ import annotations

from pathlib import Path

#: the checkout's top directory (this file is ``tests/support/repo.py``)
ROOT = Path(__file__).resolve().parents[2]
