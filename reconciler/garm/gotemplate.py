"""Go's ``text/template``, the part that runner install templates use.

GARM's provider library renders a pool's ``runner_install_template`` with Go's
``text/template`` (``template.New("").Parse(tpl)``, no functions added, then ``Execute``
with the runner's values). This module does the same in Python for the constructs such
templates use (GARM's shipped templates, the provider library's own, and the
``extra_context`` examples of GARM's documentation):

- text, kept exactly; ``{{- `` and `` -}}`` trim the white space beside an action;
  comments ``{{/* … */}}``;
- actions printing a pipeline: fields (``.RunnerName``, ``.ExtraContext.marker``), ``.``,
  ``$`` and variables (``$x``, ``$x.Field``), quoted and raw strings, decimal integers,
  ``true``, ``false``, ``nil``, parenthesised pipelines, and ``|`` chains;
- ``if`` / ``else if`` / ``else`` / ``end``, ``with`` (``else with``, ``else``),
  ``range`` over maps (by sorted key), lists and integers, with one or two variables and
  an ``else``;
- variables declared (``{{ $x := … }}``) and assigned (``{{ $x = … }}``);
- the functions ``and``, ``or``, ``not``, ``eq``, ``ne``, ``lt``, ``le``, ``gt``, ``ge``,
  ``len``, ``index``, ``print``, ``println`` and ``printf`` (verbs ``%s %v %d %t %q %%``).

Go's rules are kept: a field missing from a map prints ``<no value>`` while ``index`` of
a missing key gives ``""``; ``and``/``or`` stop at the first deciding argument; maps print
as ``map[k:v …]``. Anything else (``define``, ``template``, ``block``, ``break``,
``continue``, the functions ``html``, ``js``, ``urlquery``, ``slice`` and ``call``, method
calls, character and floating-point constants, a ``printf`` verb or argument Go would
print as ``%!…``) is a :class:`TemplateError`, so a template is rendered whole or not at
all.

Rules: pure (no I/O). **Errors name the line and the construct, never text of the
template nor a value**: templates and the values they are given carry secrets (GARM's
rendered wrapper embeds the instance token), and errors end up in GARM's database.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NO_VALUE", "Struct", "Template", "TemplateError", "parse"]


class TemplateError(ValueError):
    """A template that cannot be parsed or rendered; ``line`` is 1-based (0: unknown)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line
        self.message = message


class _NoValue:
    """Go's invalid value: what a field of a map gives for a key that is not there."""

    _instance: _NoValue | None = None

    def __new__(cls) -> _NoValue:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE = _NoValue()


@dataclass(frozen=True)
class Struct:
    """A Go struct: a type name and its fields, in declaration order. A field it does not
    have is an error (Go: "can't evaluate field X in type T")."""

    type_name: str
    fields: Mapping[str, Any] = field(repr=False)


# --------------------------------------------------------------------------- lexing

_SPACE = " \t\r\n"
_IDENT_START = re.compile(r"[A-Za-z_]")
_ALNUM = re.compile(r"[A-Za-z0-9_]*")
_INTEGER = re.compile(r"[+-]?[0-9][0-9A-Za-z_.]*")
_KEYWORDS = frozenset(
    {"if", "else", "end", "range", "with", "define", "template", "block", "break", "continue"}
)
_UNSUPPORTED_KEYWORDS = frozenset({"define", "template", "block", "break", "continue"})
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_ESCAPES |= {"\\": "\\", '"': '"'}


@dataclass(frozen=True)
class _Token:
    kind: str  # text field var ident keyword string number bool nil pipe ( ) := = , . }} eof
    value: Any
    line: int
    spaced: bool = False  # white space before it (separates arguments)


def _ident(name: str) -> str:
    """An identifier as errors may show it: short, and only ever a name."""
    return name if len(name) <= 40 else name[:40] + "…"


class _Lexer:
    def __init__(self, source: str) -> None:
        self.src = source
        self.pos = 0
        self.tokens: list[_Token] = []

    def line_at(self, pos: int) -> int:
        return self.src.count("\n", 0, pos) + 1

    def error(self, pos: int, message: str) -> TemplateError:
        return TemplateError(self.line_at(pos), message)

    def run(self) -> list[_Token]:
        src = self.src
        trim_next = False
        while True:
            start = src.find("{{", self.pos)
            text = src[self.pos :] if start < 0 else src[self.pos : start]
            if trim_next:
                text = text.lstrip(_SPACE)
            left_trim = start >= 0 and src.startswith("-", start + 2) and _is_space(src, start + 3)
            if left_trim:
                text = text.rstrip(_SPACE)
            if text:
                self.tokens.append(_Token("text", text, self.line_at(self.pos)))
            if start < 0:
                self.tokens.append(_Token("eof", None, self.line_at(len(src))))
                return self.tokens
            self.pos = start + (4 if left_trim else 2)
            trim_next = self._action(start)

    def _action(self, start: int) -> bool:
        """Lex one action from ``self.pos``; whether it trims the text after it."""
        src = self.src
        if src.startswith("/*", self.pos):
            end = src.find("*/", self.pos + 2)
            if end < 0:
                raise self.error(start, "unclosed comment")
            self.pos = end + 2
            trim = self._at_right_delim()
            if trim is None:
                raise self.error(start, "comment ends before closing delimiter")
            return trim
        self.tokens.append(_Token("{{", None, self.line_at(start)))
        spaced = False
        while True:
            trim = self._at_right_delim()
            if trim is not None:
                self.tokens.append(_Token("}}", None, self.line_at(self.pos)))
                return trim
            if self.pos >= len(src):
                raise self.error(start, "unclosed action")
            char = src[self.pos]
            if char in _SPACE:
                self.pos += 1
                spaced = True
                continue
            self.tokens.append(self._token(char, spaced))
            spaced = False

    def _at_right_delim(self) -> bool | None:
        """At ``}}`` (False) or `` -}}`` (True): consume it; else ``None``."""
        src = self.src
        if src.startswith("}}", self.pos):
            self.pos += 2
            return False
        if _is_space(src, self.pos) and src.startswith("-}}", self.pos + 1):
            self.pos += 4
            return True
        return None

    def _token(self, char: str, spaced: bool) -> _Token:
        src, pos = self.src, self.pos
        line = self.line_at(pos)

        def made(kind: str, value: Any, end: int) -> _Token:
            self.pos = end
            return _Token(kind, value, line, spaced)

        if src.startswith(":=", pos):
            return made(":=", None, pos + 2)
        if char in "|(),=":
            return made(char, None, pos + 1)
        if char == '"':
            return self._quoted(line, spaced)
        if char == "`":
            end = src.find("`", pos + 1)
            if end < 0:
                raise self.error(pos, "unterminated raw string")
            return made("string", src[pos + 1 : end], end + 1)
        if char == "'":
            raise self.error(pos, "character constants are not supported")
        if char == ".":
            name = _ALNUM.match(src, pos + 1)
            assert name is not None
            if not name.group():
                return made(".", None, pos + 1)
            if name.group()[0].isdigit():
                raise self.error(pos, "floating-point constants are not supported")
            return made("field", name.group(), name.end())
        if char == "$":
            name = _ALNUM.match(src, pos + 1)
            assert name is not None
            return made("var", "$" + name.group(), name.end())
        if char.isdigit() or (char in "+-" and pos + 1 < len(src) and src[pos + 1].isdigit()):
            number = _INTEGER.match(src, pos)
            assert number is not None
            if not re.fullmatch(r"[+-]?[0-9]+", number.group()):
                raise self.error(pos, "only decimal integer constants are supported")
            return made("number", int(number.group()), number.end())
        if _IDENT_START.match(char):
            name = _ALNUM.match(src, pos)
            assert name is not None
            word = name.group()
            if word in ("true", "false"):
                return made("bool", word == "true", name.end())
            if word == "nil":
                return made("nil", None, name.end())
            return made("keyword" if word in _KEYWORDS else "ident", word, name.end())
        raise self.error(pos, f"unexpected character U+{ord(char):04X} in an action")

    def _quoted(self, line: int, spaced: bool) -> _Token:
        src = self.src
        start = self.pos
        pos = start + 1
        out: list[str] = []
        while True:
            if pos >= len(src) or src[pos] == "\n":
                raise self.error(start, "unterminated quoted string")
            char = src[pos]
            if char == '"':
                self.pos = pos + 1
                return _Token("string", "".join(out), line, spaced)
            if char != "\\":
                out.append(char)
                pos += 1
                continue
            code = src[pos + 1 : pos + 2]
            if code in _ESCAPES:
                out.append(_ESCAPES[code])
                pos += 2
            elif code in ("x", "u", "U"):
                width = {"x": 2, "u": 4, "U": 8}[code]
                digits = src[pos + 2 : pos + 2 + width]
                if not re.fullmatch(f"[0-9A-Fa-f]{{{width}}}", digits):
                    raise self.error(start, "bad escape in a quoted string")
                out.append(chr(int(digits, 16)))
                pos += 2 + width
            elif re.fullmatch("[0-7]{3}", src[pos + 1 : pos + 4]):
                out.append(chr(int(src[pos + 1 : pos + 4], 8)))
                pos += 4
            else:
                raise self.error(start, "bad escape in a quoted string")


def _is_space(src: str, pos: int) -> bool:
    return pos < len(src) and src[pos] in _SPACE


# --------------------------------------------------------------------------- tree


@dataclass(frozen=True)
class _Text:
    text: str


@dataclass(frozen=True)
class _Literal:
    value: Any


@dataclass(frozen=True)
class _Dot:
    pass


@dataclass(frozen=True)
class _Fields:
    """``.A.B`` (``base`` None: on dot), ``$x.A`` (``base`` a variable name) or
    ``(pipeline).A`` (``base`` a pipeline)."""

    base: str | _Pipe | None
    names: tuple[str, ...]


@dataclass(frozen=True)
class _Function:
    name: str


@dataclass(frozen=True)
class _Command:
    line: int
    args: tuple[Any, ...]


@dataclass(frozen=True)
class _Pipe:
    line: int
    decl: tuple[str, ...] = ()
    assign: bool = False
    cmds: tuple[_Command, ...] = ()


@dataclass(frozen=True)
class _Action:
    pipe: _Pipe


@dataclass(frozen=True)
class _Control:
    kind: str  # if, with, range
    pipe: _Pipe
    body: tuple[Any, ...]
    otherwise: tuple[Any, ...] | None


_FUNCTIONS = frozenset(
    {"and", "or", "not", "eq", "ne", "lt", "le", "gt", "ge", "len", "index", "print"}
    | {"printf", "println"}
)
_GO_FUNCTIONS_NOT_SUPPORTED = frozenset({"html", "js", "urlquery", "slice", "call"})


class _Parser:
    def __init__(self, tokens: list[_Token]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.vars: list[str] = ["$"]

    def peek(self) -> _Token:
        return self.tokens[self.pos]

    def next(self) -> _Token:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def expect(self, kind: str, context: str) -> _Token:
        token = self.next()
        if token.kind != kind:
            raise TemplateError(token.line, f"unexpected {_describe(token)} in {context}")
        return token

    def parse(self) -> tuple[Any, ...]:
        nodes, end = self.items()
        if end.kind != "eof":
            raise TemplateError(end.line, f"unexpected {{{{{end.value}}}}}")
        return nodes

    def items(self) -> tuple[tuple[Any, ...], _Token]:
        """Nodes up to ``{{end}}``, ``{{else}}`` (their keyword token, after ``{{``) or EOF."""
        nodes: list[Any] = []
        while True:
            token = self.next()
            if token.kind == "eof":
                return tuple(nodes), token
            if token.kind == "text":
                nodes.append(_Text(token.value))
                continue
            head = self.peek()  # the token after {{
            if head.kind == "keyword":
                if head.value in ("end", "else"):
                    self.next()
                    return tuple(nodes), head
                self.next()
                nodes.append(self.control(head))
                continue
            nodes.append(_Action(self.pipeline("an action", allow_decl=True)))

    def control(self, keyword: _Token) -> _Control:
        if keyword.value in _UNSUPPORTED_KEYWORDS:
            raise TemplateError(keyword.line, f"{{{{{keyword.value}}}}} is not supported")
        mark = len(self.vars)
        try:
            return self._control(keyword)
        finally:
            del self.vars[mark:]

    def _control(self, keyword: _Token) -> _Control:
        kind = str(keyword.value)
        pipe = self.pipeline(f"{{{{{kind}}}}}", allow_decl=True, ranging=kind == "range")
        body, end = self.items()
        otherwise: tuple[Any, ...] | None = None
        if end.kind == "eof":
            raise TemplateError(keyword.line, f"{{{{{kind}}}}} has no {{{{end}}}}")
        if end.value == "else":
            chained = self.peek()
            if chained.kind == "keyword" and chained.value in ("if", "with") and kind != "range":
                if chained.value != kind:
                    raise TemplateError(chained.line, f"{{{{else {chained.value}}}}} in {kind}")
                self.next()
                otherwise = (self._control(chained),)  # shares this {{end}}
                return _Control(kind, pipe, body, otherwise)
            self.expect("}}", "{{else}}")
            otherwise, end = self.items()
            if end.kind == "eof" or end.value != "end":
                raise TemplateError(keyword.line, f"{{{{{kind}}}}} has no {{{{end}}}}")
        self.expect("}}", "{{end}}")
        return _Control(kind, pipe, body, otherwise)

    def pipeline(self, context: str, *, allow_decl: bool = False, ranging: bool = False) -> _Pipe:
        line = self.peek().line
        decl: list[str] = []
        assign = False
        if allow_decl and self.peek().kind == "var":
            decl, assign = self._declaration(ranging)
        cmds: list[_Command] = []
        while True:
            cmds.append(self.command(context))
            token = self.next()
            if token.kind == "|":
                continue
            if token.kind in ("}}", ")"):
                if token.kind == ")" and context != "parentheses":
                    raise TemplateError(token.line, f"unexpected ')' in {context}")
                if token.kind == "}}" and context == "parentheses":
                    raise TemplateError(token.line, "unclosed left parenthesis")
                break
            raise TemplateError(token.line, f"unexpected {_describe(token)} in {context}")
        if assign:
            for name in decl:
                if name not in self.vars:
                    raise TemplateError(line, f"undefined variable {_ident(name)}")
        else:
            self.vars.extend(decl)
        return _Pipe(line=line, decl=tuple(decl), assign=assign, cmds=tuple(cmds))

    def _declaration(self, ranging: bool) -> tuple[list[str], bool]:
        """``$x :=``, ``$x =`` or (range) ``$i, $e :=``; nothing consumed if not one."""
        start = self.pos
        names = [str(self.next().value)]
        if ranging and self.peek().kind == ",":
            self.next()
            second = self.next()
            if second.kind != "var":
                raise TemplateError(second.line, "range can only declare variables")
            names.append(str(second.value))
        token = self.peek()
        if token.kind in (":=", "="):
            self.next()
            return names, token.kind == "="
        if len(names) > 1:
            raise TemplateError(token.line, "range declares its variables with :=")
        self.pos = start
        return [], False

    def command(self, context: str) -> _Command:
        line = self.peek().line
        args: list[Any] = []
        while self.peek().kind not in ("|", "}}", ")", "eof"):
            token = self.peek()
            if args and not token.spaced:
                raise TemplateError(token.line, f"missing space before {_describe(token)}")
            args.append(self.operand())
        if not args:
            raise TemplateError(line, f"missing value in {context}")
        return _Command(line=line, args=tuple(args))

    def operand(self) -> Any:
        token = self.next()
        node: Any
        if token.kind == "field":
            names = [str(token.value)]
            names += self._chained()
            return _Fields(None, tuple(names))
        if token.kind == "var":
            if token.value not in self.vars:
                raise TemplateError(token.line, f"undefined variable {_ident(token.value)}")
            return _Fields(str(token.value), tuple(self._chained()))
        if token.kind == "(":
            node = self.pipeline("parentheses")
            chained = self._chained()
            return _Fields(node, tuple(chained)) if chained else node
        if token.kind == ".":
            return _Dot()
        if token.kind in ("string", "number", "bool", "nil"):
            if self.peek().kind == "field" and not self.peek().spaced:
                raise TemplateError(token.line, "a constant has no fields")
            return _Literal(token.value)
        if token.kind == "ident":
            name = str(token.value)
            if name in _GO_FUNCTIONS_NOT_SUPPORTED:
                raise TemplateError(token.line, f"function {name!r} is not supported")
            if name not in _FUNCTIONS:
                raise TemplateError(token.line, f"function {_ident(name)!r} is not defined")
            return _Function(name)
        if token.kind == "keyword":
            raise TemplateError(token.line, f"unexpected {{{{{token.value}}}}} in an operand")
        raise TemplateError(token.line, f"unexpected {_describe(token)} in an operand")

    def _chained(self) -> list[str]:
        names = []
        while self.peek().kind == "field" and not self.peek().spaced:
            names.append(str(self.next().value))
        return names


def _describe(token: _Token) -> str:
    """A token as an error may name it: its kind, and names only (never a literal)."""
    if token.kind in ("ident", "keyword"):
        return repr(_ident(str(token.value)))
    if token.kind in ("field", "var"):
        prefix = "." if token.kind == "field" else ""
        return _ident(f"{prefix}{token.value}")
    if token.kind == "}}":
        return "'}}'"
    if token.kind == "eof":
        return "end of template"
    if token.kind in ("string", "number", "bool", "nil"):
        return f"{token.kind} constant"
    return repr(token.kind)


# --------------------------------------------------------------------------- execution


def _type_name(value: Any) -> str:
    if isinstance(value, Struct):
        return value.type_name
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "map"
    if isinstance(value, Sequence):
        return "slice"
    return "nil"


def _truth(value: Any) -> bool:
    if value is None or value is NO_VALUE:
        return False
    if isinstance(value, Struct):
        return True
    if isinstance(value, bool | int | str | Mapping | Sequence):
        return bool(value)
    return True


def _printed(value: Any) -> str:
    """``fmt.Sprint`` of one value, as Go's template prints it."""
    if value is NO_VALUE:
        return "<no value>"
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | str):
        return str(value)
    if isinstance(value, Struct):
        return "{" + " ".join(_printed(v) for v in value.fields.values()) + "}"
    if isinstance(value, Mapping):
        items = " ".join(f"{_printed(k)}:{_printed(value[k])}" for k in sorted(value))
        return f"map[{items}]"
    if isinstance(value, Sequence):
        return "[" + " ".join(_printed(v) for v in value) + "]"
    raise TemplateError(0, f"cannot print a value of type {type(value).__name__}")


def _kind(value: Any) -> str:
    if value is None or value is NO_VALUE:
        return "nil"
    name = _type_name(value)
    return name if name in ("bool", "int", "string") else "other"


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "lt": lambda a, b: bool(a < b),
    "le": lambda a, b: bool(a <= b),
    "gt": lambda a, b: bool(a > b),
    "ge": lambda a, b: bool(a >= b),
}


def _equal(line: int, first: Any, second: Any) -> bool:
    kinds = (_kind(first), _kind(second))
    if "nil" in kinds:
        return kinds[0] == kinds[1]
    if kinds[0] != kinds[1]:
        raise TemplateError(line, "error calling eq: incompatible types for comparison")
    if kinds[0] == "other":
        raise TemplateError(line, "error calling eq: non-comparable type")
    return bool(first == second)


_VERB = re.compile(r"%([%svdtq])|%.?")


def _printf(line: int, args: list[Any]) -> str:
    if not args or not isinstance(args[0], str):
        raise TemplateError(line, "printf needs a format string first")
    values = iter(args[1:])
    out: list[str] = []
    pos = 0
    fmt = args[0]
    for verb in _VERB.finditer(fmt):
        out.append(fmt[pos : verb.start()])
        pos = verb.end()
        letter = verb.group(1)
        if letter is None:
            raise TemplateError(line, "printf: only the verbs %s %v %d %t %q %% are supported")
        if letter == "%":
            out.append("%")
            continue
        value = next(values, NO_VALUE)
        if value is NO_VALUE:
            raise TemplateError(line, f"printf: no argument for %{letter}")
        out.append(_verb(line, letter, value))
    if next(values, NO_VALUE) is not NO_VALUE:
        raise TemplateError(line, "printf: more arguments than verbs")
    out.append(fmt[pos:])
    return "".join(out)


def _verb(line: int, letter: str, value: Any) -> str:
    wanted = {"s": "string", "q": "string", "d": "int", "t": "bool"}.get(letter)
    if wanted is not None and _type_name(value) != wanted:
        article = "an" if wanted == "int" else "a"
        raise TemplateError(line, f"printf: %{letter} needs {article} {wanted}")
    if letter == "q":
        return _go_quote(str(value))
    return _printed(value)


def _go_quote(text: str) -> str:
    """``strconv.Quote``: double quotes, Go's escapes, printable characters as they are."""
    out = ['"']
    for char in text:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif char in "\a\b\f\n\r\t\v":
            out.append("\\" + "abfnrtv"["\a\b\f\n\r\t\v".index(char)])
        elif char.isprintable():
            out.append(char)
        elif ord(char) < 0x80:
            out.append(f"\\x{ord(char):02x}")
        elif ord(char) <= 0xFFFF:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(f"\\U{ord(char):08x}")
    out.append('"')
    return "".join(out)


def _sprint(args: list[Any], *, line_mode: bool) -> str:
    """``fmt.Sprint`` (spaces only between two non-strings) or ``fmt.Sprintln``."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if i and (line_mode or not (isinstance(arg, str) or isinstance(args[i - 1], str))):
            out.append(" ")
        out.append(_printed(arg))
    return "".join(out) + ("\n" if line_mode else "")


class _State:
    def __init__(self, root: Any) -> None:
        self.vars: list[tuple[str, Any]] = [("$", root)]
        self.out: list[str] = []

    def lookup(self, line: int, name: str) -> Any:
        for var, value in reversed(self.vars):
            if var == name:
                return value
        raise TemplateError(line, f"undefined variable {_ident(name)}")

    def assign(self, line: int, name: str, value: Any) -> None:
        for i in range(len(self.vars) - 1, -1, -1):
            if self.vars[i][0] == name:
                self.vars[i] = (name, value)
                return
        raise TemplateError(line, f"undefined variable {_ident(name)}")

    def walk(self, dot: Any, nodes: Sequence[Any]) -> None:
        for node in nodes:
            if isinstance(node, _Text):
                self.out.append(node.text)
            elif isinstance(node, _Action):
                value = self.pipe(dot, node.pipe)
                if not node.pipe.decl:
                    self.out.append(_printed(value))
            else:
                self.control(dot, node)

    def control(self, dot: Any, node: _Control) -> None:
        mark = len(self.vars)
        try:
            if node.kind == "range":
                self.range(dot, node)
                return
            value = self.pipe(dot, node.pipe)
            if _truth(value):
                self.walk(value if node.kind == "with" else dot, node.body)
            elif node.otherwise is not None:
                self.walk(dot, node.otherwise)
        finally:
            del self.vars[mark:]

    def range(self, dot: Any, node: _Control) -> None:
        pipe = node.pipe
        value = self.pipe(dot, _Pipe(line=pipe.line, cmds=pipe.cmds))
        items = list(self._iterate(pipe.line, value))
        if not items:
            if node.otherwise is not None:
                self.walk(dot, node.otherwise)
            return
        mark = len(self.vars)
        for key, element in items:
            if len(pipe.decl) == 2:
                self.vars.extend([(pipe.decl[0], key), (pipe.decl[1], element)])
            elif pipe.decl:
                self.vars.append((pipe.decl[0], element))
            self.walk(element, node.body)
            del self.vars[mark:]

    def _iterate(self, line: int, value: Any) -> Iterator[tuple[Any, Any]]:
        if value is None or value is NO_VALUE:
            return
        if isinstance(value, bool | Struct | str):
            raise TemplateError(line, f"range can't iterate over a {_type_name(value)}")
        if isinstance(value, int):
            yield from ((i, i) for i in range(value))
        elif isinstance(value, Mapping):
            yield from ((key, value[key]) for key in sorted(value))
        elif isinstance(value, Sequence):
            yield from enumerate(value)
        else:
            raise TemplateError(line, "range can't iterate over this value")

    def pipe(self, dot: Any, pipe: _Pipe) -> Any:
        value: Any = NO_VALUE
        for i, cmd in enumerate(pipe.cmds):
            value = self.command(dot, cmd, final=value if i else _NOTHING)
        for name in pipe.decl:
            if pipe.assign:
                self.assign(pipe.line, name, value)
            else:
                self.vars.append((name, value))
        return value

    def command(self, dot: Any, cmd: _Command, *, final: Any) -> Any:
        first, rest = cmd.args[0], list(cmd.args[1:])
        if isinstance(first, _Function):
            args: list[Callable[[], Any]] = [self._later(dot, cmd.line, a) for a in rest]
            if final is not _NOTHING:
                args.append(lambda: final)
            return self.call(cmd.line, first.name, args)
        if rest or final is not _NOTHING:
            raise TemplateError(cmd.line, "can't give an argument to a non-function")
        if isinstance(first, _Literal) and first.value is None:
            raise TemplateError(cmd.line, "nil is not a command")
        return self.arg(dot, cmd.line, first)

    def _later(self, dot: Any, line: int, node: Any) -> Callable[[], Any]:
        return lambda: self.arg(dot, line, node)

    def arg(self, dot: Any, line: int, node: Any) -> Any:
        if isinstance(node, _Literal):
            return node.value
        if isinstance(node, _Dot):
            return dot
        if isinstance(node, _Function):
            return self.call(line, node.name, [])
        if isinstance(node, _Pipe):
            return self.pipe(dot, node)
        assert isinstance(node, _Fields)
        if node.base is None:
            value = dot
        elif isinstance(node.base, str):
            value = self.lookup(line, node.base)
        else:
            value = self.pipe(dot, node.base)
        for name in node.names:
            value = _field(line, value, name)
        return value

    def call(self, line: int, name: str, lazy: list[Callable[[], Any]]) -> Any:
        if name in ("and", "or"):
            if not lazy:
                raise TemplateError(line, f"wrong number of arguments for {name}")
            value: Any = None
            for get in lazy:
                value = get()
                if _truth(value) != (name == "and"):
                    return value
            return value
        args = [None if (v := get()) is NO_VALUE else v for get in lazy]
        return _call(line, name, args)


_NOTHING = object()  # no value piped into a command


def _field(line: int, value: Any, name: str) -> Any:
    if isinstance(value, Struct):
        if name not in value.fields:
            raise TemplateError(
                line, f"can't evaluate field {_ident(name)} in type {value.type_name}"
            )
        return value.fields[name]
    if isinstance(value, Mapping):
        return value.get(name, NO_VALUE)
    if value is NO_VALUE:
        return NO_VALUE
    if value is None:
        raise TemplateError(line, f"nil pointer evaluating field {_ident(name)}")
    raise TemplateError(line, f"can't evaluate field {_ident(name)} in type {_type_name(value)}")


def _call(line: int, name: str, args: list[Any]) -> Any:
    def arity(count: int) -> None:
        if len(args) != count:
            raise TemplateError(line, f"wrong number of arguments for {name}: want {count}")

    if name == "not":
        arity(1)
        return not _truth(args[0])
    if name == "len":
        arity(1)
        item = args[0]
        if isinstance(item, str):
            return len(item.encode("utf-8", "surrogateescape"))
        if isinstance(item, Mapping | list | tuple):
            return len(item)
        raise TemplateError(line, f"error calling len: len of type {_type_name(item)}")
    if name == "index":
        if not args:
            raise TemplateError(line, "wrong number of arguments for index")
        return _index(line, args[0], args[1:])
    if name in ("eq", "ne"):
        if len(args) < 2 or (name == "ne" and len(args) != 2):
            raise TemplateError(line, f"wrong number of arguments for {name}")
        found = any(_equal(line, args[0], other) for other in args[1:])
        return found if name == "eq" else not found
    if name in _COMPARE:
        arity(2)
        kinds = (_kind(args[0]), _kind(args[1]))
        if kinds[0] != kinds[1] or kinds[0] not in ("int", "string"):
            raise TemplateError(line, f"error calling {name}: invalid type for comparison")
        return _COMPARE[name](args[0], args[1])
    if name == "printf":
        return _printf(line, args)
    return _sprint(args, line_mode=name == "println")


def _index(line: int, item: Any, keys: list[Any]) -> Any:
    for key in keys:
        if isinstance(item, Mapping):
            if not isinstance(key, str):
                raise TemplateError(line, "error calling index: map keys are strings")
            item = item.get(key, "")
        elif isinstance(item, list | tuple) and not isinstance(item, str):
            if not isinstance(key, int) or isinstance(key, bool):
                raise TemplateError(line, "error calling index: cannot index a slice with that")
            if not 0 <= key < len(item):
                raise TemplateError(line, "error calling index: index out of range")
            item = item[key]
        elif item is None:
            raise TemplateError(line, "error calling index: index of untyped nil")
        else:
            raise TemplateError(line, f"error calling index: can't index a {_type_name(item)}")
    return item


# --------------------------------------------------------------------------- API


@dataclass(frozen=True)
class Template:
    """A parsed template; :meth:`render` it with a context (usually a :class:`Struct`)."""

    nodes: tuple[Any, ...] = field(repr=False)

    def render(self, data: Any) -> str:
        state = _State(data)
        state.walk(data, self.nodes)
        return "".join(state.out)


def parse(source: str) -> Template:
    """Parse ``source``; a :class:`TemplateError` names the line of the first problem."""
    return Template(_Parser(_Lexer(source).run()).parse())
