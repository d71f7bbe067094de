"""The daemon's configuration as files give it, and its reload (SIGHUP, `POST /-/reload`,
`systemctl reload`): the alerting file (rules and receivers), the bearer token's file and
the web-config file (TLS certificates, basic-auth users) are read again; a file that does
not load leaves everything as it was and says why.

What a reload cannot change (the port, the store, the collectors, --history) needs a
restart. A daemon started without --alerting has no alerting file to read again.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ac_observe.daemon import sd_notify
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.store import StoreUnavailable
from ac_observe.daemon.tls import WebSettings

if TYPE_CHECKING:  # imported when the daemon has alerts
    from ac_observe.daemon.alerting.evaluator import Evaluator
    from ac_observe.daemon.alerting.outbox import WebhookSender
    from ac_observe.daemon.alerting.receivers import Receiver
    from ac_observe.daemon.alerting.rules import Rule

log = logging.getLogger("ac_observe.daemon.reload")


class ReloadFailed(RuntimeError):
    """A reload that kept the previous configuration; the message says why."""


def alerting_setup(config: DaemonConfig) -> tuple[dict[str, Receiver], list[Rule]]:
    """The alerting file's receivers and rules, with Grafana's receiver when --grafana-url
    is set. AlertConfigError (a ValueError) names the file and the field."""
    receivers: dict[str, Receiver] = {}
    rules: list[Rule] = []
    if config.alerting_file is not None:
        from ac_observe.daemon.alerting.file import load_alerting_config
        receivers, rules = load_alerting_config(config.alerting_file)
        if not receivers and not rules:
            log.warning("%s has no rules and no receivers: no drift alert is evaluated or "
                        "sent (`rules: defaults` adds the shipped rules)", config.alerting_file)
    if config.grafana_url:
        from ac_observe.daemon.alerting.receivers import grafana_receiver
        grafana = grafana_receiver(config.grafana_url, config.grafana_token)
        if grafana.name in receivers:
            raise ValueError(f"--grafana-url adds a receiver named {grafana.name!r}, and "
                             f"{config.alerting_file} has one: rename it")
        receivers = {**receivers, grafana.name: grafana}
        if grafana.token is None:
            log.warning("--grafana-url without a token (--grafana-token-file or "
                        "$GRAFANA_TOKEN): only a Grafana that lets anonymous users "
                        "write annotations will take them")
        if not rules:
            log.warning("--grafana-url is set but no alert rules are: nothing will be "
                        "annotated (an alerting file with `rules: defaults` adds the "
                        "shipped ones)")
    return receivers, rules


def read_token_file(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ReloadFailed(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise ReloadFailed(f"the token file {path} is empty: it would let anyone in")
    return token


class Reloadable(Protocol):
    """What a reload changes in the daemon (daemon/service.py's Daemon)."""
    config: DaemonConfig
    alerts: Evaluator | None
    webhooks: WebhookSender | None
    last_reload: tuple[bool, float]   # (took, when one last took): the reload gauges


class ConfigReloader:
    """Reloads one daemon; one reload at a time (a SIGHUP during a POST waits for it)."""

    def __init__(self, daemon: Reloadable, token_file: Path | None = None,
                 web: WebSettings | None = None):
        self.daemon = daemon
        self.token_file = token_file
        self.web = web
        # Set by the HTTP routes: the bearer token they accept from now on.
        self.on_token: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    def reload(self) -> dict:
        """Reload; what is loaded now ({"rules": n, "receivers": n}), or ReloadFailed."""
        with self._lock:
            sd_notify.reloading()
            try:
                return self._reload()
            except (ValueError, OSError, StoreUnavailable, ReloadFailed) as exc:
                self.daemon.last_reload = (False, self.daemon.last_reload[1])
                log.error("reload failed, the previous configuration stays: %s", exc)
                raise ReloadFailed(str(exc)) from None
            finally:
                sd_notify.notify("READY=1")

    def _reload(self) -> dict:
        daemon = self.daemon
        config = daemon.config
        receivers, rules = alerting_setup(config)  # (read and checked: nothing changed yet)
        token = read_token_file(self.token_file) if self.token_file is not None else None
        web = self.web.load() if self.web is not None else None  # WebConfigError: ValueError
        if config.alerting_file is not None and (daemon.alerts is None or
                                                 daemon.webhooks is None):
            raise ReloadFailed("the alerting is not running (see the log at start)")
        if daemon.alerts is not None and daemon.webhooks is not None:
            # The rules read the store first: an outage fails the reload, nothing changed.
            daemon.alerts.replace_rules(rules)
            daemon.webhooks.replace_receivers(receivers)
        if token is not None and self.on_token is not None:
            self.on_token(token)
        if self.web is not None and web is not None:
            self.web.install(web)
        daemon.last_reload = (True, time.time())
        loaded = {"rules": len(rules), "receivers": len(receivers),
                  "token": token is not None}
        if web is not None:
            loaded["web_config"] = True
        log.info("configuration reloaded%s: %d rules, %d receivers%s%s",
                 f" from {config.alerting_file}" if config.alerting_file else "",
                 len(rules), len(receivers), ", the token file" if token else "",
                 ", the web-config file" if web is not None else "")
        return loaded
