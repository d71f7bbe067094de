"""Entries of the alerting file, checked: the pydantic base every section's model shares,
the field checks they reuse, and how a refusal is worded, so that each names the file,
the entry and the field: `<file>: rules[2] (KvDrift).window: bad duration 'soon': ...`.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

from ac_observe.durations import parse_duration


class AlertConfigError(ValueError):
    """An alerting file that cannot be used; the message names the file and the field."""


class FieldError(ValueError):
    """A check that names its field (or a key under it) itself: a check across fields
    says which one is wrong."""

    def __init__(self, message: str, field_name: str = ""):
        super().__init__(message)
        self.field_name = field_name


def non_empty_text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("a non-empty string is required")
    return value.strip()


def finite_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise ValueError(f"a number is required, not {value!r}")
    return float(value)


def string_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError("a mapping of strings to strings")
    return dict(value)


def checked_duration(value: str) -> str:
    parse_duration(value)  # its ValueError names the text and the form
    return value


def one_of(value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{value!r} is not one of {list(choices)}")
    return value


class Spec(BaseModel):
    """A checked entry of the alerting file: unknown fields refused, every message one a
    user can act on (see `refusal`)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    # What to say of a required field that is absent, where "required" says too little.
    when_missing: ClassVar[dict[str, str]] = {}


class NamedSpec(Spec):
    """An entry of a list section, told apart by its name."""
    name: str


def refusal(error: ValidationError, spec: type[Spec], where: str, named: str) -> str:
    """The first of a spec's errors as `<where>[ (name)].<field>: <what to fix>`; unknown
    fields come first (the first by name), before the entry's name is trusted."""
    details = sorted(error.errors(), key=lambda d: (d["type"] != "extra_forbidden",
                                                    str(d["loc"]) if d["type"] ==
                                                    "extra_forbidden" else ""))
    first: ErrorDetails = details[0]
    loc = [str(part) for part in first["loc"]]
    if first["type"] == "extra_forbidden":
        return f"{where}: unknown field {first['loc'][-1]!r}"
    if first["type"] == "missing":
        message = spec.when_missing.get(loc[-1], "required")
    else:
        cause = (first.get("ctx") or {}).get("error")
        message = str(cause) if isinstance(cause, ValueError) else first["msg"]
        if isinstance(cause, FieldError) and cause.field_name:
            loc = loc + cause.field_name.split(".")
    prefix = where if loc and loc[0] == "name" else named
    return f"{prefix}.{'.'.join(loc)}: {message}" if loc else f"{prefix}: {message}"


SpecT = TypeVar("SpecT", bound=NamedSpec)


def checked_entries(raw: Any, source: str, section: str,
                    spec: type[SpecT]) -> Iterator[tuple[str, SpecT]]:
    """Each entry of a section (a list of mappings, each with a unique `name`) as (how
    messages name it, its checked model); AlertConfigError at the first bad one."""
    if raw is None:
        return
    if not isinstance(raw, list):
        raise AlertConfigError(f"{source}: {section}: must be a list")
    names: set[str] = set()
    for i, entry in enumerate(raw):
        where = f"{source}: {section}[{i}]"
        if not isinstance(entry, dict):
            raise AlertConfigError(f"{where}: must be a mapping")
        name = entry.get("name")
        named = f"{where} ({name.strip()})" if isinstance(name, str) else where
        try:
            checked = spec.model_validate(entry)
        except ValidationError as exc:
            raise AlertConfigError(refusal(exc, spec, where, named)) from None
        entry_name = checked.name
        if entry_name in names:
            raise AlertConfigError(f"{named}.name: {entry_name!r} is used twice")
        names.add(entry_name)
        yield named, checked
