"""The runner's install script (``/install_runner.sh``): a pool's
``runner_install_template`` rendered as GARM's provider library renders it, or, without
one, a small script that fetches GARM's install script from its metadata service.

The template is a Go ``text/template`` (:mod:`.gotemplate`) executed with the library's
``InstallRunnerParams``: ``FileName``, ``DownloadURL`` and ``TempDownloadToken`` (of the
bootstrap's tool for this OS and architecture), ``RunnerUsername`` and ``RunnerGroup``
(``runner``), ``RepoURL``, ``MetadataURL``, ``RunnerName``, ``RunnerLabels`` (the labels
joined with commas), ``CallbackURL``, ``CallbackToken`` (the instance token), ``CABundle``
(PEM), ``GitHubRunnerGroup``, ``EnableBootDebug``, ``ExtraContext`` (the pool's
``extra_context``) and ``UseJITConfig``. GARM's own wrapper (GARM ≥ 0.2.0 puts it in the
template when the pool sets none) arrives rendered, holds no action, and so comes out
byte for byte.

Rules: pure. What is returned holds the instance token and goes to Incus only. A
template that cannot be rendered is a :class:`~reconciler.garm.errors.ProviderError`
naming the line and the construct, scrubbed of the bootstrap's secrets.
"""

from __future__ import annotations

import shlex

from reconciler.garm.errors import ProviderError
from reconciler.garm.gotemplate import Struct, TemplateError, parse
from reconciler.garm.protocol import Bootstrap, Tool

__all__ = ["RUNNER_USER", "boot_debug", "check_template", "install_context", "install_script"]

#: the user that runs the runner (garm-provider-common's ``defaults.DefaultUser``)
RUNNER_USER = "runner"
#: GARM's architectures and OS types → GitHub's names in ``tools``
_GITHUB_ARCH = {"amd64": "x64", "arm64": "arm64", "arm": "arm", "i386": "x86"}
_GITHUB_OS = {"linux": "linux", "windows": "win"}
_TOOL_FIELDS = ("FileName", "DownloadURL", "TempDownloadToken")


def tool_for(bootstrap: Bootstrap) -> Tool | None:
    """The download for the runner's OS and architecture (GARM's or GitHub's names)."""
    arch = {bootstrap.arch, _GITHUB_ARCH.get(bootstrap.arch, bootstrap.arch)}
    os = {bootstrap.os_type, _GITHUB_OS.get(bootstrap.os_type, bootstrap.os_type)}
    for tool in bootstrap.tools:
        if tool.os in os and tool.architecture in arch:
            return tool
    return None


def boot_debug(bootstrap: Bootstrap) -> bool:
    """``enable_boot_debug``: the pool's extra spec, else the bootstrap's option."""
    said = bootstrap.specs.enable_boot_debug
    return bootstrap.enable_boot_debug if said is None else said


def install_context(bootstrap: Bootstrap) -> Struct:
    """garm-provider-common's ``InstallRunnerParams`` for this runner."""
    tool = tool_for(bootstrap)
    fields: dict[str, object] = {
        "FileName": tool.filename if tool else "",
        "DownloadURL": tool.download_url if tool else "",
        "RunnerUsername": RUNNER_USER,
        "RunnerGroup": RUNNER_USER,
        "RepoURL": bootstrap.repo_url,
        "MetadataURL": bootstrap.metadata_url,
        "RunnerName": bootstrap.name,
        "RunnerLabels": ",".join(bootstrap.labels),
        "CallbackURL": bootstrap.callback_url,
        "CallbackToken": bootstrap.instance_token,
        "TempDownloadToken": tool.temp_download_token if tool else "",
        "CABundle": (bootstrap.ca_bundle or b"").decode("utf-8", "surrogateescape"),
        "GitHubRunnerGroup": bootstrap.github_runner_group,
        "EnableBootDebug": boot_debug(bootstrap),
        "ExtraContext": dict(bootstrap.specs.extra_context),
        "UseJITConfig": bootstrap.jit_config_enabled,
    }
    if tool is None:  # the tool's fields are absent: a template using them fails clearly
        without = {k: v for k, v in fields.items() if k not in _TOOL_FIELDS}
        return Struct("InstallRunnerParams (the bootstrap has no tools for it)", without)
    return Struct("InstallRunnerParams", fields)


def _failure(bootstrap: Bootstrap, error: TemplateError) -> ProviderError:
    message = str(error)
    for secret in bootstrap.secrets():  # errors never quote values; this is a second lock
        message = message.replace(secret, "[secret]")
    return ProviderError(f"extra_specs.runner_install_template: {message}")


def check_template(template: bytes) -> None:
    """Parse a template without rendering it (``ValidatePoolInfo``)."""
    try:
        parse(template.decode("utf-8", "surrogateescape"))
    except TemplateError as exc:
        raise ProviderError(f"extra_specs.runner_install_template: {exc}") from None


def install_script(bootstrap: Bootstrap) -> bytes:
    """The pool's template rendered for this runner, or the fetching script."""
    template = bootstrap.specs.install_template
    if template is None:
        return _fetching_script(bootstrap)
    try:
        rendered = parse(template.decode("utf-8", "surrogateescape")).render(
            install_context(bootstrap)
        )
    except TemplateError as exc:
        raise _failure(bootstrap, exc) from None
    return rendered.encode("utf-8", "surrogateescape")


def _fetching_script(bootstrap: Bootstrap) -> bytes:
    """Fetch GARM's install script from its metadata service with the instance token."""
    quoted_url = shlex.quote(bootstrap.metadata_url.rstrip("/") + "/install-script/")
    token = shlex.quote(bootstrap.instance_token)
    trace = "set -x\n" if boot_debug(bootstrap) else ""
    return (
        "#!/bin/sh\n"
        "set -e\n"
        f"{trace}"
        f'curl --retry 5 -fsSL -H "Authorization: Bearer "{token} {quoted_url}'
        " -o /tmp/garm-install.sh\n"
        "chmod 0755 /tmp/garm-install.sh\n"
        "exec /tmp/garm-install.sh\n"
    ).encode()
