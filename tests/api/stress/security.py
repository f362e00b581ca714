"""The daemon as a port on the user's machine: with LOCALAI_API_KEY every TCP route needs the key (metrics and the
schema included); foreign Host and Origin headers are refused; the socket and the home are private; a Modelfile
sent over the API cannot read, reveal or hang on files that are not models."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path

import httpx

from tests.api.stress.common import Report, daemon

KEY = "stress-key-0123456789"
EXTRA_ROUTES = ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/metrics", "/api/cache", "/nope"]


def run(report: Report, workdir: Path) -> None:
    home = workdir / "home"
    with daemon(home, api_key=KEY) as instance:
        _api_key(report, instance.base_url)
        _host_and_origin(report, instance.base_url)
        _permissions(report, home)
        _modelfiles(report, instance.base_url, workdir)


def _routes(base_url: str) -> list[tuple[str, str]]:
    schema = httpx.get(f"{base_url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    routes = [(method.upper(), path.replace("{model_id}", "smollm2").replace("{response_id}", "resp_x")
               .replace("{entry_id}", "abc")) for path, ops in schema["paths"].items() for method in ops]
    return routes + [("GET", path) for path in EXTRA_ROUTES]


def _api_key(report: Report, base_url: str) -> None:
    routes = _routes(base_url)
    open_routes, checked = [], 0
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]},
                        {"Authorization": f"Basic {KEY}"}):
            response = httpx.request(method, base_url + path, headers=headers, json={}, timeout=30)
            checked += 1
            if response.status_code != 401 and path not in ("/", "/health"):
                open_routes.append(f"{method} {path} {headers} -> {response.status_code}")
        with_key = httpx.request(method, base_url + path, json={}, timeout=60,
                                 headers={"Authorization": f"Bearer {KEY}"})
        if with_key.status_code == 401:
            open_routes.append(f"{method} {path} refused the right key")
    report.figure(f"API key: {len(routes)} routes x 4 wrong or missing keys = {checked} requests; answered without "
                  f"the key: {len(open_routes)} (/ and /health are open by design: liveness only); compared with "
                  "hmac.compare_digest (constant time)")
    for line in open_routes:
        report.finding(f"API key not enforced: {line}")


def _host_and_origin(report: Report, base_url: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    cases = [({"Host": "evil.example"}, 403), ({"Host": "localhost.evil.example"}, 403),
             ({"Host": "127.0.0.2.nip.io"}, 403),
             ({"Origin": "http://evil.example"}, 403), ({"Origin": "null"}, 403),
             ({"Origin": "http://localhost:5173"}, 200), ({"Host": "localhost"}, 200)]
    wrong = []
    for headers, expected in cases:
        got = httpx.get(f"{base_url}/api/tags", headers={**auth, **headers}, timeout=10).status_code
        if got != expected:
            wrong.append(f"{headers} -> {got}, expected {expected}")
    simple = httpx.post(f"{base_url}/api/generate", headers={**auth, "Origin": "http://evil.example",
                                                           "Content-Type": "text/plain"},
                        content=b'{"model":"smollm2","prompt":"hi","stream":false}', timeout=30).status_code
    if simple != 403:
        wrong.append(f"a cross-site text/plain POST -> {simple}")
    report.figure(f"Host/Origin: {len(cases) + 1} cases, {len(wrong)} wrong")
    for line in wrong:
        report.finding(line)


def _permissions(report: Report, home: Path) -> None:
    loose = []
    for path in [home, *home.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.name == "daemon.log":  # written by the test harness, not by the daemon
            continue
        if mode & 0o077:
            loose.append(f"{path.relative_to(home.parent)} {oct(mode)}")
    report.figure(f"permissions: {sum(1 for _ in home.rglob('*')) + 1} paths under the home; open to others: "
                  f"{len(loose)}")
    for line in loose:
        report.finding(f"readable by others: {line}")


def _modelfiles(report: Report, base_url: str, workdir: Path) -> None:
    secret = workdir / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT\n" * 100)
    fifo = workdir / "fifo"
    os.mkfifo(fifo)
    cases = {
        "a text file": {"from": str(secret)},
        "/etc/passwd": {"from": "/etc/passwd"},
        "/dev/zero (endless)": {"from": "/dev/zero"},
        "/dev/urandom (endless)": {"from": "/dev/urandom"},
        "a FIFO (blocks)": {"from": str(fifo)},
        "/proc/self/environ": {"from": "/proc/self/environ"},
        "a directory": {"from": "/etc"},
        "relative escape": {"modelfile": "FROM ../../../../../../etc/passwd", "path": str(workdir)},
        "template include": {"modelfile": "FROM smollm2\nTEMPLATE {% include '/etc/passwd' %}"},
        "template import": {"modelfile": "FROM smollm2\nTEMPLATE {% import '" + str(secret) + "' as x %}"},
        "adapter": {"modelfile": f"FROM smollm2\nADAPTER {secret}"},
        "license from a file": {"modelfile": f"FROM smollm2\nLICENSE {secret}"},
    }
    leaked, failed, statuses = [], [], {}
    auth = {"Authorization": f"Bearer {KEY}"}
    for what, body in cases.items():
        result: dict[str, httpx.Response | Exception] = {}

        def send(body: dict[str, str] = body, result: dict[str, httpx.Response | Exception] = result) -> None:
            try:
                result["r"] = httpx.post(f"{base_url}/api/create", json={"model": "probe", **body}, headers=auth,
                                         timeout=60)
            except httpx.HTTPError as exc:
                result["r"] = exc

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        thread.join(70)
        response = result.get("r")
        if not isinstance(response, httpx.Response):
            failed.append(f"{what}: no answer ({response!r})")
            continue
        statuses[what] = response.status_code
        if response.status_code >= 500 or (response.status_code == 200 and what != "license from a file"):
            failed.append(f"{what}: {response.status_code} {response.text[:160]}")
        text = response.text
        if "TOP-SECRET" in text or "root:x:0:0" in text or "PATH=" in text:
            leaked.append(f"{what}: the answer reveals the file: {text[:160]}")
        show = httpx.post(f"{base_url}/api/show", json={"model": "probe"}, headers=auth, timeout=30)
        if "TOP-SECRET" in show.text or "root:x:0:0" in show.text:
            leaked.append(f"{what}: /api/show of the created model reveals the file")
        httpx.request("DELETE", f"{base_url}/api/delete", json={"model": "probe"}, headers=auth, timeout=30)
    with contextlib.suppress(OSError):  # unblock anything still waiting on the FIFO (ENXIO: nothing is)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    report.figure(f"Modelfiles over the API: {len(cases)} hostile sources, statuses {statuses}; leaks {len(leaked)}; "
                  f"hangs or 5xx {len(failed)}")
    for line in leaked + failed:
        report.finding(line)
