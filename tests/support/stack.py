"""The stack's other parts for real: Prometheus and Alertmanager (Debian packages) started
from the shipped configuration under dashboards/, on free loopback ports."""
from __future__ import annotations

import math
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import yaml

from support.processes import start_process, stop_process
from support.servers import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "dashboards"


class _Process:
    def __init__(self, args: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "w")
        self.proc = start_process(args, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, url: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[0]} exited: "
                                   f"{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()  # not left running behind a failed fixture
                raise TimeoutError(f"{self.proc.args[0]} not ready: "
                                   f"{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self):
        stop_process(self.proc)
        self._log.close()


class Prometheus(_Process):
    """The shipped prometheus.yml and rules, with only the addresses of this machine's
    daemon and Alertmanager put in for the compose service names, the daemon's token in a
    file of its own for the compose secret's, and plain HTTP for the stack's TLS; and
    `extra_rules`, a rule file's text, when given."""

    def __init__(self, base: Path, daemon_target: str | list[str],
                 alertmanager_target: str | None, token: str, data: Path | None = None,
                 extra_rules: str | None = None):
        base.mkdir(parents=True, exist_ok=True)
        shutil.copytree(SHIPPED / "prometheus", base / "etc", dirs_exist_ok=True)
        config = yaml.safe_load((base / "etc" / "prometheus.yml").read_text())
        if extra_rules is not None:  # a rule file beside the shipped ones (`rules export`)
            (base / "etc" / "rules" / "extra.rules.yml").write_text(extra_rules)
            config["rule_files"].append("rules/extra.rules.yml")
        (base / "etc" / "daemon.token").write_text(token + "\n")
        for job in config["scrape_configs"]:
            if job["job_name"] == "ac-observe":
                job["static_configs"] = [{"targets": [daemon_target] if isinstance(
                    daemon_target, str) else list(daemon_target)}]
                # (the compose secret's file, in the container)
                assert job["authorization"]["credentials_file"] == \
                    "/run/secrets/ac_observe_token"
                job["authorization"]["credentials_file"] = str(base / "etc" / "daemon.token")
                # The compose stack's TLS (the CA in a compose secret); the daemons here
                # speak plain HTTP (TLS is tests/test_tls.py's).
                assert job.pop("tls_config") == {"ca_file": "/run/secrets/ac_observe_ca"}
                assert job.pop("scheme") == "https"
        self.port = free_port()
        for job in config["scrape_configs"]:
            if job["job_name"] == "prometheus":
                job["static_configs"] = [{"targets": [f"127.0.0.1:{self.port}"]}]
        if alertmanager_target is None:
            config.pop("alerting")
        else:
            config["alerting"]["alertmanagers"][0]["static_configs"] = [
                {"targets": [alertmanager_target]}]
        (base / "etc" / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(["prometheus", f"--config.file={base / 'etc' / 'prometheus.yml'}",
                          f"--storage.tsdb.path={data or base / 'data'}",
                          f"--web.listen-address=127.0.0.1:{self.port}",
                          "--web.enable-lifecycle"], base / "prometheus.log")
        self.wait_ready(self.url + "/-/ready")

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        answer = httpx.get(self.url + "/api/v1/query", params=params, timeout=30).json()
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def wait_scrape_and_rules(self, job: str, since: float, timeout: float = 30.0) -> None:
        """Until a scrape of `job` begun after `since` is in, then until every rule group
        was evaluated after that (its recorded and alerting series include the scrape)."""
        def scraped() -> bool:
            result = self.query(f'timestamp(up{{job="{job}"}})')
            return bool(result) and float(result[0]["value"][1]) > since
        wait_for(scraped, timeout, f"a scrape of {job} begun after {since:.3f}")
        seen = time.time()

        def evaluated() -> bool:
            answer = httpx.get(self.url + "/api/v1/rules", timeout=10).json()
            groups = answer["data"]["groups"]
            return bool(groups) and all(_rfc3339(g["lastEvaluation"]) > seen for g in groups)
        wait_for(evaluated, timeout, "every rule group evaluated after that scrape")

    def targets_up(self) -> bool:
        answer = httpx.get(self.url + "/api/v1/targets", timeout=10).json()
        return all(t["health"] == "up" for t in answer["data"]["activeTargets"]) and \
            bool(answer["data"]["activeTargets"])


class GlobalPrometheus(Prometheus):
    """The shipped global.yml (docs/fleet.md): a Prometheus federating the recording rules
    and the Fleet board's gauges from `sources` (cluster Prometheus servers' addresses),
    every `interval`."""

    def __init__(self, base: Path, sources: list[str], interval: str = "5s"):
        base.mkdir(parents=True, exist_ok=True)
        config = yaml.safe_load((SHIPPED / "prometheus" / "global.yml").read_text())
        config["global"].update(scrape_interval=interval, evaluation_interval=interval,
                                scrape_timeout=interval)
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": list(sources)}]
        (base / "global.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        _Process.__init__(self, ["prometheus", f"--config.file={base / 'global.yml'}",
                                 f"--storage.tsdb.path={base / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{self.port}"],
                          base / "prometheus.log")
        self.wait_ready(self.url + "/-/ready")


class Alertmanager(_Process):
    """The shipped alertmanager.yml with the webhook URL put in from the environment's
    variable, as the compose service does."""

    def __init__(self, base: Path, webhook_url: str):
        base.mkdir(parents=True, exist_ok=True)
        text = (SHIPPED / "alertmanager" / "alertmanager.yml").read_text()
        (base / "alertmanager.yml").write_text(text.replace("${AC_ALERT_WEBHOOK_URL}",
                                                            webhook_url))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(["prometheus-alertmanager",
                          f"--config.file={base / 'alertmanager.yml'}",
                          f"--storage.path={base / 'data'}",
                          f"--web.listen-address=127.0.0.1:{self.port}",
                          "--cluster.listen-address="], base / "alertmanager.log")
        self.wait_ready(self.url + "/-/ready")


def delivery_of(hook, alertname: str):
    """The first body a webhook receiver got that carries an alert named `alertname`
    (other rules' groups may arrive before it); None until one has."""
    import json
    for _, raw in list(hook.requests):
        body = json.loads(raw)
        if any(a["labels"]["alertname"] == alertname for a in body["alerts"]):
            return body
    return None


def finite(result: list[dict]) -> bool:
    """Some series of an instant query's answer holds a number (not NaN)."""
    return any(math.isfinite(float(r["value"][1])) for r in result)


def _rfc3339(text: str) -> float:
    """Unix seconds of Prometheus' RFC 3339 time (`...T14:03:00.123456789Z`), which
    Python 3.10's fromisoformat refuses (a Z, nanoseconds)."""
    stamp, _, fraction = text.rstrip("Z").partition(".")
    seconds = datetime.fromisoformat(stamp).replace(tzinfo=timezone.utc).timestamp()
    return seconds + float(f"0.{fraction or 0}")
