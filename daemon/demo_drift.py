"""`ac-observe up --demo-drift`: watch a drift alert fire and resolve, on the bundled engine.

The engine runs with `--fault-injection`; the driver sends the demo traffic
(daemon/demo_load.py) and the daemon gets an alerting file with one rule (TTFT p95 of the
last 30 s, 100 % over the minute before it, for 10 s; the rule has no baseline until half
that minute was watched). A driver thread lets a baseline build, then drifts for a while
by one cause (`--demo-drift-cause`), ends it, waits, and repeats:

- steps: every engine step 300 ms slower (the engine's loopback `/admin/faults` route);
- load: a burst, BURST_CLIENTS demo clients instead of 3;
- cache: the engine's prefix cache flushed every CACHE_FLUSH_MS (the fault route), so
  prompts that shared cached prefixes miss as evicted and prefill them again;
- prompts: every demo user message PROMPT_REPEAT times over: long prompts.

It prints each phase before it begins (a change is said before it is asked for, and asked
for until the engine confirms it) and every alert transition the daemon reports (`GET
/api/v1/alerts`). Torch-free; only loopback HTTP.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path

import httpx

from ac_observe.daemon.demo_load import LoadShape, run_demo_load, wait_healthy

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
DEMO_CLIENTS = 3
BURST_CLIENTS = 24
# `load`'s engine takes at most this many requests a lane into a batch, as a server at its
# limit: the burst then waits in the queue instead of slowing every step of a bigger batch.
LOAD_BATCH_LIMIT = 4
CACHE_FLUSH_MS = 50  # on a CPU step of ~100 ms: every step; a GPU's: every few
PROMPT_REPEAT = 24
CAUSES = ("steps", "load", "cache", "prompts")
# What each cause's drift is, as said when it begins and when it ends.
CAUSE_TEXT = {
    "steps": (f"slowing every engine step by {STEP_DELAY_MS} ms", "removing the delay"),
    "load": (f"a burst of load: {BURST_CLIENTS} demo clients instead of {DEMO_CLIENTS}",
             "ending the burst"),
    "cache": (f"flushing the engine's prefix cache every {CACHE_FLUSH_MS} ms",
              "no more flushes"),
    "prompts": (f"sending prompts {PROMPT_REPEAT}x longer", "back to short prompts"),
}
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
    """Alternates calm (`calm_seconds`) and drifting (`drift_seconds`) phases, by `cause`
    (CAUSES), and reports the daemon's alert transitions as they happen. A drifting phase
    lasts until DemoLatencyDrift has fired, up to DRIFT_PATIENCE times its length (on a
    slow or busy machine the alert needs longer: ending the drift before it fires would
    show nothing). `shape` is the demo traffic's (the driver's own load, `run_load`)."""

    def __init__(self, engine_url: str, daemon_url: str, calm_seconds: float,
                 drift_seconds: float, poll_seconds: float = 1.0, fault_token: str = "",
                 cause: str = "steps", shape: LoadShape | None = None):
        if cause not in CAUSES:
            raise ValueError(f"the demo drift's cause is one of {', '.join(CAUSES)}, "
                             f"not {cause!r}")
        self.engine_url, self.daemon_url = engine_url, daemon_url
        self.fault_token, self.cause = fault_token, cause
        self.shape = shape or LoadShape(clients=DEMO_CLIENTS)
        self.calm_seconds, self.drift_seconds = calm_seconds, drift_seconds
        self.poll_seconds = poll_seconds
        self.stop = threading.Event()
        self._states: dict[str, tuple[str, str]] = {}  # fingerprint -> (rule, state)
        self._thread = threading.Thread(target=self._run, name="demo-drift", daemon=True)
        self._load = threading.Thread(target=self.run_load, name="demo-load", daemon=True)

    def start(self) -> None:
        self._load.start()
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        self._thread.join(timeout=5)
        self._load.join(timeout=5)

    def run_load(self) -> None:
        """The demo traffic, in this shape, until stopped."""
        while not self.stop.is_set() and not wait_healthy(self.engine_url, 5.0):
            pass
        run_demo_load(self.engine_url, self.stop, shape=self.shape)

    def drift(self, client: httpx.Client, on: bool) -> bool:
        """Begin (`on`) or end the cause's drift, asking the engine until it confirms;
        False when asked to stop first, or when the engine refuses (the demo stops)."""
        if self.cause == "load":
            self.shape.clients = BURST_CLIENTS if on else DEMO_CLIENTS
        elif self.cause == "prompts":
            self.shape.prompt_repeat = PROMPT_REPEAT if on else 1
        elif self.cause == "cache":
            return self._set_faults(client, {"prefix_flush_ms": CACHE_FLUSH_MS if on else 0})
        else:
            return self._set_faults(client, {"step_delay_ms": STEP_DELAY_MS if on else 0})
        return not self.stop.is_set()

    def _run(self) -> None:
        begin, end = CAUSE_TEXT[self.cause]
        with httpx.Client(timeout=5) as client:
            while not self.stop.is_set():
                _say(f"demo drift: building a baseline for {self.calm_seconds:g}s")
                if self._watch(client, self.calm_seconds):
                    return
                _say(f"demo drift: {begin} for {self.drift_seconds:g}s; DemoLatencyDrift "
                     "should fire (ac-observe alerts)")
                if not self.drift(client, True):
                    return
                stopped = self._watch(client, self.drift_seconds)
                extra = (DRIFT_PATIENCE - 1) * self.drift_seconds
                while not stopped and extra > 0 and not self._firing(DEMO_RULE):
                    stopped = self._watch(client, min(self.poll_seconds, extra))
                    extra -= self.poll_seconds
                if stopped:
                    self._faults(client, {"step_delay_ms": 0, "prefix_flush_ms": 0})  # once:
                    return  # the engine is being stopped too
                if self._firing(DEMO_RULE):
                    _say(f"demo drift: {end}; the alert should resolve")
                else:
                    _say(f"demo drift: {end}; {DEMO_RULE} did not fire within "
                         f"{DRIFT_PATIENCE * self.drift_seconds:g}s (is the daemon "
                         "evaluating rules? see ac-observe alerts)")
                if not self.drift(client, False):
                    return

    def _firing(self, rule: str) -> bool:
        return (rule, "firing") in self._states.values()

    def _set_faults(self, client: httpx.Client, faults: dict) -> bool:
        """Ask the engine for these faults until it confirms (a request that timed out
        may have been applied: each is set, not added, so asking again is safe), said
        once and retried every 2 s while it cannot be reached or fails (5xx); False when
        asked to stop first, or when the engine refuses it (4xx: the demo stops)."""
        said = False
        while not self.stop.is_set():
            outcome = self._faults(client, faults)
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

    def _faults(self, client: httpx.Client, faults: dict) -> str:
        """"ok", "refused (HTTP 4xx)", or why it may work on a later try."""
        try:
            response = client.post(f"{self.engine_url}/admin/faults", json=faults,
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


def demo_engine_args(cause: str, engine_args: list[str]) -> list[str]:
    """What `up --demo-drift` adds to the engine's command: the fault route, and for a
    burst the batch limit, unless the user set one."""
    added = ["--fault-injection"]
    if cause == "load" and "--throughput-seqs" not in engine_args:
        added += ["--throughput-seqs", str(LOAD_BATCH_LIMIT)]
    return added
