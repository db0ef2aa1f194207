"""The common command-line options (reconciler.cli.options): secrets read from files."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from reconciler.cli.options import read_secret


def test_a_secret_file_gives_its_first_line_and_errors_never_show_it(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret-Value\n")
    assert read_secret(secret, option="--nats-password-file") == "s3cret-Value"
    secret.write_text("")
    with pytest.raises(click.BadParameter, match="is empty"):
        read_secret(secret, option="--nats-password-file")
    secret.write_bytes(b"\xff\xfes3cret")
    with pytest.raises(click.BadParameter) as info:
        read_secret(secret, option="--nats-password-file")
    assert "s3cret" not in str(info.value)
