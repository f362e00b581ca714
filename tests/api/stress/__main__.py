"""`python -m tests.api.stress [CHECK ...]`: run the abuse checks (all by default) and print their figures."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests.api.stress import (
    cachesoak,
    chaos,
    disk,
    edges,
    fuzz,
    isolation,
    load,
    oversized,
    security,
    starve,
    stored,
    templates,
)
from tests.api.stress.common import Report

# templates, isolation, stored, oversized, edges: issue 38's hostile input (templates that never end, a shared
# cache that answers guesses, stored responses without bounds, oversized requests, the smaller findings)
# starve: issue 46's long prompt beside short ones (200 images, a 20,000-page PDF)
CHECKS = ("security", "fuzz", "disk", "chaos", "load", "cache", "templates", "isolation", "stored", "oversized",
          "edges", "starve")
SECTIONS = {"templates": templates.run, "isolation": isolation.run, "oversized": oversized.run, "edges": edges.run,
            "starve": starve.run}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.api.stress", description=__doc__)
    parser.add_argument("checks", nargs="*", default=list(CHECKS),
                        help=f"which checks: {', '.join(CHECKS)} (default: all)")
    parser.add_argument("--kills", type=int, default=20, help="kill -9 of the worker and of the daemon, each")
    parser.add_argument("--load-seconds", type=float, default=180.0, help="how long 64 clients load each daemon")
    parser.add_argument("--examples", type=int, default=25, help="schemathesis examples per operation")
    parser.add_argument("--soak-seconds", type=float, default=600.0, help="how long the prompt store's soak runs")
    parser.add_argument("--chain-turns", type=int, default=1000,
                        help="turns of the stored-responses chain (50 KB each)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="localai-stress-"))
    reports = []
    for name in args.checks:
        report = Report(name)
        print(f"== {name}", flush=True)
        started = time.monotonic()
        folder = workdir / name
        try:
            if name == "security":
                security.run(report, folder)
            elif name == "fuzz":
                fuzz.run(report, folder, args.examples)
            elif name == "disk":
                disk.run(report, folder)
            elif name == "chaos":
                chaos.run(report, folder, args.kills)
            elif name == "cache":
                cachesoak.run(report, folder, args.soak_seconds)
            elif name == "stored":
                stored.run(report, folder, args.chain_turns)
            elif name in SECTIONS:
                SECTIONS[name](report, folder)
            else:
                load.run(report, folder, args.load_seconds)
        except Exception as exc:  # a check that crashes is a finding, and the others still run
            report.finding(f"the check crashed: {exc!r}")
        print(f"   ({time.monotonic() - started:.0f} s)", flush=True)
        reports.append(report)
    print("\n== summary")
    for report in reports:
        print(f"{report.name}: {'ok' if not report.findings else f'{len(report.findings)} findings'}")
        for figure in report.figures:
            print(f"  {figure}")
        for finding in report.findings:
            print(f"  FINDING: {finding}")
    return 1 if any(report.findings for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
