"""The runner's install script (reconciler.garm.install): a pool's template rendered with
GARM's template context (``InstallRunnerParams``), GARM's own rendered wrapper passed
byte for byte, and failures that never show the token."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest

from reconciler.garm.errors import ProviderError
from reconciler.garm.install import install_context, install_script
from reconciler.garm.protocol import parse_bootstrap
from tests.support.garm import CA_PEM, INSTALL_RUNNER_PARAMS, TOKEN, b64, bootstrap

pytestmark = pytest.mark.timeout(60)


def with_specs(name: str = "garm-t-1", **changes: Any) -> Any:
    body = bootstrap(name, "small")
    specs = body["extra_specs"] | changes.pop("extra_specs", {})
    body.update(changes, extra_specs=specs)
    return parse_bootstrap(orjson.dumps(body))


def test_the_template_context_is_garms_install_runner_params() -> None:
    b = with_specs(
        labels=["self-hosted", "gpu"],
        extra_specs={"extra_context": {"marker": "blue"}, "enable_boot_debug": True},
        **{"github-runner-group": "team-a"},
    )
    context = install_context(b)
    assert list(context.fields) == INSTALL_RUNNER_PARAMS
    fields = context.fields
    assert (
        fields["RunnerName"] == "garm-t-1" and fields["RepoURL"] == "https://github.com/octo/repo"
    )
    assert fields["MetadataURL"].endswith("/metadata") and fields["CallbackURL"].endswith(
        "/callbacks"
    )
    assert fields["CallbackToken"] == TOKEN and fields["CABundle"] == CA_PEM.decode()
    assert fields["RunnerLabels"] == "self-hosted,gpu" and fields["GitHubRunnerGroup"] == "team-a"
    assert fields["RunnerUsername"] == fields["RunnerGroup"] == "runner"
    assert fields["FileName"] == "actions-runner-linux-x64-2.321.0.tar.gz"
    assert fields["DownloadURL"].endswith("runner.tar.gz")
    assert fields["ExtraContext"] == {"marker": "blue"}
    assert fields["EnableBootDebug"] is True and fields["UseJITConfig"] is True


def test_a_pools_template_is_rendered_with_the_runners_values() -> None:
    template = (
        "#!/bin/sh\n"
        "# {{ .RunnerName }} for {{ .RepoURL }}\n"
        "{{- if .UseJITConfig }}\n"
        "echo jit\n"
        "{{- end }}\n"
        'echo "marker={{ index .ExtraContext "marker" }} {{ .ExtraContext.marker }}"\n'
        "curl -H 'Authorization: Bearer {{ .CallbackToken }}' {{ .MetadataURL }}/x\n"
    )
    b = with_specs(
        extra_specs={"runner_install_template": b64(template), "extra_context": {"marker": "m"}}
    )
    assert install_script(b).decode() == (
        "#!/bin/sh\n"
        "# garm-t-1 for https://github.com/octo/repo\n"
        "echo jit\n"
        'echo "marker=m m"\n'
        f"curl -H 'Authorization: Bearer {TOKEN}' https://garm.example:9997/api/v1/metadata/x\n"
    )


def test_garms_rendered_wrapper_passes_byte_for_byte() -> None:
    # the shape of GARM's linux wrapper once GARM rendered it: bash, no template action
    wrapper = (
        "#!/bin/bash\n\nset -ex\nset -o pipefail\n\n"
        'CALLBACK_URL="https://garm.example:9997/api/v1/callbacks"\n'
        f'BEARER_TOKEN="{TOKEN}"\n'
        "export HTTP_PROXY='http://proxy:3128'\n\n"
        'function call() {\n\tPAYLOAD="$1"\n'
        '\t[[ $CALLBACK_URL =~ ^(.*)/status(/)?$ ]] || CALLBACK_URL="${CALLBACK_URL}/status"\n'
        "}\n"
        'HTTP_CODE=$(curl -s -w "%{http_code}" -o /tmp/real-install.sh "$METADATA_URL/" '
        '|| echo "000")\n'
        "chmod +x /tmp/real-install.sh\n"
    ).encode() + b"\xff\xfe binary tail\n"
    b = with_specs(extra_specs={"runner_install_template": base64.b64encode(wrapper).decode()})
    assert install_script(b) == wrapper


def test_a_template_that_cannot_render_fails_without_the_token() -> None:
    bad = "#!/bin/sh\nTOKEN={{ .CallbackToken }}\n{{ .CallbackToken | frobnicate }}\n"
    b = with_specs(extra_specs={"runner_install_template": b64(bad)})
    with pytest.raises(ProviderError) as caught:
        install_script(b)
    assert caught.value.message == (
        "extra_specs.runner_install_template: line 3: function 'frobnicate' is not defined"
    )
    b = with_specs(extra_specs={"runner_install_template": b64("{{ .CallbackToken.x }}")})
    with pytest.raises(ProviderError) as caught:
        install_script(b)
    assert TOKEN not in caught.value.message


def test_without_tools_the_tool_fields_are_a_clear_error() -> None:
    template = b64("{{ .RunnerName }} {{ .DownloadURL }}")
    b = with_specs(tools=[], extra_specs={"runner_install_template": template})
    with pytest.raises(ProviderError, match=r"can't evaluate field DownloadURL .*no tools"):
        install_script(b)
    assert (
        install_script(
            with_specs(tools=[], extra_specs={"runner_install_template": b64("{{ .RunnerName }}")})
        )
        == b"garm-t-1"
    )
