"""What the docstrings say about defaults, read from the code: for the documentation's generated tables
and for the test that the documented defaults are the real ones (``tests/test_documented_defaults.py``).

A numpydoc ``Parameters`` entry states its default in one of two ways: in its type line
(``lr : float, default 1e-3``), or, for an option whose signature default is ``None``, in a sentence
of its description that starts with ``Default`` (``Default: Adam with learning rate lr.``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Documented", "documented_parameters", "markdown_table"]

_HEADER = re.compile(r"^(?P<name>[A-Za-z_][\w, ]*?)\s*:\s*(?P<type>.*)$")
_DEFAULT_IN_TYPE = re.compile(r"(?:^|,\s*)default:?\s+(?P<value>.+)$")


@dataclass(frozen=True)
class Documented:
    """One parameter as its docstring describes it, beside its signature default."""

    name: str
    type: str
    description: str
    #: the default stated in the type line (``"1e-3"``), or None
    type_default: str | None
    #: the sentence of the description that states the default ("Default: Adam ..."), or None
    default_sentence: str | None
    #: the signature's default (``inspect.Parameter.empty`` when there is none)
    signature_default: Any

    @property
    def default(self) -> str:
        """The default in words: the type line's, else the signature's when not None, else the
        description's ``Default ...`` sentence, else ``"None"`` (or ``"required"``)."""
        if self.type_default is not None:
            return self.type_default
        if self.signature_default is inspect.Parameter.empty:
            return "required"
        if self.signature_default is not None:
            return repr(self.signature_default)
        if self.default_sentence:
            return self.default_sentence
        return "None"

    @property
    def summary(self) -> str:
        """The description's first sentence, unless that sentence is the default's."""
        first = _sentences(self.description)[:1]
        return "" if not first or first[0] == self.default_sentence else first[0]


def _sentences(text: str) -> list[str]:
    """Split after ``.``, ``!`` or ``?`` followed by a capital, a quote or a bracket (not after "e.g.")."""
    parts = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+(?=[A-Z`(\"])", text)
    return [s.strip() for s in parts if s.strip()]


def _markdown(text: str) -> str:
    """reST inline markup of a docstring as MyST markdown: ``x`` -> `x`, :role:`x` -> {role}`x`."""
    text = re.sub(r":(\w+(?::\w+)?):`", r"{\1}`", text)
    return text.replace("``", "`").replace("|", "\\|")


def _parameters_section(doc: str) -> list[tuple[str, str, str]]:
    """(names, type, description) of each entry of the ``Parameters`` section."""
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Parameters") + 2
    except StopIteration:
        return []
    entries: list[tuple[str, str, list[str]]] = []
    for i in range(start, len(lines)):
        line = lines[i]
        if line and not line.startswith(" "):
            if i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"}:
                break  # the next section
            match = _HEADER.match(line)
            if match:
                entries.append((match["name"], match["type"].strip(), []))
                continue
        if entries and line.strip():
            entries[-1][2].append(line.strip())
    return [(names, typ, " ".join(desc)) for names, typ, desc in entries]


def documented_parameters(func: Callable) -> dict[str, Documented]:
    """Each documented parameter of ``func`` (or of a class's constructor), by name.

    Entries that document several parameters at once (``features, label : optional``) give one
    :class:`Documented` per name.
    """
    target = func.__init__ if inspect.isclass(func) else func  # type: ignore[misc]
    signature = inspect.signature(target)
    doc = inspect.getdoc(func) or ""
    out = {}
    for names, typ, desc in _parameters_section(doc):
        match = _DEFAULT_IN_TYPE.search(typ)
        sentence = next((s for s in _sentences(desc) if s.startswith("Default")), None)
        each = [n.strip() for n in names.split(",")]
        # "deadline_factor, deadline_floor : float, default 4.0 and 5.0": one default per name
        values = re.split(r"\s+and\s+|,\s*", match["value"].strip()) if match else []
        for i, name in enumerate(each):
            param = signature.parameters.get(name)
            value = (values[i] if len(values) == len(each) else match["value"].strip()) if match else None
            out[name] = Documented(
                name=name,
                type=typ,
                description=desc,
                type_default=value,
                default_sentence=sentence,
                signature_default=param.default if param is not None else inspect.Parameter.empty,
            )
    return out


def markdown_table(func: Callable, skip: tuple[str, ...] = ()) -> str:
    """A markdown table of ``func``'s options with their defaults and first sentences (for the docs)."""
    rows = ["| option | default | what it is |", "| --- | --- | --- |"]
    for doc in documented_parameters(func).values():
        if doc.name in skip or doc.signature_default is inspect.Parameter.empty:
            continue
        default = doc.default
        if doc.default_sentence is not None and default == doc.default_sentence:
            default = _markdown(re.sub(r"^Default:?\s*", "", default))
            default = default[:1].upper() + default[1:]
        else:
            default = f"`{default}`"
        rows.append(f"| `{doc.name}` | {default} | {_markdown(doc.summary)} |")
    return "\n".join(rows) + "\n"
