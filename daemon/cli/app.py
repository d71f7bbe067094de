"""The one typer app every command module registers on, and what the commands share: click's
plain help, the daemon's address, tokens read from a file, and the exit codes."""
from __future__ import annotations

from pathlib import Path
from typing import TypedDict

import typer

from ac_observe.metrics import DEFAULT_DAEMON_PORT

# Exit codes, the same for every command (the package docstring and --help's epilog list
# them). Click's own usage errors (an unknown option, a missing value) exit 2 too.
EXIT_OK = 0
EXIT_REFUSED = 1  # the daemon answered no, a test delivery failed, generated files are stale
EXIT_USAGE = 2  # a bad option value, an unreadable file
EXIT_UNREACHABLE = 3  # no daemon answers at --daemon

# "\b": click prints the paragraph as it is, not rewrapped into one line.
EXIT_CODES_HELP = f"""\b
Exit codes:
  {EXIT_OK}  ok
  {EXIT_REFUSED}  the daemon answered no (an error, a refused token); a test delivery
     failed (alerts test); stale files (dashboards generate --check)
  {EXIT_USAGE}  usage: a bad option value, an unreadable file
  {EXIT_UNREACHABLE}  the daemon cannot be reached"""

class _PlainHelp(TypedDict):  # typer.Typer's keyword, typed where it is spread (**)
    rich_markup_mode: None


# Click's plain help: rich's panels cut long option names ("--gpu-memory-utiliz…") and env
# var names at 80 columns, the very text a user copies; click's wraps, whole.
PLAIN_HELP: _PlainHelp = {"rich_markup_mode": None}


def _whole_words_in_help() -> None:
    """Click's wrapper breaks words at hyphens (--gpu-memory-⏎utilization, ac-⏎observe in
    a description): wrap at spaces only. (typer carries its own click.)"""
    try:  # wrap_text imports the class from here at each call
        from typer._click import _textwrap
    except ImportError:  # a typer without its own click: click's defaults stand
        return

    class NoHyphenBreaks(_textwrap.TextWrapper):
        def __init__(self, *args, **kwargs):
            kwargs["break_on_hyphens"] = False
            super().__init__(*args, **kwargs)
    setattr(_textwrap, "TextWrapper", NoHyphenBreaks)  # noqa: B010 - mypy: a class is no lvalue


_whole_words_in_help()
app = typer.Typer(add_completion=False, no_args_is_help=False, **PLAIN_HELP,
                  help="Kernel-level observability for self-hosted LLM inference.",
                  epilog=EXIT_CODES_HELP)


DEFAULT_DAEMON_URL = f"http://127.0.0.1:{DEFAULT_DAEMON_PORT}"


def daemon_address(url: str) -> str:
    """--daemon as typed: host:port alone means http://host:port."""
    url = url.strip().rstrip("/")
    return url if "://" in url else "http://" + url


def read_token(token: str | None, token_file: Path | None) -> str | None:
    """The token in `token_file` when one is named, else `token`; ValueError (a usage
    error) when the file cannot be read."""
    if token_file is None:
        return token
    try:
        return token_file.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the token file {token_file}: {exc}") from None


def configure_logging(level: str) -> None:
    """Log lines with time and source at `level`; httpx's own lines only from warnings up
    (it logs every URL: a webhook's secret path, the demo client's every request)."""
    import logging
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
