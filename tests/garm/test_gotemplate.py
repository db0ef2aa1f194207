"""Runner install templates: the Go ``text/template`` subset (:mod:`reconciler.garm.gotemplate`).
The install script rendered with GARM's template context is in ``test_install.py``.

The expected outputs of ``GO_RENDERED`` were produced by Go's own ``text/template``
(Go 1.27, ``template.New("").Parse(tpl).Execute`` with garm-provider-common's
``InstallRunnerParams`` holding the values of :data:`CONTEXT`), once, by hand: the suite
itself needs no Go."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reconciler.garm.gotemplate import Struct, TemplateError, parse
from tests.support.garm import INSTALL_RUNNER_PARAMS

pytestmark = pytest.mark.timeout(60)

CONTEXT: dict[str, Any] = {name: "" for name in INSTALL_RUNNER_PARAMS} | {
    "RunnerName": "garm-r1",
    "RepoURL": "https://github.com/o/r",
    "RunnerUsername": "runner",
    "RunnerLabels": "x,y",
    "EnableBootDebug": False,
    "UseJITConfig": True,
    "ExtraContext": {"marker": "m-1", "b": "two", "a": ""},
}

GO_RENDERED = [
    (
        "{{ .RunnerName }}|{{ .ExtraContext.marker }}|{{ .ExtraContext.missing }}"
        '|{{ index .ExtraContext "missing" }}|{{ .ExtraContext }}',
        "garm-r1|m-1|<no value>||map[a: b:two marker:m-1]",
    ),
    (
        "a  {{- .RunnerName -}}  b",
        "agarm-r1b",
    ),
    (
        "a\n  {{- if .UseJITConfig }}\njit\n  {{- else }}\nnojit\n  {{- end }}\nend",
        "a\njit\nend",
    ),
    (
        "{{ if .EnableBootDebug }}x{{ else if .UseJITConfig }}y{{ else }}z{{ end }}",
        "y",
    ),
    (
        "{{ if or .EnableBootDebug .RunnerName }}o{{ end }}"
        "{{ if and .UseJITConfig .FileName }}a{{ else }}na{{ end }}",
        "ona",
    ),
    (
        "{{ range $k, $v := .ExtraContext }}{{ $k }}={{ $v }};{{ end }}",
        "a=;b=two;marker=m-1;",
    ),
    (
        "{{ range .ExtraContext }}[{{ . }}]{{ else }}none{{ end }}",
        "[][two][m-1]",
    ),
    (
        "{{ with .ExtraContext.marker }}have {{ . }}{{ else }}none{{ end }}",
        "have m-1",
    ),
    (
        "{{ with .ExtraContext.missing }}have {{ . }}{{ else with .RunnerName }}r={{ . }}{{ end }}",
        "r=garm-r1",
    ),
    (
        '{{ $x := .RunnerName }}{{ $x }}{{ $x = "b" }}{{ $x }}{{ $.RepoURL }}',
        "garm-r1bhttps://github.com/o/r",
    ),
    (
        '{{ printf "%s-%d %q %v %t %%" .RunnerName 3 .RepoURL .ExtraContext true }}',
        'garm-r1-3 "https://github.com/o/r" map[a: b:two marker:m-1] true %',
    ),
    (
        '{{ print 1 2 "a" 3 "b" "c" }}|{{ println 1 "a" }}|',
        "1 2a3bc|1 a\n|",
    ),
    (
        '{{ eq .RunnerName "garm-r1" }} {{ ne 1 2 }} {{ lt 1 2 }} {{ ge "b" "a" }}'
        " {{ eq 1 2 3 1 }}",
        "true true true true true",
    ),
    (
        "{{ len .RunnerName }} {{ len .ExtraContext }} {{ not .UseJITConfig }}",
        "7 3 false",
    ),
    (
        "{{/* a comment */}}x{{- /* trimmed */ -}}  y",
        "xy",
    ),
    (
        '{{ "a\\tb\\x41\\u00e9" }}|{{ `raw\\n` }}|{{ 42 }}|{{ -7 }}|{{ true }}',
        "a\tbAé|raw\\n|42|-7|true",
    ),
    (
        '{{ index .ExtraContext "marker" }}{{ (index .ExtraContext "b") }}{{ (.ExtraContext).b }}',
        "m-1twotwo",
    ),
    (
        '{{ if eq (index .ExtraContext "marker") "m-1" }}yes{{ end }}',
        "yes",
    ),
    (
        "{{ range 3 }}{{ . }}{{ end }}",
        "012",
    ),
    (
        '{{ and 1 0 2 }}{{ or 0 "" "x" }}{{ or 0 "" }}',
        "0x",
    ),
    (
        "{{ not .ExtraContext.missing }}{{ if .ExtraContext.missing }}t{{ else }}"
        'f{{ end }}{{ eq .ExtraContext.missing "m" }}',
        "trueffalse",
    ),
    (
        "x {{ if true -}}\n   y\n{{- end }} z",
        "x y z",
    ),
    (
        "{{ if\n  .UseJITConfig }}yes{{ end }}",
        "yes",
    ),
    (
        "{{ $i := 0 }}{{ range $k, $v := .ExtraContext }}{{ $i = $k }}{{ end }}{{ $i }}",
        "marker",
    ),
    (
        "{{ with $m := .ExtraContext.marker }}{{ $m }}{{ . }}{{ end }}",
        "m-1m-1",
    ),
]


def render(template: str, **context: Any) -> str:
    return parse(template).render(Struct("InstallRunnerParams", CONTEXT | context))


@pytest.mark.parametrize(("template", "expected"), GO_RENDERED)
def test_templates_render_as_go_renders_them(template: str, expected: str) -> None:
    assert render(template) == expected


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ .Nope }}", "line 1: can't evaluate field Nope in type InstallRunnerParams"),
        ("{{ .RunnerName.Foo }}", "can't evaluate field Foo in type string"),
        ('{{ template "x" }}', "{{template}} is not supported"),
        ('{{ define "x" }}y{{ end }}', "{{define}} is not supported"),
        ("{{ block }}{{ end }}", "{{block}} is not supported"),
        ("{{ range 3 }}{{ break }}{{ end }}", "{{break}} is not supported"),
        ("{{ html .RunnerName }}", "function 'html' is not supported"),
        ("{{ foo .RunnerName }}", "function 'foo' is not defined"),
        ("x\n{{ if .RunnerName }}unterminated", "line 2: {{if}} has no {{end}}"),
        ("{{ end }}", "unexpected {{end}}"),
        ("{{ 'a' }}", "character constants are not supported"),
        ("{{ 1.5 }}", "only decimal integer constants"),
        ("{{ 0x1F }}", "only decimal integer constants"),
        ("{{ nil }}", "nil is not a command"),
        ("{{ $undefined }}", "undefined variable $undefined"),
        ('{{ "x" | .RunnerName }}', "can't give an argument to a non-function"),
        ("{{ print(1) }}", "missing space"),
        ("{{ eq .RunnerName 1 }}", "incompatible types for comparison"),
        ('{{ printf "%d" "x" }}', "%d needs an int"),
        ('{{ printf "%s" }}', "no argument for %s"),
        ('{{ printf "%x" 1 }}', "only the verbs"),
        ("{{ range .RunnerName }}{{ end }}", "range can't iterate over a string"),
        ("{{ and }}", "wrong number of arguments for and"),
        ("{{ .RunnerName", "unclosed action"),
        ("{{/* x */ .RunnerName }}", "comment ends before closing delimiter"),
        ('{{ "abc }}', "unterminated quoted string"),
        ("{{ (print 1 }}", "unclosed left parenthesis"),
        ("{{ index .ExtraContext 1 }}", "map keys are strings"),
    ],
)
def test_what_is_not_supported_or_wrong_is_a_clear_error(template: str, message: str) -> None:
    with pytest.raises(TemplateError) as caught:
        render(template)
    assert message in str(caught.value)


@given(st.binary(max_size=300).filter(lambda b: b"{{" not in b))
def test_text_without_actions_comes_out_byte_for_byte(data: bytes) -> None:
    text = data.decode("utf-8", "surrogateescape")
    out = parse(text).render(Struct("T", {}))
    assert out.encode("utf-8", "surrogateescape") == data


def test_errors_never_quote_the_template_or_a_value() -> None:
    secret = "s3cr3t/value.XYZ"
    for template in (
        f'{{{{ "{secret}" | foo }}}}',
        f"{{{{ {secret} }}}}",
        f'{secret}\n{{{{ printf "%d" "{secret}" }}}}',
        f"{{{{ `{secret}` .RunnerName }}}}",
    ):
        with pytest.raises(TemplateError) as caught:
            render(template)
        assert secret not in str(caught.value) and "s3cr3t" not in str(caught.value)
    with pytest.raises(TemplateError) as caught:
        render('{{ printf "%d" .CallbackToken }}', CallbackToken=secret)
    assert secret not in str(caught.value)
    # names are shown (a function or field the template asks for), cut short
    with pytest.raises(TemplateError, match=r"function 'a{40}…' is not defined"):
        render("{{ " + "a" * 60 + " }}")
