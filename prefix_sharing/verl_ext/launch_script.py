"""The hydra overrides of a verl launch script, read without running it.

A verl example launch script is bash: variable assignments, then one
``python3 -m verl.trainer.main_ppo key=value ... "$@"`` command spread over ``\\``-continued
lines. :func:`read_launch_script` joins the continuations, records the assignments
(``VAR=value``, ``export VAR=...``, ``${VAR:-default}``, ``$((...))``, arrays ``A=(...)`` and
``A+=(...)``) and expands ``$VAR`` / ``${VAR}`` / ``"${A[@]}"`` in the command (not inside
single quotes, as bash); ``"$@"`` becomes the arguments given to the script
(``script_args``, which ``$1``... and ``shift`` read too). What cannot be read statically - a
command substitution, a variable assigned nowhere - stays as written and is listed in
``unresolved``. Ascend branches (a ``case`` arm ``npu)``, an ``if`` comparing with ``npu``)
are skipped, so the GPU launch is read; other branches are read in order. The first command
that runs a ``verl.`` (or ``recipe.``) module is the launch (``VAR=1 python3 -m ...``
included); hydra's ``--config-name`` / ``--config-path`` are read from it. Nothing here
imports verl.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Sequence

__all__ = ["Launch", "read_launch_script", "parse_launch_text"]

_ASSIGNMENT = re.compile(r"^(?:(?:export|local|readonly|declare(?:\s+-\w+)?)\s+)?"
                         r"([A-Za-z_]\w*)(\+?)=(.*)$")
_ARRAY = re.compile(r"\$\{([A-Za-z_]\w*)\[[@*]\]\}")
_ARITHMETIC = re.compile(r"\$\(\(((?:[^()]|\([^()]*\))+)\)\)")
_VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*|\d)(?:(:?[-=])([^}]*))?\}|\$([A-Za-z_]\w*|[@*]|\d)")
_STOP = {"|", "||", "&&", ";", "&"}
_LIST = "\x00"  # brackets where "$@" or "${array[@]}" stood, expanded once split
_MODULE_PREFIXES = ("verl.", "recipe.")


@dataclasses.dataclass
class Launch:
    """A launch read from a script: the module it runs, hydra's config name and path (None
    where the script does not set them) and the overrides, in order; ``unresolved``: the
    variables and substitutions left as written."""

    module: str
    overrides: list[str]
    config_name: str | None = None
    config_path: str | None = None
    unresolved: list[str] = dataclasses.field(default_factory=list)


def read_launch_script(path: str, script_args: Sequence[str] = ()) -> Launch:
    """The launch in the bash script at ``path`` (see the module doc)."""
    with open(path, encoding="utf-8") as handle:
        return parse_launch_text(handle.read(), script_args)


def parse_launch_text(text: str, script_args: Sequence[str] = ()) -> Launch:
    """The launch in a script's text; ``ValueError`` when it runs no verl module."""
    variables: dict[str, str | None] = {}
    arrays: dict[str, list[str]] = {}
    unresolved: list[str] = []
    script_args = list(script_args)
    for line in _gpu_branch(_logical_lines(text)):
        shift = re.fullmatch(r"shift(?:\s+(\d+))?", line)
        if shift:  # drops the first positional arguments, as bash
            script_args = script_args[int(shift.group(1) or 1):]
            continue
        words = _with_lists(_words(_expand(line, variables, script_args, unresolved)),
                            script_args, arrays, unresolved)
        launch = _launch(words)  # also behind assignments: PYTHONUNBUFFERED=1 python3 -m ...
        if launch is not None:
            launch.unresolved = list(dict.fromkeys(unresolved))
            return launch
        assignment = _ASSIGNMENT.match(line)
        if assignment:
            name, append, value = assignment.groups()
            if value.startswith("(") and value.endswith(")"):  # an array
                items = _with_lists(_words(_expand(value[1:-1], variables, script_args,
                                                   unresolved)), script_args, arrays, unresolved)
                arrays[name] = (arrays.get(name, []) if append else []) + items
            else:
                found = _assigned_value(value, variables, script_args, unresolved)
                if append and found is not None:
                    found = (variables.get(name) or "") + found
                variables[name] = found
    raise ValueError("the script runs no verl module (python -m verl.trainer.main_ppo ...)")


def _logical_lines(text: str) -> list[str]:
    """Lines with their ``\\``-continuations joined and comments dropped (also inline ones
    in backquotes)."""
    joined = re.sub(r"\\\r?\n", " ", text)
    joined = re.sub(r"`\s*#[^`]*`", " ", joined)  # `# inline comments` between arguments
    lines: list[str] = []
    open_array = False
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if open_array:  # an array's items over several lines: one assignment
            lines[-1] += " " + line
        else:
            lines.append(line)
        current = lines[-1]
        open_array = (bool(re.match(r"^[A-Za-z_]\w*\+?=\(", current))
                      and current.count("(") > current.count(")"))
    return lines


def _gpu_branch(lines: list[str]) -> list[str]:
    """``lines`` without the Ascend branches (``npu)`` arms of a ``case``, ``if`` tests that
    compare with ``npu``, up to their ``else`` / ``elif`` / ``fi``): the GPU launch is read."""
    kept, skipping = [], None
    for line in lines:
        if skipping == "case":
            skipping = None if line.endswith(";;") else skipping
            continue
        if skipping == "if":
            if line == "fi" or line.startswith(("else", "elif")):
                skipping = None
                if line.startswith("elif"):
                    line = line[2:]  # elif -> if: test it as a new branch below
            else:
                continue
        if re.match(r"^[\"']?npu[\"']?\)", line):
            skipping = None if line.endswith(";;") else "case"
            continue
        if re.match(r"^if\s+\[.*(?<!!)==?\s*[\"']?npu[\"']?\s*\]", line):
            skipping = "if"
            continue
        if line not in ("else", "fi") and not line.startswith("if "):
            kept.append(line)
    return kept


def _assigned_value(value: str, variables: dict, script_args: Sequence[str],
                    unresolved: list[str]) -> str | None:
    """A variable's value as bash assigns it (None: not readable here, e.g. ``$(...)``)."""
    if value.startswith(("$(", "`")) and not value.startswith("$(("):
        return None
    words = _words(_expand(value, variables, script_args, unresolved))
    return words[0] if words else ""


def _expand(text: str, variables: dict, script_args: Sequence[str],
            unresolved: list[str]) -> str:
    """``text`` with its variables expanded, except inside single quotes (as bash)."""
    out: list[str] = []
    buffer: list[str] = []
    single = double = False

    def flush(literal: bool) -> None:
        segment = "".join(buffer)
        out.append(segment if literal else _expand_segment(segment, variables, script_args,
                                                           unresolved))
        buffer.clear()

    for char in text:
        if char == "'" and not double:
            flush(literal=single)
            single = not single
            out.append(char)
            continue
        if char == '"' and not single:
            double = not double
        buffer.append(char)
    flush(literal=single)
    return "".join(out)


def _expand_segment(segment: str, variables: dict, script_args: Sequence[str],
                    unresolved: list[str]) -> str:
    def value(match: re.Match) -> str:
        name, operator, default, bare = match.groups()
        name = name or bare
        if name in ("@", "*"):
            return f"{_LIST}@{_LIST}"  # one word per argument once split (_with_lists)
        found = variables.get(name)
        if name.isdigit() and 0 < int(name) <= len(script_args):  # a positional argument
            found = script_args[int(name) - 1]
        if found is None or (operator and operator.startswith(":") and found == ""):
            if operator is not None:
                return _expand_segment(default, variables, script_args, unresolved)
            if found is None:
                unresolved.append(f"${name}")
                return match.group(0)
        return found

    def arithmetic(match: re.Match) -> str:
        expression = _expand_segment(match.group(1), variables, script_args, unresolved)
        expression = re.sub(r"[A-Za-z_]\w*", lambda m: variables.get(m.group(0)) or "?",
                            expression)
        if re.fullmatch(r"[\d\s+\-*/%()]+", expression):
            try:  # digits and operators only
                return str(eval(expression.replace("/", "//")))  # noqa: S307
            except (SyntaxError, ZeroDivisionError):
                pass
        unresolved.append(match.group(0))
        return match.group(0)

    segment = _ARITHMETIC.sub(arithmetic, segment)
    segment = _ARRAY.sub(lambda m: f"{_LIST}{m.group(1)}{_LIST}", segment)
    return _VARIABLE.sub(value, segment)


def _with_lists(words: list[str], script_args: Sequence[str], arrays: dict,
                unresolved: list[str]) -> list[str]:
    """``words`` with each ``"$@"`` and ``"${array[@]}"`` replaced by its items, one word
    each."""
    out = []
    for word in words:
        marked = re.fullmatch(f"{_LIST}(@|\\w+){_LIST}", word)
        if marked is None:
            out.append(word.replace(_LIST, ""))
        elif marked.group(1) == "@":
            out += list(script_args)
        elif marked.group(1) in arrays:
            out += arrays[marked.group(1)]
        else:
            unresolved.append(f"${{{marked.group(1)}[@]}}")
    return out


def _words(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote: read it word by word
        return text.split()


def _launch(words: list[str]) -> Launch | None:
    """The launch in one command's words, or None when it runs no verl module."""
    for index, word in enumerate(words):
        module = None
        if word == "-m" and index + 1 < len(words):
            module = words[index + 1]
            rest = words[index + 2:]
        elif word.endswith(".py") and "/" in word and word.startswith(("verl/", "recipe/")):
            module = word[:-3].replace("/", ".")
            rest = words[index + 1:]
        if module is not None and module.startswith(_MODULE_PREFIXES):
            return _hydra_arguments(module, rest)
    return None


def _hydra_arguments(module: str, words: list[str]) -> Launch:
    launch = Launch(module=module, overrides=[])
    options = {"--config-name": "config_name", "-cn": "config_name",
               "--config-path": "config_path", "-cp": "config_path"}
    pending = None
    for word in words:
        if word in _STOP or word.startswith((">", "1>", "2>")):
            break
        if pending is not None:
            setattr(launch, pending, word)
            pending = None
        elif word in options:
            pending = options[word]
        elif word.split("=", 1)[0] in options:
            option, value = word.split("=", 1)
            setattr(launch, options[option], value)
        elif word and not word.startswith("-"):  # "" : a "$@" without arguments
            launch.overrides.append(word)
    if launch.config_name is not None and launch.config_name.endswith(".yaml"):
        launch.config_name = launch.config_name[: -len(".yaml")]
    return launch
