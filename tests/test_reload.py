"""Reloading a running daemon (`ac-observe daemon` in a subprocess): SIGHUP and
`POST /-/reload` read the alerting file and the token file again; a file that does not
load keeps the previous configuration, says why, and the reload gauges say so."""
from __future__ import annotations

import signal
import threading
import time

import httpx

from support.servers import sample_value, wait_for

ONE_RULE = """\
rules:
  - {name: KvUsageHigh, metric: kv_cache_usage, statistic: last, window: 3s,
     comparison: above, threshold: 80}
"""
TWO_RULES = ONE_RULE + """\
  - {name: QueueLong, metric: requests_waiting, statistic: last, window: 3s,
     comparison: above, threshold: 10, severity: critical}
"""
BROKEN = ONE_RULE.replace("threshold: 80", "threshold: one")


def _rules(daemon) -> set[str]:
    """The rules /metrics carries ac_alerts_firing for (every loaded rule has one)."""
    return {dict(labels)["rule"] for name, labels in daemon.metrics()
            if name == "ac_alerts_firing"}


def _reload_gauges(daemon) -> tuple[float, float]:
    metrics = daemon.metrics()
    # (the daemon's own series: no label but its node)
    return (sample_value(metrics, "ac_config_last_reload_successful"),
            sample_value(metrics, "ac_config_last_reload_success_timestamp_seconds"))


def test_sighup_reloads_the_alerting_file_and_a_broken_one_keeps_the_old_rules(
        start_daemon, tmp_path):
    path = tmp_path / "alerting.yaml"
    path.write_text(ONE_RULE)
    daemon = start_daemon(None, "--collectors", "engine", "--alerting", str(path),
                          "--state-dir", str(tmp_path / "state"))
    assert _rules(daemon) == {"KvUsageHigh"}
    took, started = _reload_gauges(daemon)
    assert took == 1 and abs(started - time.time()) < 60

    path.write_text(TWO_RULES)
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: _rules(daemon) == {"KvUsageHigh", "QueueLong"}, 15, "the new rule")
    took, reloaded = _reload_gauges(daemon)
    assert took == 1 and reloaded > started
    assert httpx.get(daemon.url + "/api/v1/alerts", timeout=5).json()["rules"] == 2

    path.write_text(BROKEN)
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: _reload_gauges(daemon)[0] == 0, 15, "the failed reload's gauge")
    assert _reload_gauges(daemon)[1] == reloaded  # the last success's time stays
    assert _rules(daemon) == {"KvUsageHigh", "QueueLong"}  # the old rules run on
    assert daemon.proc.poll() is None
    log = daemon.log_path.read_text()
    assert "reload failed, the previous configuration stays:" in log
    assert f"{path}: rules[0] (KvUsageHigh).threshold" in log
    assert "Traceback" not in log

    # POST /-/reload, from this host: the fixed file is read, and the answer says what.
    path.write_text(ONE_RULE)
    assert httpx.get(daemon.url + "/-/reload", timeout=5).status_code == 405
    # A web page's cross-site POST reaches loopback too: one with an Origin is refused.
    answer = httpx.post(daemon.url + "/-/reload", timeout=10,
                        headers={"Origin": "https://example.com"})
    assert answer.status_code == 403 and "web page" in answer.json()["error"]
    answer = httpx.post(daemon.url + "/-/reload", timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"status": "reloaded", "rules": 1, "receivers": 0, "token": False}
    wait_for(lambda: _reload_gauges(daemon)[0] == 1 and _rules(daemon) == {"KvUsageHigh"},
             10, "the reload's gauges")
    path.write_text(BROKEN)
    answer = httpx.post(daemon.url + "/-/reload", timeout=10)
    assert answer.status_code == 400 and "threshold" in answer.json()["error"]


def test_a_reload_takes_a_new_token_from_the_token_file(start_daemon, tmp_path):
    token = tmp_path / "token"
    token.write_text("first-token-0123456789\n")
    daemon = start_daemon(None, "--collectors", "engine", "--token-file", str(token))

    def status(secret: str) -> int:
        return httpx.get(daemon.url + "/api/v1/status", timeout=5,
                         headers={"Authorization": f"Bearer {secret}"}).status_code

    assert status("first-token-0123456789") == 200
    token.write_text("second-token-9876543210\n")
    # From this host a reload needs no token; from elsewhere it needs the current one.
    answer = httpx.post(daemon.url + "/-/reload", timeout=10)
    assert answer.status_code == 200 and answer.json()["token"] is True
    assert status("first-token-0123456789") == 401
    assert status("second-token-9876543210") == 200
    token.write_text("")  # an empty token would let anyone in: refused, the old one stays
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "the token file" in daemon.log_path.read_text() and
             "is empty" in daemon.log_path.read_text(), 10, "the refused reload")
    assert status("second-token-9876543210") == 200


def test_a_burst_of_hangups_is_one_reload_and_one_more_not_one_each():
    from ac_observe.daemon.http_server import Coalesced

    started, release, runs = threading.Event(), threading.Event(), []

    def reload():
        runs.append(time.monotonic())
        started.set()
        release.wait(5)

    hangup = Coalesced(reload)
    hangup.trigger()
    assert started.wait(5)
    for _ in range(20):  # SIGHUPs while the first reload runs
        hangup.trigger()
    release.set()
    wait_for(lambda: len(runs) == 2 and not hangup._running, 5, "the one further reload")
    time.sleep(0.2)
    assert len(runs) == 2
