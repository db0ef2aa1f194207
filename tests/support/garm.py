"""Running the GARM provider exactly as GARM does: a fresh process per call, no
arguments, an environment of the ``GARM_*`` variables only (no PATH, no HOME), GARM's
BootstrapInstance on stdin with its own key spellings."""

from __future__ import annotations

import base64
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import orjson

from reconciler.garm.protocol import parse_bootstrap

#: secrets of the bootstrap: the tests check they never reach the bus
TOKEN = "eyJhbGciOiJIUzI1NiJ9.c2VjcmV0LXJ1bm5lci10b2tlbg.Zm9vYmFyLXNpZ25hdHVyZQ"
CA_PEM = (
    b"-----BEGIN CERTIFICATE-----\n"
    b"MIIBdzCCAR2gAwIBAgIUU2VjcmV0LWNhLWJ1bmRsZS1mb3ItZ2FybQ==\n"
    b"-----END CERTIFICATE-----\n"
)
CONTROLLER = "5d1f8c2e-3b7a-4c1e-9a0d-6f2b8e4c7a91"
GARM_POOL = "0b9e1f4a-7c2d-4e8b-a1f3-2d5c6e7f8a90"
MARKER = "/tmp/garm-bootstrap-ran"

#: the fields of garm-provider-common's ``InstallRunnerParams``, in Go's order: the
#: context GARM renders a runner install template with
INSTALL_RUNNER_PARAMS = [
    "FileName",
    "DownloadURL",
    "RunnerUsername",
    "RunnerGroup",
    "RepoURL",
    "MetadataURL",
    "RunnerName",
    "RunnerLabels",
    "CallbackURL",
    "CallbackToken",
    "TempDownloadToken",
    "CABundle",
    "GitHubRunnerGroup",
    "EnableBootDebug",
    "ExtraContext",
    "UseJITConfig",
]


def measured(env: dict[str, str]) -> dict[str, str]:
    """``env``, and the variable that has coverage measure the process when the suite runs
    under coverage (``[tool.coverage.run] patch = subprocess``): the provider reads its
    ``GARM_*`` variables only, and with nothing else (no PATH, no HOME) it would not
    be counted."""
    coverage = os.environ.get("COVERAGE_PROCESS_CONFIG")
    return env if coverage is None else {**env, "COVERAGE_PROCESS_CONFIG": coverage}


def executable() -> list[str]:
    """The console script GARM names as ``provider_executable``."""
    script = Path(sys.executable).parent / "reconciler-garm-provider"
    return [str(script)] if script.exists() else [sys.executable, "-m", "reconciler.garm"]


def install_template(name: str) -> str:
    """A stand-in for GARM's rendered wrapper: it embeds the token, as GARM's does."""
    script = f"#!/bin/sh\n# token={TOKEN}\necho bootstrap of {name} ran as $(id -un) >> {MARKER}\n"
    return base64.b64encode(script.encode()).decode()


def bootstrap(name: str, flavor: str, *, pool_id: str = GARM_POOL) -> dict[str, Any]:
    """GARM's BootstrapInstance (``params.BootstrapInstance``) for runner ``name``."""
    return {
        "name": name,
        "tools": [
            {
                "os": "linux",
                "architecture": "x64",
                "download_url": "https://github.com/actions/runner/releases/runner.tar.gz",
                "filename": "actions-runner-linux-x64-2.321.0.tar.gz",
                "temp_download_token": None,
                "sha256_checksum": "ba46ba7ce3a4d7236b16fbe44419fb45"
                "3bc08f866b24f04d549ec89f1722a29e",
            }
        ],
        "repo_url": "https://github.com/octo/repo",
        "callback-url": "https://garm.example:9997/api/v1/callbacks",
        "metadata-url": "https://garm.example:9997/api/v1/metadata",
        "instance-token": TOKEN,
        "ssh-keys": None,
        "extra_specs": {"runner_install_template": install_template(name)},
        "github-runner-group": "",
        "ca-cert-bundle": base64.b64encode(CA_PEM).decode(),
        "arch": "amd64",
        "os_type": "linux",
        "flavor": flavor,
        "image": "ubuntu:24.04",
        "labels": None,
        "pool_id": pool_id,
        "user_data_options": {
            "disable_updates_on_boot": True,
            "extra_packages": [],
            "enable_boot_debug": False,
        },
        "jit_config_enabled": True,
        "proxy_config": {"http_proxy": "", "https_proxy": "", "no_proxy": ""},
    }


def parsed(**changes: Any) -> Any:
    body = bootstrap("garm-abc", "small")
    body.update(changes)
    return parse_bootstrap(orjson.dumps(body))


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


#: extra specs of a pool: two pre-install scripts (out of name order) and two packages
SPECS = {
    "pre_install_scripts": {"02-second": b64("echo two\n"), "01-first": b64("echo one\n")},
    "extra_packages": ["jq", "curl"],
}


@dataclass(frozen=True)
class Call:
    code: int
    stdout: bytes
    stderr: bytes
    seconds: float

    def json(self) -> Any:
        return orjson.loads(self.stdout)

    @property
    def text(self) -> str:
        return (self.stdout + self.stderr).decode(errors="replace")


def write_config(
    path: Path,
    *,
    nats_url: str,
    hosts: Mapping[str, str],
    pools: Mapping[str, str],
    decision_timeout: float = 60,
    address_timeout: float = 5,
    extra: str = "",
) -> Path:
    lines = [
        f'nats_url = "{nats_url}"',
        f"decision_timeout = {decision_timeout}",
        f"address_timeout = {address_timeout}",
        "query_timeout = 15",
        extra,
        "[incus.hosts]",
        *(f'"{h}" = "{u}"' for h, u in sorted(hosts.items())),
        "[pools]",
        *(f'"{f}" = "{p}"' for f, p in sorted(pools.items())),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


#: what GARM passes from its own environment: the proxy variables (both cases)
GARM_PROXY_ENV = {
    "http_proxy": "http://proxy.invalid:3128",
    "HTTP_PROXY": "http://proxy.invalid:3128",
    "https_proxy": "http://proxy.invalid:3128",
    "HTTPS_PROXY": "http://proxy.invalid:3128",
    "no_proxy": "garm.example",
    "NO_PROXY": "garm.example",
}


def specs_env(specs: Any) -> str:
    """``GARM_POOL_EXTRASPECS``: base64 of the extra specs' JSON (``bnVsbA==`` for none)."""
    return base64.b64encode(orjson.dumps(specs)).decode()


class Garm:
    """GARM's side of the protocol (``runner/providers/v0.1.0/external.go``, or
    ``v0.1.1/external.go`` with ``interface_version="v0.1.1"``: every instance command
    then also carries ``GARM_POOL_ID`` and ``GARM_POOL_EXTRASPECS``, the specs of the
    runner's pool with GARM's wrapper, instance token included)."""

    def __init__(
        self,
        config: Path,
        *,
        controller: str = CONTROLLER,
        interface_version: str = "v0.1.0",
        passed: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.controller = controller
        self.interface_version = interface_version
        self.passed = dict(passed or {})  # variables GARM passes from its environment
        self.pools: dict[str, tuple[str, Any]] = {}  # runner -> (pool id, extra specs)

    @property
    def v011(self) -> bool:
        return self.interface_version == "v0.1.1"

    def env(self, command: str, **variables: str) -> dict[str, str]:
        env = {
            **self.passed,
            "GARM_COMMAND": command,
            "GARM_CONTROLLER_ID": self.controller,
            "GARM_PROVIDER_CONFIG_FILE": str(self.config),
            "GARM_INTERFACE_VERSION": self.interface_version,
        }
        env.update(variables)
        return env

    def instance_env(self, command: str, instance_id: str) -> dict[str, str]:
        if not self.v011:
            return self.env(command, GARM_INSTANCE_ID=instance_id)
        pool_id, specs = self.pools.get(instance_id, (GARM_POOL, None))
        return self.env(
            command,
            GARM_INSTANCE_ID=instance_id,
            GARM_POOL_ID=pool_id,
            GARM_POOL_EXTRASPECS=specs_env(specs),
        )

    def create_env(self, body: dict[str, Any]) -> dict[str, str]:
        if not self.v011:
            return self.env("CreateInstance", GARM_POOL_ID=body["pool_id"])
        self.pools[body["name"]] = (body["pool_id"], body.get("extra_specs"))
        return self.env(
            "CreateInstance",
            GARM_POOL_ID=body["pool_id"],
            GARM_POOL_EXTRASPECS=specs_env(body.get("extra_specs")),
        )

    async def run(self, env: dict[str, str], stdin: bytes = b"") -> Call:
        started = time.monotonic()
        done = await anyio.run_process(executable(), input=stdin, env=measured(env), check=False)
        return Call(done.returncode, done.stdout, done.stderr, time.monotonic() - started)

    async def create_killed(
        self, body: dict[str, Any], *, when: Callable[[], Awaitable[None]]
    ) -> Call | None:
        """A create that is SIGKILLed as soon as ``when`` returns; ``None`` when it was
        killed, its call when it finished first."""
        env = self.create_env(body)
        started = time.monotonic()
        process = await anyio.open_process(executable(), env=measured(env))
        assert process.stdin is not None
        await process.stdin.send(orjson.dumps(body))
        await process.stdin.aclose()
        finished: list[int] = []
        try:
            async with anyio.create_task_group() as tg:

                async def wait_exit() -> None:
                    finished.append(await process.wait())
                    tg.cancel_scope.cancel()

                async def kill() -> None:
                    await when()
                    process.send_signal(signal.SIGKILL)
                    await process.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(wait_exit)
                tg.start_soon(kill)
        finally:  # whatever failed (``when`` included), no process is left running
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.send_signal(signal.SIGKILL)
                    await process.wait()
                await process.aclose()
        if finished and finished[0] >= 0:
            return Call(finished[0], b"", b"", time.monotonic() - started)
        return None

    async def create(self, body: dict[str, Any]) -> Call:
        return await self.run(self.create_env(body), orjson.dumps(body))

    async def delete(self, instance_id: str) -> Call:
        return await self.run(self.instance_env("DeleteInstance", instance_id))

    async def get(self, instance_id: str) -> Call:
        return await self.run(self.instance_env("GetInstance", instance_id))

    async def list(self, pool_id: str = GARM_POOL) -> Call:
        return await self.run(self.env("ListInstances", GARM_POOL_ID=pool_id))

    async def remove_all(self, pool_id: str = GARM_POOL) -> Call:
        """``RemoveAllInstances``; GARM v0.1.1 always sends a pool id with it."""
        variables = {"GARM_POOL_ID": pool_id} if self.v011 else {}
        return await self.run(self.env("RemoveAllInstances", **variables))
