"""`ac-observe alerts`: the drift alerts pending and firing (and the latest transitions),
the shipped rules, and signed test deliveries to the receivers.

NOTE: the alerting code (ac_observe.daemon.alerting, .store) is imported inside the
commands only."""
from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from ac_observe.daemon.cli.app import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, PLAIN_HELP, app
from ac_observe.daemon.cli.client import DaemonError, get_json
from ac_observe.daemon.cli.render import alert_state, alerts_table, clock, human, print_error

alerts_app = typer.Typer(
    **PLAIN_HELP, help="Drift alerts: what is pending and firing, history, test deliveries.")
app.add_typer(alerts_app, name="alerts")


@alerts_app.callback(invoke_without_command=True)
def alerts_list(ctx: typer.Context,
                history: bool = typer.Option(False, "--history",
                                             help="Also the latest transitions."),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """Alerts pending and firing now, with value and baseline."""
    if ctx.invoked_subcommand is None:
        raise typer.Exit(show_alerts(ctx.obj, history, as_json))


@alerts_app.command("defaults")
def alerts_defaults() -> None:
    """Print the shipped rules (what `rules: defaults` in an alerting file stands for)."""
    from ac_observe.daemon.alerting.rules import default_rules_text
    typer.echo("rules:\n" + "".join(f"  {line}\n" for line in
                                     default_rules_text().splitlines()), nl=False)


@alerts_app.command("schema")
def alerts_schema() -> None:
    """Print the alerting file's JSON Schema (for an editor's YAML support, or a CI check)."""
    from ac_observe.daemon.alerting.file import schema
    typer.echo(json.dumps(schema(), indent=2))


@alerts_app.command("test")
def alerts_test(
    alerting: Path = typer.Option(..., help="Alerting file (YAML) naming the receivers."),
    receiver: str = typer.Option("", help="Only this receiver (default: all)."),
    store: str = typer.Option(None, envvar="AC_OBSERVE_STORE", help="Store URL (default: "
                              "SQLite in the state directory)."),
    state_dir: Path = typer.Option(None, help="State directory."),
    wait: float = typer.Option(15.0, help="Seconds to wait for the receivers' answers."),
) -> None:
    """Check the alerting file as the daemon does, then send a signed test delivery to each
    receiver through the outbox; print what each answered. One still failing stays in the
    outbox for the daemon to retry."""
    import socket
    import time

    from sqlalchemy.exc import SQLAlchemyError

    from ac_observe.daemon.alerting.file import load_alerting_config
    from ac_observe.daemon.alerting.outbox import WebhookSender
    from ac_observe.daemon.store import PENDING, Store

    try:
        # The whole file, rules too, as the daemon loads it: a file it would refuse sends
        # nothing.
        receivers, _ = load_alerting_config(alerting)
        if receiver:
            if receiver not in receivers:
                raise ValueError(f"{alerting}: no receiver named {receiver!r}")
            receivers = {receiver: receivers[receiver]}
        if not receivers:
            raise ValueError(f"{alerting}: no receivers")
        outbox = Store(store, state_dir)
    except (ValueError, OSError, SQLAlchemyError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    sender = WebhookSender(outbox, receivers)
    try:
        ids = dict(zip(receivers, sender.send_test(host=socket.gethostname()), strict=False))
        deadline = time.monotonic() + wait
        rows: dict[str, dict] = {}
        while True:
            sender.run_once(only=list(ids.values()))  # the daemon's own deliveries stay its
            rows = {}
            for name, delivery_id in ids.items():
                row = outbox.delivery(delivery_id)
                assert row is not None  # queued above; only a prune of old ones removes one
                rows[name] = row
            if all(r["state"] != PENDING or r["attempts"] for r in rows.values()) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        failed = 0
        for name, row in rows.items():
            answer = row["last_status"] or row["last_error"] or "no answer yet"
            typer.echo(f"{name}: {row['state']} ({answer}) webhook-id {row['id']}")
            failed += row["state"] != "delivered"
    finally:
        sender.stop()
        outbox.close()
    raise typer.Exit(EXIT_REFUSED if failed else EXIT_OK)


@alerts_app.command("explain")
def alerts_explain(ctx: typer.Context,
                   target: str = typer.Argument(..., metavar="RULE|FINGERPRINT",
                                                help="An active alert's rule or fingerprint."),
                   as_json: bool = typer.Option(False, "--json")) -> None:
    """Why an alert is pending or firing: the change of the mean split into parts, the
    causes with baseline and now, and a one-line verdict."""
    try:
        body = get_json(ctx.obj, "/api/v1/alerts", "alerts", explain="1")
    except DaemonError as exc:
        print_error(str(exc))
        raise typer.Exit(exc.exit_code) from None
    found = [a for a in body["alerts"] if target in (a["rule"], a["fingerprint"])]
    if not found:
        print_error(f"no pending or firing alert has the rule or fingerprint {target[:80]!r} "
                    "(ac-observe alerts lists them)")
        raise typer.Exit(EXIT_USAGE)
    if as_json:
        print(json.dumps([{**a["explanation"], "state": a["state"]} if a.get("explanation")
                          else {"rule": a["rule"], "fingerprint": a["fingerprint"],
                                "explanation": None} for a in found]))
        raise typer.Exit(EXIT_OK)
    for number, alert in enumerate(found):
        if number:
            typer.echo("")
        typer.echo("\n".join(explanation_lines(alert)))
    raise typer.Exit(EXIT_OK)


def explanation_lines(alert: dict, width: int = 80) -> list[str]:
    """An alert's explanation as plain lines of at most `width` columns."""
    import textwrap

    from ac_observe.daemon.alerting.explain import show, signed
    labels = " ".join(f"{k}={v}" for k, v in sorted(alert["labels"].items()))
    lines = textwrap.wrap(f"{alert['rule']} {alert['fingerprint']} {alert['state']} {labels}",
                          width, subsequent_indent="  ")
    found = alert.get("explanation")
    if not found:
        return lines + ["no explanation (its figures could not be read)"]
    lines += textwrap.wrap(found["verdict"], width, subsequent_indent="  ")
    span = found["baseline_span"]
    lines += textwrap.wrap(
        f"window {clock(found['window']['start'], '%H:%M:%S')}-"
        f"{clock(found['window']['end'], '%H:%M:%S')} against "
        f"{clock(span['start'], '%m-%d %H:%M:%S')}-{clock(span['end'], '%H:%M:%S')} "
        f"({span['source']})", width, subsequent_indent="  ")
    stat = found["statistic"]
    figures = human(stat["now"], stat["unit"])
    if stat["baseline"] is not None:
        figures = f"{human(stat['baseline'], stat['unit'])} -> {figures}"
    lines.append(f"{stat['name']}: {figures} (the rule's statistic, not split)")
    mean = found.get("mean")
    if found.get("split") == "mean":
        lines.append(f"mean: {show(mean['baseline_ms'], 'ms')} -> {show(mean['now_ms'], 'ms')}"
                     f" ({signed(mean['change_ms'], 'ms')}), split into its parts:")
        rows = [(_part_name(p), show(p["baseline_ms"], "ms"), show(p["now_ms"], "ms"),
                 signed(p["change_ms"], "ms"), _share(p["share"])) for p in found["parts"]]
    elif found.get("split") == "hit rate":
        lines.append(f"hit rate: {show(mean['baseline'], '%')} -> {show(mean['now'], '%')}, "
                     "its fall split by miss reason (% of lookups):")
        rows = [(p["name"], show(p["baseline"], "%"), show(p["now"], "%"),
                 signed(p["change"], "pt"), _share(p["share"])) for p in found["parts"]]
    else:
        lines.append(found.get("note", "no split"))
        rows = []
    if rows:
        lines += _columns(("part", "baseline", "now", "change", "share"), rows)
    for skeleton in found.get("skeletons", []):
        lines.append(f"  skeleton {skeleton['skeleton'][:30]}: hit rate "
                     f"{show(skeleton['baseline'], '%')} -> {show(skeleton['now'], '%')}")
    lines += _columns(("cause", "baseline", "now", "", ""),
                      [(f"{c['group']}: {c['name']}", show(c["baseline"], c["unit"]),
                        show(c["now"], c["unit"]), "", "") for c in found["causes"]])
    return [line.rstrip()[:width] for line in lines]


def _part_name(part: dict) -> str:
    """The residual says which missing parts it holds."""
    missing = part.get("includes_missing")
    return f"{part['name']} (+{', '.join(missing)})" if missing else part["name"]


def _share(share) -> str:
    return "missing" if share is None else f"{100 * share:.0f} %"


def _columns(titles: tuple, rows: list[tuple]) -> list[str]:
    """A name column of 32 and four right-aligned ones of 12: 80 columns."""
    def line(cells):
        return f"{str(cells[0])[:32]:<32}" + "".join(f"{str(c)[:11]:>12}" for c in cells[1:])
    return ["", line(titles), *[line(row) for row in rows]]


WAITING_SHOWN = 10  # series listed as waiting under the alerts table


def show_alerts(obj: dict, history: bool, as_json: bool) -> int:
    console = Console()
    try:
        body = get_json(obj, "/api/v1/alerts", "alerts", history="1" if history else "0")
    except DaemonError as exc:
        print_error(str(exc))
        return exc.exit_code
    if as_json:
        print(json.dumps(body))
        return EXIT_OK
    if not body["rules"]:
        console.print("no alert rules (start the daemon with --alerting FILE)")
        return EXIT_OK
    console.print(alerts_table(
        f"alerts ({body['rules']} rules)", body["alerts"], console.width,
        lead=(("state", alert_state),),
        trail=(("severity", lambda a: a["severity"]),
               ("since", lambda a: clock(a["firing_since"] or a["active_since"],
                                         "%H:%M:%S"))))
        if body["alerts"] else "no alert pending or firing")
    waiting = body.get("waiting", [])  # a rule that cannot fire yet says why
    for entry in waiting[:WAITING_SHOWN]:
        labels = ",".join(f"{k}={v}" for k, v in sorted(entry["labels"].items()))
        console.print(Text(f"{entry['rule']} {{{labels}}} waits: {entry['waiting_for']}",
                           style="dim"))
    if len(waiting) > WAITING_SHOWN:
        console.print(Text(f"and {len(waiting) - WAITING_SHOWN} more series waiting "
                           "(ac-observe alerts --json)", style="dim"))
    if history:
        console.print(alerts_table("latest transitions", body["history"], console.width,
                                   lead=(("at", lambda t: clock(t["at"], "%m-%d %H:%M:%S")),
                                         ("change", lambda t: f"{t['from_state']} → "
                                                              f"{t['to_state']}"))))
    return EXIT_OK
