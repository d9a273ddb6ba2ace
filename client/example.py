"""The example trainer of the compose stack and the Kubernetes Job: one rank reading epochs from ladle.

``python -m ladle.client.example [--epochs N] [--out DIR] [--step-ms MS]``

It takes everything else from the environment, as a torch.distributed
launcher sets it: ``RANK``, ``WORLD_SIZE``, ``LADLE_SERVER`` (one address or
``a:50051,b:50051``), ``LADLE_JOB``. It stands in for a training step with
``--step-ms`` of sleep, prints its progress and throughput, and with
``--out`` saves the row indices it received (``DIR/rank-R.npy``) and a
checkpoint of its data state (``DIR/rank-R.state.json``) after every epoch, so
a restarted container continues exactly where it stopped and a check can
prove that every row was delivered once. Needs only numpy and grpcio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from .client import BatchClient


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ladle.client.example", description="one rank's epochs")
    parser.add_argument("--epochs", type=int, default=1, help="epochs to read (default 1)")
    parser.add_argument("--out", type=Path, help="save received row indices and the data state here")
    parser.add_argument("--step-ms", type=float, default=0.0, help="sleep this long per batch")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a server")
    args = parser.parse_args(argv)
    client = BatchClient(timeout=args.timeout)
    ids_path = state_path = None
    received: list[np.ndarray] = []
    if args.out is not None:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # one line, as every other refusal of ladle's commands
            why = exc.strerror or exc
            parser.exit(2, f"{parser.prog}: error: --out {args.out}: cannot create it: {why}\n")
        ids_path = args.out / f"rank-{client.rank}.npy"
        state_path = args.out / f"rank-{client.rank}.state.json"
        if state_path.exists() and ids_path.exists():
            client.load_state_dict(json.loads(state_path.read_text()))
            received.append(np.load(ids_path))
    print(
        f"rank {client.rank}/{client.world_size} of job {client.job!r} reading from {client.server}",
        flush=True,
    )
    with client:
        while client.position is None or client.position[0] < args.epochs:
            start, batches, tokens = time.perf_counter(), 0, 0
            for batch in client:
                if args.step_ms:
                    time.sleep(args.step_ms / 1000)
                received.append(np.array(batch.sample_ids))
                batches += 1
                tokens += batch.real_tokens
            seconds = time.perf_counter() - start
            epoch = client.position[0] - 1 if client.position is not None else 0
            print(
                f"rank {client.rank}: epoch {epoch}: {batches} batches, {tokens:,} tokens "
                f"in {seconds:.1f}s ({tokens / max(seconds, 1e-9):,.0f} tokens/s)",
                flush=True,
            )
            if ids_path is not None and state_path is not None:
                rows = np.concatenate(received) if received else np.empty(0, np.int64)
                np.save(ids_path, rows)
                state_path.write_text(json.dumps(client.state_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
