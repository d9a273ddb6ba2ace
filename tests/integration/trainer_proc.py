"""A trainer process for the fault tests: one rank, a checkpoint after every batch.

``python trainer_proc.py SERVER JOB RANK WORLD CHECKPOINT [--delay S] [--epochs N]``

Each step it "trains" (sleeps ``--delay``), then writes its checkpoint: the
client's ``state_dict()`` and every batch it has trained on, in one atomic
file replace, as a real trainer saves model and data state together. Killed
at any moment and started again, it loads that checkpoint and continues, so
its record of batches must equal an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ladle.client import BatchClient


def save(path: Path, state: dict[str, object], records: list[list[int]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"state": state, "records": records}))
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("server")
    parser.add_argument("job")
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    records: list[list[int]] = []
    with BatchClient(args.rank, args.world, args.server, args.job, timeout=60) as client:
        if args.checkpoint.exists():
            saved = json.loads(args.checkpoint.read_text())
            records = saved["records"]
            client.load_state_dict(saved["state"])
        while True:
            epoch = client.position[0] if client.position is not None else 0
            if epoch >= args.epochs:
                break
            for batch in client:
                time.sleep(args.delay)
                records.append([batch.epoch, batch.step, *(int(i) for i in batch.sample_ids)])
                save(args.checkpoint, client.state_dict(), records)
            save(args.checkpoint, client.state_dict(), records)
    print("done", flush=True)


if __name__ == "__main__":
    main()
