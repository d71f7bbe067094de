"""The alerting file (YAML): `receivers:` and `rules:` (a list, or `defaults` for the
shipped rules), read and checked; its JSON Schema for editors (`ac-observe alerts
schema`). A file that cannot be used raises AlertConfigError naming the file and field.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field

from ac_observe.daemon.alerting.receivers import Receiver, ReceiverSpec, parse_receivers
from ac_observe.daemon.alerting.rules import Rule, RuleSpec, default_rules_text, parse_rules
from ac_observe.daemon.alerting.spec import AlertConfigError, Spec

SECTIONS = ("receivers", "rules")


class AlertingFile(Spec):
    """An alerting file: the daemon's drift rules and the receivers of their notifications."""
    # An empty section (null) is taken as none, as the daemon takes it.
    receivers: list[ReceiverSpec] | None = Field(default_factory=list)
    rules: list[RuleSpec] | Literal["defaults"] | None = Field(
        default_factory=list, description="The rules, or `defaults` for the shipped ones "
                                          "(`ac-observe alerts defaults` prints them).")


def schema() -> dict[str, Any]:
    """The alerting file's JSON Schema (draft 2020-12), for editors and CI checks."""
    document = AlertingFile.model_json_schema()
    document["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    document["title"] = "ac-observe alerting file"
    return document


def read_alerting(path: str | os.PathLike) -> dict:
    """An alerting file's document (receivers, rules), its top level checked."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise AlertConfigError(f"{source}: {exc.strerror}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise AlertConfigError(f"{source}: not YAML: {_yaml_problem(exc)}") from None
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise AlertConfigError(f"{source}: the top level must be a mapping")
    unknown = set(document) - set(SECTIONS)
    if unknown:
        raise AlertConfigError(f"{source}: unknown section {sorted(unknown)[0]!r}")
    return document


def load_alerting(path: str | os.PathLike) -> dict[str, Receiver]:
    """The receivers of an alerting YAML file; AlertConfigError names what to fix."""
    return parse_receivers(read_alerting(path).get("receivers"), str(path))


def load_alerting_config(path: str | os.PathLike) -> tuple[dict[str, Receiver], list[Rule]]:
    """(receivers, rules) of an alerting file; AlertConfigError names what to fix.
    `rules: defaults` stands for the shipped rules."""
    document = read_alerting(path)
    rules = document.get("rules")
    source = str(path)
    if rules == "defaults":
        rules, source = yaml.safe_load(default_rules_text()), f"{path} (the shipped defaults)"
    return (parse_receivers(document.get("receivers"), str(path)),
            parse_rules(rules, source))


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The parser's problem and where, without the lines it quotes: a secret or a webhook
    URL (its path is the credential) may stand on them, and this goes to the log."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem
