"""What the token check and TLS cost per batch, beside the same stream without them.

Three ``ladle serve`` processes on 127.0.0.1 serve the same dataset with the
production config: ``plain`` (no token, no TLS), ``token`` (``--token-file``:
the interceptor checks every call's ``authorization`` header) and
``token+tls`` (the same plus ``--tls-cert``/``--tls-key``, certificates made
here with ``openssl``). Each repeat runs one epoch of 2 ranks (world size 2,
one client process each, prefetch 8) against each server in turn, so a burst
of load from elsewhere hits every case once; the ratios are paired per
repeat and their median reported.

Figures per case: batches/s and GB/s of frames, and CPU per batch of the
server process and of the client processes (all threads). The CPU figure is
the steadier one on a shared machine: the token is checked once per stream,
not per batch, so its cost per batch should vanish; TLS encrypts every byte.

Run: ``python -m benchmarks.bench_auth [--full]``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_serving import _Clients, _Ladle, _make, _r, _timed
from tests.support.certs import make_pki

TOKEN = "bench-" + "x" * 40
SETTINGS = {False: {"rows": 40_000, "repeats": 3}, True: {"rows": 100_000, "repeats": 7}}
CASES = ("plain", "token", "token+tls")


def main(full: bool) -> dict[str, Any]:
    s = SETTINGS[full]
    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="ladle-bench-auth-"))
    servers: dict[str, _Ladle] = {}
    clients: _Clients | None = None
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    try:
        ds = tmp / "ds"
        made = _make(ds, s["rows"])
        pki = make_pki(tmp / "pki")
        token_file = tmp / "token"
        token_file.write_text(TOKEN)
        tls = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key))
        extra = {"plain": (), "token": ("--token-file", str(token_file))}
        extra["token+tls"] = (*extra["token"], *tls)
        client = {
            "plain": {},
            "token": {"token": TOKEN},
            "token+tls": {"token": TOKEN, "root_certificates": str(pki.ca)},
        }
        for case in CASES:
            servers[case] = _Ladle(ds, tmp, case.replace("+", "-"), extra[case])
        clients = _Clients(2)
        for r in range(s["repeats"]):
            for case in CASES:
                kwargs = [
                    {
                        "address": servers[case].address,
                        "job": f"auth-{r}",
                        "rank": i,
                        "world_size": 2,
                        "client_kwargs": client[case],
                    }
                    for i in range(2)
                ]
                rates = _timed(clients, servers[case].pid, "ladle_epoch", kwargs)
                rates.pop("_sizes", None)
                runs[case].append(rates)
        problems = {case: server.log_problems() for case, server in servers.items()}
    finally:
        if clients is not None:
            clients.close()
        for server in servers.values():
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def cpu(run: dict[str, Any]) -> float:
        return float(run["server_cpu_us_per_batch"] + run["client_cpu_us_per_batch"])

    out: dict[str, Any] = {
        "mode": "full" if full else "quick",
        "cpus": os.cpu_count(),
        "dataset": made,
        "repeats": s["repeats"],
        "batches_per_epoch": runs["plain"][0]["messages"],
        "cases": {
            case: {
                "batches_s": _r(statistics.median(r["batches_s"] for r in case_runs), 0),
                "gb_s": _r(statistics.median(r["gb_s"] for r in case_runs)),
                "server_cpu_us_per_batch": _r(
                    statistics.median(r["server_cpu_us_per_batch"] for r in case_runs), 0
                ),
                "client_cpu_us_per_batch": _r(
                    statistics.median(r["client_cpu_us_per_batch"] for r in case_runs), 0
                ),
                "runs_batches_s": [_r(r["batches_s"], 0) for r in case_runs],
            }
            for case, case_runs in runs.items()
        },
        "server_log_problems": {case: lines[-5:] for case, lines in problems.items() if lines},
        "target": "token check: < 5% per batch against the same stream without it",
    }
    for case in ("token", "token+tls"):
        pairs = list(zip(runs[case], runs["plain"], strict=True))
        out[f"{case}_throughput_vs_plain"] = _r(
            statistics.median(a["batches_s"] / b["batches_s"] for a, b in pairs), 3
        )
        out[f"{case}_cpu_overhead_pct"] = _r(
            statistics.median((cpu(a) / cpu(b) - 1) * 100 for a, b in pairs), 1
        )
    out["load_average_before_after"] = [_r(load_before, 2), _r(os.getloadavg()[0], 2)]
    return out


def summary(results: dict[str, Any]) -> list[str]:
    c = results["cases"]
    lines = [
        f"auth/TLS, {results['batches_per_epoch']:,} batches an epoch over 2 ranks, "
        f"{results['repeats']} paired repeats ({results['cpus']} cores):"
    ]
    for case in CASES:
        x = c[case]
        line = (
            f"  {case:<10} {x['batches_s']:>7,.0f} batches/s {x['gb_s']:.3f} GB/s, CPU per batch "
            f"{x['server_cpu_us_per_batch']:,.0f} server + {x['client_cpu_us_per_batch']:,.0f} clients us"
        )
        if case != "plain":
            line += (
                f" -> {results[f'{case}_throughput_vs_plain']}x the plain rate, "
                f"CPU {results[f'{case}_cpu_overhead_pct']:+.1f}%"
            )
        lines.append(line)
    lines.append(f"  target: {results['target']}")
    return lines


if __name__ == "__main__":
    results = main("--full" in sys.argv[1:])
    print(json.dumps(results, indent=2))
    print("\n".join(summary(results)), file=sys.stderr)
