"""`ac-observe up --demo-drift`: watch a drift alert fire and resolve, on the bundled engine.

The engine runs with `--fault-injection` and demo traffic; the daemon gets an alerting
file with one rule (TTFT p95 of the last 30 s, 100 % over the minute before it, for 10 s;
the rule has no baseline until half that minute was watched). A driver thread lets a
baseline build, slows every engine step by 300 ms through the engine's loopback
`/admin/faults` route, removes the delay, waits, and repeats; it prints each phase before
it begins (a change is said before it is asked for, and asked for until the engine
confirms it) and every alert transition the daemon reports (`GET /api/v1/alerts`).
Torch-free; only loopback HTTP.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path

import httpx

DEMO_RULES = """\
# Written by `ac-observe up --demo-drift`: one drift rule with short windows.
rules:
  - name: DemoLatencyDrift
    metric: inference_latency_ns
    statistic: p95
    window: 30s
    baseline: trailing:1m
    comparison: relative_increase
    threshold: 1.0
    for: 10s
    annotations:
      summary: "TTFT p95 {{ value }} ns is {{ delta_percent }} % over its baseline
        {{ baseline }} ns"
"""
# Far above the noise: on 2 busy vCPUs a calm low_latency lane's p95 (a few dozen
# requests in 30 s) reached 1.46x its previous minute's; 150 ms slower steps gave 1.5-2.3x.
STEP_DELAY_MS = 300
DEMO_RULE = "DemoLatencyDrift"
DRIFT_PATIENCE = 3  # a slowed phase waits for the alert up to this many times its length


def write_demo_alerting() -> Path:
    """The demo's alerting file, in a private temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="ac-observe-demo-"))
    path = folder / "alerting.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(DEMO_RULES)
    return path


def _say(text: str) -> None:
    print(f"ac-observe up: {text}", file=sys.stderr, flush=True)


class DriftDriver:
    """Alternates calm (`calm_seconds`) and slowed (`drift_seconds`) phases on the engine,
    and reports the daemon's alert transitions as they happen. A slowed phase lasts until
    DemoLatencyDrift has fired, up to DRIFT_PATIENCE times its length (on a slow or busy
    machine the alert needs longer: lifting the delay before it fires would show nothing)."""

    def __init__(self, engine_url: str, daemon_url: str, calm_seconds: float,
                 drift_seconds: float, poll_seconds: float = 1.0, fault_token: str = ""):
        self.engine_url, self.daemon_url = engine_url, daemon_url
        self.fault_token = fault_token
        self.calm_seconds, self.drift_seconds = calm_seconds, drift_seconds
        self.poll_seconds = poll_seconds
        self.stop = threading.Event()
        self._states: dict[str, tuple[str, str]] = {}  # fingerprint -> (rule, state)
        self._thread = threading.Thread(target=self._run, name="demo-drift", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set():
                _say(f"demo drift: building a baseline for {self.calm_seconds:g}s")
                if self._watch(client, self.calm_seconds):
                    return
                _say(f"demo drift: slowing every engine step by {STEP_DELAY_MS} ms for "
                     f"{self.drift_seconds:g}s; DemoLatencyDrift should fire "
                     "(ac-observe alerts)")
                if not self._set_delay(client, STEP_DELAY_MS):
                    return
                stopped = self._watch(client, self.drift_seconds)
                extra = (DRIFT_PATIENCE - 1) * self.drift_seconds
                while not stopped and extra > 0 and not self._firing(DEMO_RULE):
                    stopped = self._watch(client, min(self.poll_seconds, extra))
                    extra -= self.poll_seconds
                if stopped:
                    self._faults(client, 0)  # once: the engine is being stopped too
                    return
                if self._firing(DEMO_RULE):
                    _say("demo drift: removing the delay; the alert should resolve")
                else:
                    _say(f"demo drift: removing the delay; {DEMO_RULE} did not fire within "
                         f"{DRIFT_PATIENCE * self.drift_seconds:g}s (is the daemon "
                         "evaluating rules? see ac-observe alerts)")
                if not self._set_delay(client, 0):
                    return

    def _firing(self, rule: str) -> bool:
        return (rule, "firing") in self._states.values()

    def _set_delay(self, client: httpx.Client, delay_ms: int) -> bool:
        """Ask the engine for this step delay until it confirms (a request that timed out
        may have been applied: the delay is set, not added, so asking again is safe), said
        once and retried every 2 s while it cannot be reached or fails (5xx); False when
        asked to stop first, or when the engine refuses it (4xx: the demo stops)."""
        said = False
        while not self.stop.is_set():
            outcome = self._faults(client, delay_ms)
            if outcome == "ok":
                return True
            if outcome.startswith("refused"):
                _say(f"demo drift: the engine {outcome} the fault route's request; the demo "
                     "drift stops (is the engine running with --fault-injection and this "
                     "fault token?)")
                self.stop.set()
                return False
            if not said:
                _say(f"demo drift: the engine's fault route {outcome}; trying again every 2s")
                said = True
            self.stop.wait(2.0)
        return False

    def _faults(self, client: httpx.Client, delay_ms: int) -> str:
        """"ok", "refused (HTTP 4xx)", or why it may work on a later try."""
        try:
            response = client.post(f"{self.engine_url}/admin/faults",
                                   json={"step_delay_ms": delay_ms},
                                   headers={"authorization": f"Bearer {self.fault_token}"})
        except httpx.HTTPError as exc:
            return f"cannot be reached ({type(exc).__name__})"
        if 400 <= response.status_code < 500:
            return f"refused (HTTP {response.status_code})"
        if response.status_code >= 300:
            return f"failed (HTTP {response.status_code})"
        return "ok"

    def _watch(self, client: httpx.Client, seconds: float) -> bool:
        """Report alert transitions for `seconds`; True when asked to stop."""
        remaining = seconds
        while remaining > 0:
            step = min(self.poll_seconds, remaining)
            if self.stop.wait(step):
                return True
            remaining -= step
            self._report(client)
        return False

    def _report(self, client: httpx.Client) -> None:
        try:
            body = client.get(f"{self.daemon_url}/api/v1/alerts").json()
        except (httpx.HTTPError, ValueError):
            return  # the daemon is starting or restarting: the supervisor says so
        now = {a["fingerprint"]: a for a in body.get("alerts", [])}
        for fp, alert in now.items():
            if self._states.get(fp, ("", ""))[1] != alert["state"]:
                self._states[fp] = (alert["rule"], alert["state"])
                _say(f"alert {alert['rule']} {alert['state']}: p95 {_ms(alert['value'])} vs "
                     f"baseline {_ms(alert['baseline'])}")
        for fp in [fp for fp in self._states if fp not in now]:
            rule, state = self._states.pop(fp)
            _say(f"alert {rule} " + ("resolved" if state == "firing" else "no longer pending"))


def _ms(nanoseconds) -> str:
    return f"{nanoseconds / 1e6:.1f} ms" if isinstance(nanoseconds, (int, float)) else "n/a"
