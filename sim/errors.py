"""User-facing input errors: one line naming the file, the field and the value."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


class InputError(Exception):
    """Bad input from the user (scenario, trace, profile). The CLI prints it on one line, exit 2."""

    def __init__(self, source: str | Path | None, field: str, value: Any, problem: str) -> None:
        self.source = str(source) if source is not None else "<scenario>"
        self.field = field
        self.value = value
        self.problem = problem
        super().__init__(self.one_line())

    def lines(self) -> list[str]:
        """One line per problem (a file may have several)."""
        return [self.one_line()]

    def one_line(self) -> str:
        value = _short(self.value)
        return f"{self.source}: {self.field}={value}: {self.problem}"


def _short(value: Any, limit: int = 80) -> str:
    if hasattr(value, "item") and callable(value.item):  # numpy scalar: show the plain number
        with contextlib.suppress(TypeError, ValueError):
            value = value.item()
    text = repr(value)
    text = " ".join(text.split())  # keep the message on one line
    return text if len(text) <= limit else text[: limit - 3] + "..."
