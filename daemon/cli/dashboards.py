"""`ac-observe dashboards`: the Grafana dashboards, provisioning and Prometheus rules
generated from the metric contract (generate, push), and where the installed package keeps
them and the stack's other files (path)."""
from __future__ import annotations

from pathlib import Path

import typer

from ac_observe.daemon.cli.app import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, PLAIN_HELP, app

dashboards_app = typer.Typer(
    **PLAIN_HELP, help="Grafana dashboards and Prometheus rules generated from the metric "
                       "contract.")
app.add_typer(dashboards_app, name="dashboards")


@dashboards_app.command("generate")
def dashboards_generate(
    out: Path = typer.Option(Path("."), "--root", help="The repository's root (the files are "
                             "written under its dashboards/)."),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 if any "
                               "generated file is missing or differs."),
) -> None:
    """Write the dashboards' JSON, Grafana provisioning, Prometheus rules and the
    Kubernetes PrometheusRule."""
    from ac_observe.dashboards import generate
    try:
        if check:
            stale = generate.stale(out)
            for path in stale:
                typer.echo(f"stale: {out / path}", err=True)
            raise typer.Exit(EXIT_REFUSED if stale else EXIT_OK)
        for path in generate.write(out):
            typer.echo(f"wrote {out / path}")
    except OSError as exc:  # a --root that cannot be read or written
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None


@dashboards_app.command("push")
def dashboards_push(
    grafana_url: str = typer.Option(..., envvar="GRAFANA_URL", help="Grafana's URL."),
    token: str = typer.Option(None, envvar="GRAFANA_TOKEN", help="A service account token "
                              "(Editor); the environment is safer than the command line."),
    folder: str = typer.Option("ac-observe", help="Folder to put the dashboards in."),
    datasource_uid: str = typer.Option("", help="Uid of the Prometheus datasource to point "
                                       "the dashboards at (default: the stack's own)."),
) -> None:
    """Upload the dashboards to a Grafana that is not file-provisioned (Grafana Cloud)."""
    from ac_observe.dashboards import push
    if not grafana_url.startswith(("http://", "https://")):  # usage, before any request
        typer.echo(f"error: the Grafana URL must start with http:// or https://: "
                   f"{grafana_url!r}", err=True)
        raise typer.Exit(EXIT_USAGE)
    try:
        for line in push.push(grafana_url, token, folder, datasource_uid or None):
            typer.echo(line)
    except push.PushError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_REFUSED) from None


@dashboards_app.command("path")
def dashboards_path() -> None:
    """Print the folder of the installed dashboards and stack files (grafana/,
    prometheus/, alertmanager/), to mount or copy into a Grafana and Prometheus."""
    import ac_observe.dashboards
    typer.echo(Path(ac_observe.dashboards.__file__).parent)
