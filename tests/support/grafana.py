"""Grafana's HTTP API as far as ac-observe uses it: folders and dashboards/db (`dashboards
push`), and annotations (the daemon's `grafana` receiver). Grafana itself cannot be had on
these machines. The stand-in records what it is sent and answers as Grafana 11 does:
bearer tokens checked, annotations found by time range (an annotation [time, timeEnd]
overlapping [from, to]) and by tags (all of them, unless matchAny)."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class Grafana:
    def __init__(self, token: str | None):  # noqa: C901 - the stand-in's routes, one a branch
        owner, self.token = self, token
        self.folders: dict[str, str] = {}
        self.dashboards: list[dict] = []
        self.annotations: list[dict] = []
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, headers)
        # "ok"; "lost": store the annotation, then drop the connection without an answer
        # (an attempt whose answer the sender never hears); a status ("500", "404", ...):
        # store nothing and answer it.
        self.mode = "ok"
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self):
                owner.requests.append((self.command, self.path,
                                       {k.lower(): v for k, v in self.headers.items()}))
                if owner.token is not None and \
                        self.headers.get("authorization") != f"Bearer {owner.token}":
                    self._answer(401, {"message": "Unauthorized"})
                    return False
                return True

            def do_GET(self):
                if not self._authorized():
                    return
                url = urlsplit(self.path)
                if url.path == "/api/annotations":
                    return self._answer(200, owner.find(parse_qs(url.query)))
                uid = url.path.rsplit("/", 1)[-1]
                if url.path.startswith("/api/folders/") and uid in owner.folders:
                    return self._answer(200, {"uid": uid, "title": owner.folders[uid]})
                self._answer(404, {"message": "folder not found"})

            def do_POST(self):
                if not self._authorized():
                    return
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path == "/api/folders":
                    owner.folders[body["uid"]] = body["title"]
                    return self._answer(200, {"uid": body["uid"], "title": body["title"]})
                if self.path == "/api/dashboards/db":
                    owner.dashboards.append(body)
                    uid = body["dashboard"]["uid"]
                    return self._answer(200, {"status": "success", "uid": uid,
                                              "url": f"/d/{uid}/x"})
                if self.path == "/api/annotations":
                    if owner.mode.isdigit():
                        return self._answer(int(owner.mode), {"message": "refused"})
                    if not isinstance(body.get("time"), int) or not body.get("text"):
                        return self._answer(400, {"message": "bad annotation"})
                    with owner._lock:
                        stored = {**body, "id": len(owner.annotations) + 1,
                                  "timeEnd": body.get("timeEnd", body["time"])}
                        owner.annotations.append(stored)
                    if owner.mode == "lost":
                        self.close_connection = True
                        self.connection.close()
                        return
                    return self._answer(200, {"message": "Annotation added",
                                              "id": stored["id"]})
                self._answer(404, {"message": "not found"})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def find(self, query: dict[str, list[str]]) -> list[dict]:
        start = int(query.get("from", ["0"])[0])
        end = int(query.get("to", [str(2 ** 62)])[0])
        tags = set(query.get("tags", []))
        match_any = query.get("matchAny", ["false"])[0] == "true"
        limit = int(query.get("limit", ["100"])[0])
        out = []
        with self._lock:
            for item in self.annotations:
                have = set(item.get("tags") or ())
                if tags and not (have & tags if match_any else tags <= have):
                    continue
                if item["time"] <= end and item["timeEnd"] >= start:
                    out.append(item)
        return out[-limit:]

    def close(self):
        self.server.shutdown()
        self.server.server_close()
