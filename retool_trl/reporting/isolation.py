"""Says which isolation the model's code runs under, once, when a command that runs code starts, and records it in
the run folder (`isolation.json`), so that a run's results can be read with the protections they were made under.

A local sandbox reports its level, a one-line summary and, in words, each protection that does not hold
(`LocalSandbox.isolation_report()`); a remote service's isolation is the service's own (its `/health` says it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("retool_trl.isolation")

ISOLATION_FILE = "isolation.json"


def isolation_of(sandbox) -> dict:
    """The isolation report of `sandbox` (through its wrappers), or what is known of a backend without one."""
    report = getattr(sandbox, "isolation_report", None)
    if callable(report):
        return dict(report())  # raises what the sandbox raises when it cannot start
    url = getattr(sandbox, "url", None)
    if isinstance(url, str):
        return {
            "isolation": "remote",
            "url": url,
            "summary": f"code runs in the service at {url}: its isolation is the service's own (GET {url}/health "
            "lists what it does not give).",
            "missing": [],
        }
    return {"isolation": type(sandbox).__name__, "summary": "a sandbox without an isolation report.", "missing": []}


def record_isolation(sandbox, folder: str | Path | None) -> dict:
    """Reports the isolation of `sandbox` on one line and writes it to `folder/isolation.json` (when `folder` is
    given); returns the report. Starts a local sandbox (its level is known once its zygote runs)."""
    try:
        report = isolation_of(sandbox)
    except Exception:  # noqa: BLE001 - a sandbox that cannot start: the command's own check says why, in full
        return {}
    where = "LocalSandbox().isolation_report()['missing']" if report.get("missing") else "isolation_report()"
    if folder is not None:
        path = Path(folder) / ISOLATION_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2) + "\n")
            where = f"{path} ('missing')" if report.get("missing") else str(path)
        except OSError as error:
            logger.warning("could not write %s (%s)", path, error.strerror or error)
    summary = report.get("summary") or f"isolation level {report.get('isolation')}."
    if report.get("missing"):
        logger.info("sandbox: %s What it does not give, in full: %s", summary, where)
    else:
        logger.info("sandbox: %s (recorded in %s)", summary, where)
    return report


__all__ = ["ISOLATION_FILE", "isolation_of", "record_isolation"]
