"""`ac-observe rules`: the drift rules for other evaluators (a Prometheus rule file): one
source, two evaluators.

NOTE: the alerting code (ac_observe.daemon.alerting) is imported inside the command only."""
from __future__ import annotations

from pathlib import Path

import typer

from ac_observe.daemon.cli.app import EXIT_USAGE, PLAIN_HELP, app

rules_app = typer.Typer(**PLAIN_HELP, help="The drift rules for other evaluators.")
app.add_typer(rules_app, name="rules")


@rules_app.command("export")
def rules_export(
    fmt: str = typer.Option("prometheus", "--format", help="prometheus (a rule file)."),
    alerting: Path = typer.Option(None, help="Alerting file whose rules to export "
                                  "(default: the shipped rules)."),
) -> None:
    """Print the drift rules as a Prometheus rule file: one source, two evaluators."""
    import yaml

    from ac_observe.daemon.alerting.file import load_alerting_config
    from ac_observe.daemon.alerting.rules import default_rules
    from ac_observe.dashboards import promql
    if fmt != "prometheus":
        typer.echo(f"error: unknown format {fmt!r}; use prometheus", err=True)
        raise typer.Exit(EXIT_USAGE)
    try:
        rules = default_rules() if alerting is None else load_alerting_config(alerting)[1]
        document = promql.alert_groups(rules)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    typer.echo(yaml.safe_dump(document, sort_keys=False, width=100), nl=False)
