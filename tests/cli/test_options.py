"""The common command-line options (reconciler.cli.options): secrets read from files."""

from __future__ import annotations

import threading
from pathlib import Path

import click
import pytest

from reconciler.cli.options import read_secret, wait_for_file


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


def test_a_file_that_does_not_exist_yet_is_waited_for(tmp_path: Path) -> None:
    late = tmp_path / "fleet.json"
    writer = threading.Timer(0.3, late.write_text, args=("{}",))
    writer.start()
    try:
        wait_for_file(late, option="--incus-fleet", within_s=20)
    finally:
        writer.cancel()
    assert late.exists()
    with pytest.raises(click.ClickException) as refused:
        wait_for_file(tmp_path / "never.json", option="--incus-fleet", within_s=0.2)
    assert refused.value.format_message() == (
        f"--incus-fleet {tmp_path / 'never.json'} does not exist (waited 0.2 s): give the "
        "right path, or start what writes it first"
    )
