"""GARM's bootstrap, turned into what an instance runs: cloud-init user data for a cold
instance, files and one command for a warm one that is already booted.

Pure functions. Everything returned here may hold the instance token (the install
script embeds it) and goes to Incus only: never into a log line or onto the bus.
"""

from __future__ import annotations

import base64
import shlex
from dataclasses import dataclass, field

import orjson

from reconciler.garm.protocol import Bootstrap

__all__ = [
    "CA_BUNDLE_PATH",
    "INSTALL_SCRIPT_PATH",
    "PROXY_PATH",
    "Injection",
    "cloud_config",
    "injection",
    "install_script",
]

INSTALL_SCRIPT_PATH = "/install_runner.sh"
CA_BUNDLE_PATH = "/usr/local/share/ca-certificates/garm-ca-bundle.crt"
PROXY_PATH = "/etc/profile.d/garm-proxy.sh"
RUNNER_USER = "runner"
LOG_PATH = "/var/log/garm-runner-install.log"
#: made (atomically, by ``mkdir``) when the install script is started in a warm instance
STARTED_PATH = "/var/lib/garm-runner/install-started"


def install_script(bootstrap: Bootstrap) -> bytes:
    """GARM's own rendered wrapper (``extra_specs.runner_install_template``), or a
    minimal one that fetches the install script from GARM's metadata service."""
    template = bootstrap.install_template()
    if template is not None:
        return template
    quoted_url = shlex.quote(bootstrap.metadata_url.rstrip("/") + "/install-script/")
    token = shlex.quote(bootstrap.instance_token)
    return (
        "#!/bin/sh\n"
        "set -e\n"
        f'curl --retry 5 -fsSL -H "Authorization: Bearer "{token} {quoted_url}'
        " -o /tmp/garm-install.sh\n"
        "chmod 0755 /tmp/garm-install.sh\n"
        "exec /tmp/garm-install.sh\n"
    ).encode()


def _proxy_lines(bootstrap: Bootstrap) -> str:
    lines = []
    for key in ("http_proxy", "https_proxy", "no_proxy"):
        value = bootstrap.proxy.get(key)
        if value:
            lines.append(f"export {key}={shlex.quote(value)}")
            lines.append(f"export {key.upper()}={shlex.quote(value)}")
    return "\n".join(lines) + ("\n" if lines else "")


def cloud_config(bootstrap: Bootstrap) -> str:
    """``#cloud-config`` user data (JSON is YAML): the runner user, packages, the CA
    bundle, proxy settings and the install script run as the runner user."""
    script = install_script(bootstrap)
    files = [
        {
            "path": INSTALL_SCRIPT_PATH,
            "permissions": "0755",
            "owner": "root:root",
            "encoding": "b64",
            "content": base64.b64encode(script).decode(),
        }
    ]
    proxy = _proxy_lines(bootstrap)
    if proxy:
        files.append({"path": PROXY_PATH, "permissions": "0644", "content": proxy})
    config: dict[str, object] = {
        "package_upgrade": False,
        "package_update": not bootstrap.disable_updates_on_boot,
        "packages": sorted({"curl", "tar", *bootstrap.extra_packages}),
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
        "runcmd": [["su", "-l", "-c", INSTALL_SCRIPT_PATH, RUNNER_USER]],
    }
    if bootstrap.ca_bundle:
        config["ca_certs"] = {"trusted": [bootstrap.ca_bundle.decode("utf-8", "replace")]}
    if bootstrap.enable_boot_debug:
        config["output"] = {"all": "| tee -a /var/log/cloud-init-output.log"}
    return "#cloud-config\n" + orjson.dumps(config, option=orjson.OPT_INDENT_2).decode() + "\n"


#: run in a warm instance after the files landed: trust the CA bundle, then start the
#: install script in the background as the runner user (root when the image has none),
#: its output in LOG_PATH. At most once per instance: a call killed after the start and
#: run again by GARM (same runner name, same instance) must not register the runner a
#: second time, so the start is guarded by an atomic mkdir. The command holds no secret.
_INJECT = f"""
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
if id {RUNNER_USER} >/dev/null 2>&1 && command -v su >/dev/null 2>&1; then
  su -l -c {INSTALL_SCRIPT_PATH} {RUNNER_USER} >{LOG_PATH} 2>&1 </dev/null &
else
  {INSTALL_SCRIPT_PATH} >{LOG_PATH} 2>&1 </dev/null &
fi
exit 0
""".strip()


@dataclass(frozen=True, kw_only=True)
class Injection:
    """What a claimed warm instance gets: files (path, content, mode), then a command."""

    files: tuple[tuple[str, bytes, int], ...] = field(repr=False)
    command: tuple[str, ...] = ("/bin/sh", "-c", _INJECT)

    @property
    def prepare(self) -> tuple[str, ...]:
        """The command that makes the folders of the files and of the install log (Incus
        writes only into existing folders; a minimal image may lack ``/var/log``)."""
        paths = [LOG_PATH, STARTED_PATH, *(path for path, _, _ in self.files)]
        folders = sorted({path.rsplit("/", 1)[0] for path in paths} - {""})
        return ("mkdir", "-p", *folders)


def injection(bootstrap: Bootstrap) -> Injection:
    files = [(INSTALL_SCRIPT_PATH, install_script(bootstrap), 0o755)]
    if bootstrap.ca_bundle:
        files.append((CA_BUNDLE_PATH, bootstrap.ca_bundle, 0o644))
    proxy = _proxy_lines(bootstrap)
    if proxy:
        files.append((PROXY_PATH, proxy.encode(), 0o644))
    return Injection(files=tuple(files))
