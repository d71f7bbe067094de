"""`ac-observe skeleton FILE`: a prompt's structural skeleton and its depth, as the engine
computes them (engine code imported inside the command)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ac_observe.daemon.cli.app import EXIT_USAGE, app


@app.command()
def skeleton(
    source: str = typer.Argument(..., metavar="FILE|-",
                                 help="A prompt file, a JSON request body, or - for stdin."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Print a prompt's structural skeleton and its depth (the skeleton_complexity)."""
    from ac_observe.engine.skeleton import skeleton_of_request, skeleton_of_text

    try:
        raw = sys.stdin.buffer.read() if source == "-" else Path(source).read_bytes()
    except OSError as exc:
        typer.echo(f"error: cannot read {source}: {exc.strerror}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    text = raw.decode("utf-8", errors="replace")
    request = _as_request(text)
    result = (skeleton_of_request(request.get("system"), request["messages"])
              if request else skeleton_of_text(text))
    if as_json:
        typer.echo(json.dumps({"depth": result.depth, "nodes": result.node_count,
                               "skeleton_id": result.skeleton_id,
                               "truncated": result.truncated, "tree": result.render()}))
        return
    typer.echo(result.render())
    typer.echo(f"depth: {result.depth}  nodes: {result.node_count}  "
               f"id: {result.skeleton_id}" + ("  (truncated)" if result.truncated else ""))


def _as_request(text: str) -> dict | None:
    """A Messages / Chat Completions request body, if that is what the file holds."""
    stripped = text.lstrip()
    if not stripped.startswith("{"):
        return None
    try:
        body = json.loads(stripped)
    except (ValueError, RecursionError):
        return None
    if isinstance(body, dict) and isinstance(body.get("messages"), list):
        return body
    return None
