"""GARM's bootstrap, turned into what an instance runs: cloud-init user data for a cold
instance, files and one command for a warm one that is already booted.

Both run the same steps, in the order of GARM's provider library
(``cloudconfig.GetCloudInitConfig``): the pool's pre-install scripts as root, in name
order, from ``/garm-pre-install/`` (which is removed afterwards), then
``/install_runner.sh`` (:mod:`.install`) as the user ``runner``, which is removed once
it ran (it may embed the instance token). Packages follow the
official Incus provider: ``curl`` and ``tar`` plus ``extra_packages``, with a package
upgrade at boot, unless ``disable_updates`` (then only ``extra_packages``, no upgrade);
the pool's extra specs say it, else the bootstrap's ``user_data_options``.

Pure functions. Everything returned here may hold the instance token (the install
script embeds it) and goes to Incus only: never into a log line or onto the bus.
"""

from __future__ import annotations

import base64
import shlex
from dataclasses import dataclass, field

import orjson

from reconciler.garm.install import RUNNER_USER, install_script
from reconciler.garm.protocol import Bootstrap

__all__ = [
    "CA_BUNDLE_PATH",
    "INSTALL_SCRIPT_PATH",
    "PRE_INSTALL_DIR",
    "PROXY_PATH",
    "Injection",
    "cloud_config",
    "injection",
    "install_script",
]

INSTALL_SCRIPT_PATH = "/install_runner.sh"
PRE_INSTALL_DIR = "/garm-pre-install"
CA_BUNDLE_PATH = "/usr/local/share/ca-certificates/garm-ca-bundle.crt"
PROXY_PATH = "/etc/profile.d/garm-proxy.sh"
LOG_PATH = "/var/log/garm-runner-install.log"
#: made (atomically, by ``mkdir``) when the install script is started in a warm instance
STARTED_PATH = "/var/lib/garm-runner/install-started"
DEFAULT_PACKAGES = ("curl", "tar")


def disable_updates(bootstrap: Bootstrap) -> bool:
    said = bootstrap.specs.disable_updates
    return bootstrap.disable_updates_on_boot if said is None else said


def packages(bootstrap: Bootstrap) -> list[str]:
    """The packages cloud-init installs, in order, without repeats."""
    wanted = [
        *(() if disable_updates(bootstrap) else DEFAULT_PACKAGES),
        *bootstrap.extra_packages,
        *bootstrap.specs.extra_packages,
    ]
    return list(dict.fromkeys(wanted))


def pre_install_paths(bootstrap: Bootstrap) -> list[str]:
    return [f"{PRE_INSTALL_DIR}/{name}" for name, _ in bootstrap.specs.pre_install_scripts]


def _proxy_lines(bootstrap: Bootstrap) -> str:
    lines = []
    for key in ("http_proxy", "https_proxy", "no_proxy"):
        value = bootstrap.proxy.get(key)
        if value:
            lines.append(f"export {key}={shlex.quote(value)}")
            lines.append(f"export {key.upper()}={shlex.quote(value)}")
    return "\n".join(lines) + ("\n" if lines else "")


def _b64_file(path: str, content: bytes) -> dict[str, str]:
    return {
        "path": path,
        "permissions": "0755",
        "owner": "root:root",
        "encoding": "b64",
        "content": base64.b64encode(content).decode(),
    }


def cloud_config(bootstrap: Bootstrap, *, script: bytes | None = None) -> str:
    """``#cloud-config`` user data (JSON is YAML): the runner user, packages, the CA
    bundle, proxy settings, the pre-install scripts run as root, then the install script
    (``script``, rendered by the caller, or rendered here) run as the runner user."""
    script = install_script(bootstrap) if script is None else script
    files = [
        _b64_file(path, content)
        for path, (_, content) in zip(
            pre_install_paths(bootstrap), bootstrap.specs.pre_install_scripts, strict=True
        )
    ]
    files.append(_b64_file(INSTALL_SCRIPT_PATH, script))
    proxy = _proxy_lines(bootstrap)
    if proxy:
        files.append({"path": PROXY_PATH, "permissions": "0644", "content": proxy})
    runcmd: list[list[str]] = [[path] for path in pre_install_paths(bootstrap)]
    if runcmd:
        runcmd.append(["rm", "-rf", PRE_INSTALL_DIR])
    runcmd.append(["su", "-l", "-c", INSTALL_SCRIPT_PATH, RUNNER_USER])
    # the script may embed the instance token: gone once it ran, as in GARM's library
    runcmd.append(["rm", "-f", INSTALL_SCRIPT_PATH])
    upgrade = not disable_updates(bootstrap)
    config: dict[str, object] = {
        "package_update": upgrade,
        "package_upgrade": upgrade,
        "packages": packages(bootstrap),
        "users": [
            "default",
            {
                "name": RUNNER_USER,
                "shell": "/bin/bash",
                "sudo": "ALL=(ALL) NOPASSWD:ALL",
                "lock_passwd": True,
            },
        ],
        "write_files": files,
        "runcmd": runcmd,
    }
    if bootstrap.ca_bundle:
        config["ca_certs"] = {"trusted": [bootstrap.ca_bundle.decode("utf-8", "replace")]}
    return "#cloud-config\n" + orjson.dumps(config, option=orjson.OPT_INDENT_2).decode() + "\n"


def _inject_command(pre_install: list[str]) -> str:
    """Run in a warm instance after the files landed: trust the CA bundle, then, in the
    background, the pre-install scripts as root in name order (each one's exit status
    logged; a failure does not stop the others, as in cloud-init's ``runcmd``), then the
    install script as the runner user (root when the image has none), all output in
    LOG_PATH. At most once per instance: a call killed after the start and run again by
    GARM (same runner name, same instance) must not register the runner a second time,
    so the start is guarded by an atomic mkdir. The command holds no secret."""
    quoted = " ".join(shlex.quote(path) for path in pre_install)
    run_pre_install = (
        f'  for script in {quoted}; do\n    "$script"\n'
        '    echo "pre-install script $script exited $?"\n  done\n'
        if pre_install
        else ""
    )
    return f"""
set -u
if [ -f {CA_BUNDLE_PATH} ] && command -v update-ca-certificates >/dev/null 2>&1; then
  update-ca-certificates >/dev/null 2>&1 || true
fi
[ -f {PROXY_PATH} ] && . {PROXY_PATH}
if ! mkdir {STARTED_PATH} 2>/dev/null; then
  echo "install script already started in this instance: not again" >>{LOG_PATH}
  exit 0
fi
trap '' HUP
(
{run_pre_install}  rm -rf {PRE_INSTALL_DIR}
  if id {RUNNER_USER} >/dev/null 2>&1 && command -v su >/dev/null 2>&1; then
    su -l -c {INSTALL_SCRIPT_PATH} {RUNNER_USER}
  else
    {INSTALL_SCRIPT_PATH}
  fi
  echo "install script exited $?"
  rm -f {INSTALL_SCRIPT_PATH}
) >{LOG_PATH} 2>&1 </dev/null &
exit 0
""".strip()


@dataclass(frozen=True, kw_only=True)
class Injection:
    """What a claimed warm instance gets: files (path, content, mode), then a command."""

    files: tuple[tuple[str, bytes, int], ...] = field(repr=False)
    command: tuple[str, ...] = ("/bin/sh", "-c", _inject_command([]))

    @property
    def prepare(self) -> tuple[str, ...]:
        """The command that makes the folders of the files and of the install log (Incus
        writes only into existing folders; a minimal image may lack ``/var/log``)."""
        paths = [LOG_PATH, STARTED_PATH, *(path for path, _, _ in self.files)]
        folders = sorted({path.rsplit("/", 1)[0] for path in paths} - {""})
        return ("mkdir", "-p", *folders)


def injection(bootstrap: Bootstrap, *, script: bytes | None = None) -> Injection:
    script = install_script(bootstrap) if script is None else script
    files = [
        (path, content, 0o755)
        for path, (_, content) in zip(
            pre_install_paths(bootstrap), bootstrap.specs.pre_install_scripts, strict=True
        )
    ]
    files.append((INSTALL_SCRIPT_PATH, script, 0o755))
    if bootstrap.ca_bundle:
        files.append((CA_BUNDLE_PATH, bootstrap.ca_bundle, 0o644))
    proxy = _proxy_lines(bootstrap)
    if proxy:
        files.append((PROXY_PATH, proxy.encode(), 0o644))
    command = ("/bin/sh", "-c", _inject_command(pre_install_paths(bootstrap)))
    return Injection(files=tuple(files), command=command)
