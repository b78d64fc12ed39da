"""User-facing input errors: one line per problem, naming the file, the field and the value.

Also the pieces every model read from user input shares: `INPUT_MODEL`, its pydantic settings
(strict types, finite floats, unknown keys refused, frozen), and `invalid`, which lets a
cross-field check name the field at fault.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pydantic is imported where models are defined, not here: the CLI imports
    # InputError to catch it, and `servesim --help` starts without pydantic.
    from pydantic import ConfigDict, ValidationError
    from pydantic_core import ErrorDetails

# Strict: a bool or a string is never taken for a number (ints are still accepted for floats);
# NaN and infinities are refused by every float field. (A ConfigDict is a plain dict.)
INPUT_MODEL: ConfigDict = {"extra": "forbid", "frozen": True, "strict": True,
                           "allow_inf_nan": False}

Problem = tuple[str, Any, str]  # field, value, what is wrong with it


COMMAND_LINE = "<command line>"  # the source named by errors in command-line options


class InputError(Exception):
    """Bad input from the user (scenario, trace, profile). The CLI prints each of its `lines()`,
    then exits 2. `field`, `value` and `problem` are those of the first problem."""

    def __init__(self, source: str | Path | None, field: str, value: Any, problem: str,
                 more: Iterable[Problem] = ()) -> None:
        text = str(source) if source is not None else "<scenario>"
        # A path holding a newline (or another control character) would split the error line.
        self.source = text if text.isprintable() else repr(text)
        self.problems: list[Problem] = [(field, value, problem), *more]
        self.field, self.value, self.problem = field, value, problem
        super().__init__("\n".join(self.lines()))
        # The constructor's arguments, as SimPy rebuilds an exception raised in a process with
        # `type(exc)(*exc.args)` before raising it from `env.run`.
        self.args = (self.source, field, value, problem, tuple(self.problems[1:]))

    def __str__(self) -> str:
        return "\n".join(self.lines())

    @classmethod
    def many(cls, source: str | Path | None, problems: Iterable[Problem]) -> InputError:
        """One error holding several problems of one file (at least one)."""
        first, *rest = problems
        return cls(source, *first, more=rest)

    @classmethod
    def from_validation(cls, source: str | Path | None, exc: ValidationError) -> InputError:
        """Every problem pydantic found in one file, each at its dotted field."""
        return cls.many(source, [_problem(err) for err in exc.errors()])

    def lines(self) -> list[str]:
        """One line per problem: `source: field=value: problem`."""
        return [f"{self.source}: {field}={_short(value)}: {problem}"
                for field, value, problem in self.problems]

    def one_line(self) -> str:
        """The first problem's line."""
        return self.lines()[0]

    def moved(self, source: str | Path | None, rename: Callable[[str], str]) -> InputError:
        """The same problems reported against `source`, each field renamed (e.g. prefixed with
        the variant of a comparison file that holds it)."""
        return InputError.many(source, [(rename(field), value, problem)
                                        for field, value, problem in self.problems])

    def __reduce__(self) -> tuple[Any, ...]:
        # Sweep workers send errors back pickled: values travel as their short text, so a value
        # that cannot be pickled does not turn the error into a BrokenProcessPool.
        shown = [(field, _Shown(_short(value)), problem) for field, value, problem in self.problems]
        return (_rebuild, (self.source, shown))


def _rebuild(source: str, problems: list[Problem]) -> InputError:
    return InputError.many(source, problems)


def as_written(value: Any) -> Any:
    """`value` shown in an error as a scenario writes it: a mapping or a list as YAML on one line
    (`{bandwidth_gb_s: 10.0, latency_s: 5.0e-06}`), never a Python repr; anything else as is."""
    if not isinstance(value, (dict, list)):
        return value
    import yaml  # here: `servesim --help` starts without it

    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**9)
    return _Shown(" ".join(text.split()))


def verbatim(text: str) -> Any:
    """`text` shown in an error as written, unquoted (a YAML literal such as `0100`)."""
    return _Shown(text)


class _Shown(str):
    """A value already turned into its short text: shown as is, not quoted again."""

    def __repr__(self) -> str:
        return str(self)


def _problem(err: ErrorDetails) -> Problem:
    """A pydantic error as (dotted field, value, problem), in words a user can act on."""
    field = ".".join(str(part) for part in err["loc"]) or "<top level>"
    value, kind = err.get("input"), err["type"]
    if kind == "missing":
        return field, _Shown("<missing>"), "required"
    if kind in ("int_type", "float_type") and isinstance(value, bool):
        return field, value, "must be a number, not a boolean"
    if kind in ("int_type", "float_type") and isinstance(value, str):
        return field, value, "must be a number, not text" + _number_hint(value)
    if kind == "int_type" and isinstance(value, float):
        return field, value, "must be an integer"
    if kind == "finite_number":
        return field, value, "must be a finite number"
    if kind in ("model_type", "dict_type"):
        return field, value, "must be a mapping"
    return field, value, err["msg"].removeprefix("Value error, ")


def _number_hint(text: str) -> str:
    """Why a number may have become text: YAML 1.1 reads 1e12 (no dot, no exponent sign) and
    quoted numbers as strings."""
    try:
        float(text)
    except ValueError:
        return ""
    return " (quoted, or an exponent without '.' and sign: write 1.0e+12)"


def invalid(*problems: Problem) -> ValidationError:
    """A validation error located at fields of the model being checked, for cross-field checks
    in a model validator: raise it and pydantic reports each problem at `outer.path.field`."""
    from pydantic import ValidationError
    from pydantic_core import PydanticCustomError

    return ValidationError.from_exception_data("input", [
        {"type": PydanticCustomError("invalid", "{problem}", {"problem": problem}),
         "loc": tuple(field.split(".")), "input": value}
        for field, value, problem in problems])


def _short(value: Any, limit: int = 80) -> str:
    if hasattr(value, "item") and callable(value.item):  # numpy scalar: show the plain number
        with contextlib.suppress(TypeError, ValueError):
            value = value.item()
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the error being reported
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())  # keep the message on one line
    if len(text) <= limit:
        return text
    if isinstance(value, str | Path) and "/" in str(value):
        # A long path: its end (the file's name) tells the user more than its start.
        return text[0] + "..." + text[-(limit - 4):]
    return text[: limit - 3] + "..."
