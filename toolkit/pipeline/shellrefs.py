"""A shell stage's ``${...}`` references become environment variables, never shell text.

Each reference in ``cmd`` (``${vars.name}``, ``${run_dir}``, ``${stages.S.outputs.K}``) is replaced by a
quoted expansion of an environment variable (``"${CLIPTK_VAR_name}"``) and its value goes into the
stage's ``env``: bash expands a variable's value as text and never parses it again, so no value can run
as a command, whatever quotes, ``$(...)``, backticks or semicolons it holds. What is written into ``cmd``
depends on where the reference stands, found by :func:`contexts`, a scanner of bash's quoting (nested
``$(...)``, backticks, comments and here-documents included):

- bare, or directly inside ``$(...)`` or backticks (at any depth): ``"${NAME}"`` (one word, as typed);
- inside ``"..."`` (at any depth) or the body of a here-document with an unquoted delimiter: ``${NAME}``
  (already quoted there; quote marks would close the string or be literal text);
- inside ``'...'``: ``'"${NAME}"'`` (the single quotes are closed around it);
- where no expansion can be placed or the meaning is unclear (a here-document with a quoted delimiter,
  ``$'...'``, ``$((...))``): refused, naming the reference; hand the value through ``env:`` yourself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# What the scanner's stack holds: bare (top level), sq '...', dq "...", cmd $(...), bt `...`, ansi $'...',
# arith $((...)), comment (# to the end of the line), heredoc / qheredoc (a body, unquoted / quoted
# delimiter).
_QUOTED = ("bare", "cmd", "bt", "comment")  # the expansion is quoted: "${NAME}"
_PLAIN = ("dq", "heredoc")  # already inside double quotes (or a here-document body): ${NAME}
_REFUSED = {
    "qheredoc": "the body of a here-document whose delimiter is quoted (nothing is expanded there)",
    "ansi": "a $'...' string",
    "arith": "an arithmetic $((...))",
    "escaped": "a word the shell does not expand (after a backslash, or a here-document's delimiter)",
}
PREFIX = "CLIPTK_"
_WORD_END = re.compile(r"[\s;|&<>()]")


class ShellRefError(ValueError):
    """A reference stands where its value cannot be passed safely (the message says where)."""


def env_name(ref: str) -> str:
    """The environment variable that carries reference ``ref`` (``vars.name`` -> ``CLIPTK_VAR_name``)."""
    parts = ref.split(".")
    if parts[0] == "vars" and len(parts) == 2:
        name = "VAR_" + parts[1]
    elif parts[0] == "stages" and len(parts) == 4:
        name = f"STAGE_{parts[1]}_{parts[3]}"
    else:
        name = ref.upper()
    return PREFIX + re.sub(r"\W", "_", name)


def _heredoc(cmd: str, i: int) -> tuple[int, tuple[str, str, bool]]:
    """After ``<<`` at ``i``: (index past the delimiter word, (delimiter, frame kind, strip tabs))."""
    strip = cmd.startswith("-", i)
    i += strip
    while i < len(cmd) and cmd[i] in " \t":
        i += 1
    end, quote = i, ""
    while end < len(cmd) and (quote or not _WORD_END.match(cmd[end])):
        if quote and cmd[end] == quote:
            quote = ""
        elif not quote and cmd[end] in "'\"":
            quote = cmd[end]
        end += 1
    word = cmd[i:end]
    quoted = any(c in word for c in "'\"\\")
    return end, (re.sub(r"['\"\\]", "", word), "qheredoc" if quoted else "heredoc", strip)


def _step_literal(cmd: str, i: int, stack: list) -> int | None:
    """Inside '...', a comment or a here-document body: the next index, or None where a here-document's
    body expands (``\\``, ``$``, a backtick: :func:`_step_expansion` reads it)."""
    top, c = stack[-1][0], cmd[i]
    if top == "sq":
        if c == "'":
            stack.pop()
        return i + 1
    if top == "comment":
        if c == "\n":
            stack.pop()
            return i  # the newline itself ends the command line (here-documents start after it)
        return i + 1
    delim, strip = stack[-1][1], stack[-1][2]
    if i == 0 or cmd[i - 1] == "\n":
        line = cmd[i:].split("\n", 1)[0]
        if (line.lstrip("\t") if strip else line) == delim:
            stack.pop()
            return i + len(line) + 1
    return i + 1 if top == "qheredoc" or c not in "\\$`" else None


def _step_expansion(cmd: str, i: int, stack: list) -> int | None:
    """Escapes, ``$'...'``'s end, ``$((``, ``$(``, backticks and the end of "...": the next index, or None."""
    top, c = stack[-1][0], cmd[i]
    if c == "\\":
        return i + 2
    if top == "ansi":
        if c == "'":
            stack.pop()
        return i + 1
    if cmd.startswith("$((", i):
        stack.append(["arith", 0])
        return i + 3
    if cmd.startswith("$(", i):
        stack.append(["cmd", 0])
        return i + 2
    if c == "`":
        if top == "bt":
            stack.pop()
        else:
            stack.append(["bt"])
        return i + 1
    if top in ("dq", "heredoc"):
        if c == '"' and top == "dq":
            stack.pop()
        return i + 1
    return None


def _step_code(cmd: str, i: int, stack: list, pending: list) -> int:
    """Bare code, ``$(...)``, backticks, ``$((...))``: parentheses, quotes, comments, here-documents."""
    top, c = stack[-1][0], cmd[i]
    if top in ("cmd", "arith") and c in "()":
        if c == "(":
            stack[-1][1] += 1
        elif stack[-1][1] == 0:
            stack.pop()
            return i + (2 if top == "arith" and cmd.startswith("))", i) else 1)
        else:
            stack[-1][1] -= 1
        return i + 1
    if top == "arith":
        return i + 1
    if cmd.startswith("$'", i):
        stack.append(["ansi"])
        return i + 2
    if c in "'\"":
        stack.append(["sq" if c == "'" else "dq"])
        return i + 1
    if c == "#" and (i == 0 or cmd[i - 1] in " \t\n;&|("):
        stack.append(["comment"])
        return i + 1
    if cmd.startswith("<<", i) and not cmd.startswith("<<<", i):
        end, doc = _heredoc(cmd, i + 2)
        pending.append(doc)
        return end
    if c == "\n" and pending:
        stack.extend([kind, delim, strip] for delim, kind, strip in reversed(pending))
        pending.clear()
    return i + 1


def _step(cmd: str, i: int, stack: list, pending: list) -> int:
    """Advance the scanner by one token at ``i``; returns the next index (updates ``stack``, ``pending``)."""
    if stack[-1][0] in ("sq", "comment", "heredoc", "qheredoc"):
        nxt = _step_literal(cmd, i, stack)
        if nxt is not None:
            return nxt
    nxt = _step_expansion(cmd, i, stack)
    return nxt if nxt is not None else _step_code(cmd, i, stack, pending)


def contexts(cmd: str, spans: list[tuple[int, int]]) -> list[str]:
    """The quoting context bash reads at the start of each (start, end) span of ``cmd`` (spans in order,
    each skipped as one opaque word): one of the stack kinds above, or "escaped" for a span that starts
    inside a token (``\\${...}``, a here-document's delimiter)."""
    stack: list[list[Any]] = [["bare"]]
    pending: list[tuple[str, str, bool]] = []
    found, i, k = [], 0, 0
    while k < len(spans):
        if i >= spans[k][0]:
            found.append(stack[-1][0] if i == spans[k][0] else "escaped")  # past its start: inside a token
            i, k = max(i, spans[k][1]), k + 1
            continue
        i = _step(cmd, i, stack, pending)
    return found


def _expansion(name: str, context: str, ref: str) -> str:
    if context in _QUOTED:
        return '"${' + name + '}"'
    if context == "sq":
        return "'\"${" + name + "}\"'"
    if context in _PLAIN:
        return "${" + name + "}"
    raise ShellRefError(
        f"${{{ref}}} stands in {_REFUSED[context]}, where its value cannot be passed as text; "
        f'give it to the command through env: {{NAME: "${{{ref}}}"}} and use "$NAME"'
    )


def substitute_cmd(cmd: str, pattern: re.Pattern, lookup: Callable[[str], Any]) -> tuple[str, dict[str, str]]:
    """(``cmd`` with each ``pattern`` match (``${ref}``) replaced by its variable's expansion, {variable:
    ``str(lookup(ref))``}) per the module docstring. A lookup that returns the reference itself (resolved
    later) and an expansion written earlier (``${CLIPTK_...}``) are kept as they are. ShellRefError for a
    reference that stands where no expansion is safe."""
    matches = list(pattern.finditer(cmd))
    where = contexts(cmd, [m.span() for m in matches])
    out, env, names, pos = [], {}, {}, 0
    for match, context in zip(matches, where, strict=True):
        ref = match.group(1).strip()
        text = match.group(0)
        if not ref.startswith(PREFIX):
            value = str(lookup(ref))
            if value != "${" + ref + "}":
                if ref not in names:
                    name, n = env_name(ref), 2
                    while name in env:
                        name, n = f"{env_name(ref)}_{n}", n + 1
                    names[ref], env[name] = name, value
                text = _expansion(names[ref], context, ref)
        out += [cmd[pos : match.start()], text]
        pos = match.end()
    return "".join(out) + cmd[pos:], env
