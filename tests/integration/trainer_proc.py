"""A trainer process for the fault tests: one rank, a checkpoint after every batch.

``python trainer_proc.py SERVER JOB RANK WORLD CHECKPOINT [--delay S] [--epochs N]
[--no-load] [--log JSONL] [--slices K] [--close-on-term]``

Each step it "trains" (sleeps ``--delay``), then writes its checkpoint: the
client's ``state_dict()`` and every batch it has trained on, in one atomic
file replace, as a real trainer saves model and data state together. Killed
at any moment and started again, it loads that checkpoint and continues, so
its record of batches must equal an uninterrupted run's.

Options for the fault campaign (tests/integration/test_fault_campaign.py), all
off by default:

* ``--no-load``: start without loading the checkpoint even if it exists (the
  rank continues where the store says);
* ``--log JSONL``: one line per event, each written whole by one ``write`` to a
  file opened for appending (a kill -9 leaves no partial line): ``start``
  (the position loaded, or null), ``batch`` (epoch, step, sample ids, on
  receipt, before the step trains), ``checkpoint`` (the position, after
  ``state_dict()`` returned and before the file is replaced), ``fenced``;
* ``--slices K``: the step's ``--delay`` is K sleeps of ``delay / K``, so a
  step is work that does not advance while the process is stopped (SIGSTOP):
  continued, it still has the rest of its step to do, as a trainer stopped
  in the middle of its forward pass;
* ``--close-on-term``: SIGTERM raises ``SystemExit`` in the step, so the
  client's ``with`` block closes it (the held batch, which failed, is not
  consumed; the acknowledgements sent so far are flushed) and the process
  exits 143.

A process that is replaced by a newer one for its rank (``FencedError``)
logs ``fenced``, prints ``fenced: ...`` and exits 3.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ladle.client import BatchClient, FencedError


def save(path: Path, state: dict[str, object], records: list[list[int]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"state": state, "records": records}))
    os.replace(tmp, path)


class EventLog:
    """The ``--log`` file (nothing without one)."""

    def __init__(self, path: Path | None) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path is not None else None

    def write(self, **event: Any) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps(event) + "\n").encode())


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(143)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("job")
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument("--log", type=Path, default=None)
    parser.add_argument("--slices", type=int, default=1)
    parser.add_argument("--close-on-term", action="store_true")
    args = parser.parse_args()
    if args.close_on_term:
        signal.signal(signal.SIGTERM, _terminated)
    events = EventLog(args.log)
    records: list[list[int]] = []
    try:
        with BatchClient(args.rank, args.world, args.server, args.job, timeout=60) as client:
            loaded = None
            if args.checkpoint.exists() and not args.no_load:
                saved = json.loads(args.checkpoint.read_text())
                records = saved["records"]
                client.load_state_dict(saved["state"])
                loaded = [saved["state"]["epoch"], saved["state"]["step"]]
            events.write(event="start", pid=os.getpid(), loaded=loaded)
            while True:
                epoch = client.position[0] if client.position is not None else 0
                if epoch >= args.epochs:
                    break
                for batch in client:
                    ids = [int(i) for i in batch.sample_ids]
                    events.write(event="batch", epoch=batch.epoch, step=batch.step, ids=ids)
                    for _ in range(args.slices):
                        time.sleep(args.delay / args.slices)
                    records.append([batch.epoch, batch.step, *ids])
                    state = client.state_dict()
                    events.write(event="checkpoint", epoch=state["epoch"], step=state["step"])
                    save(args.checkpoint, state, records)
                save(args.checkpoint, client.state_dict(), records)
    except FencedError as exc:
        events.write(event="fenced", message=str(exc))
        print(f"fenced: {exc}", flush=True)
        sys.exit(3)
    print("done", flush=True)


if __name__ == "__main__":
    main()
