"""ladle feeding training steps on a GPU, beside a local DataLoader and batches already on the GPU.

``python -m benchmarks.bench_gpu [--steps S] [--cpu]``: one ``ladle serve``
on this machine (production config: token budget 49152, <= 64 rows a batch,
a 40,000-row production-mix dataset made here), rank 0 of world size 1.

1. ``next()`` with a full prefetch window (the loop sleeps 2 ms a batch):
   ``BatchClient(device="cuda")`` (each batch copied through pinned memory on
   the client's own CUDA stream, the trainer's stream made to wait on an
   event) beside ``BatchClient()`` (numpy) in the same run. Then, in this
   thread alone, what a batch costs each side of the client for the same
   received frames: the reader thread's conversion of a decoded frame into
   a ``Batch`` (the copies queued) and, on the trainer's thread, its
   ``_ready`` hook (the stream wait and ``record_stream``), beside the numpy
   conversion.
2. Training steps of a causal LM made from a config (transformers' Llama,
   random weights, nothing downloaded; bf16 autocast, fused AdamW, SDPA
   attention), in two sizes, each fed the same batches (steps 0.. of the
   schedule) three ways, each after the same warm-up steps:

   - ``resident``: the batches copied to the GPU before the clock starts:
     the model alone, the ceiling;
   - ``ladle``: ``BatchClient(device="cuda", prefetch=8)``;
   - ``dataloader``: ``DataLoader(num_workers=2, pin_memory=True)`` over the
     same schedule and assembly (``bench_serving.ScheduleBatches``), each
     batch moved with ``.to("cuda", non_blocking=True)``.

   Every feed's batch becomes the model's inputs through
   ``ladle.client.hf.model_inputs`` (int64 ids and mask, labels -100 where
   ``loss_mask`` is 0). One untimed pass over the batches comes first (each
   new batch shape picks its kernels on its first step). The feeds alternate, ``--repeats`` times; the
   medians are reported, with ladle's and the DataLoader's rate as a share of
   the resident one's (1.0: the data path costs the GPU nothing) and the time
   the loop spent inside ``next()`` a step.

``--cpu`` runs the same code on the CPU with a tiny model and small batches
(token budget 3072, 256 token ids, float32): a check that the benchmark runs, for machines without a
GPU; nothing it prints is a GPU figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np

from benchmarks.bench_serving import PREFETCH, ScheduleBatches, _frame_of, _Ladle, _latency, _r
from benchmarks.bench_wire import WAIT_S
from ladle.service.schedule import ScheduleConfig
from ladle.service.synth import make_dataset

ROWS = 40_000
VOCAB = 32000
CPU_VOCAB = 256
WARM = 10
# --cpu: the test suite's small batches (what `tests/integration/conftest.py` serves)
CPU_FLAGS = ("--max-seq-len", "512", "--bucket-bounds", "0,48,76,108,152,206,513",
             "--token-budget", "3072", "--max-batch-size", "16")  # fmt: skip
CPU_CONFIG = ScheduleConfig(
    max_seq_len=512, bucket_bounds=(0, 48, 76, 108, 152, 206, 513), token_budget=3072, max_batch_size=16
)
MODELS: dict[str, dict[str, int]] = {
    # hidden, layers, heads, MLP width; the vocabulary is the dataset's (VOCAB)
    "llama-18M": {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "intermediate_size": 704},
    "llama-92M": {"hidden_size": 768, "num_hidden_layers": 6, "num_attention_heads": 12,
                   "intermediate_size": 2048},
}  # fmt: skip
CPU_MODELS = {"llama-tiny": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                             "intermediate_size": 64}}  # fmt: skip


def _model(shape: dict[str, int], vocab: int, device: Any) -> tuple[Any, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes: dict[str, Any] = dict(shape, num_key_value_heads=shape["num_attention_heads"])
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, **sizes)
    model = LlamaForCausalLM(config).to(device)
    model.config._attn_implementation = "sdpa"
    fused = device.type == "cuda"
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)


def _conversion(address: str, device: Any, frames: int) -> dict[str, dict[str, float | None]]:
    """Per batch, median and p99: the reader's conversion, and the trainer's ``_ready``, on one thread.

    The frames are a numpy client's (the server's real batches); each is
    decoded once, then converted for numpy and for ``device``, alternated,
    with the device synchronized every 32 batches so the copies queued stay
    bounded, as a prefetch window bounds them.
    """
    import torch

    from ladle.client import BatchClient
    from ladle.client._device import converter
    from ladle.proto import codec

    received: list[bytes] = []
    with BatchClient(0, 1, address, "conversion-frames", prefetch=PREFETCH, timeout=WAIT_S) as client:
        while len(received) < frames:
            before = len(received)
            for batch in client:
                frame = _frame_of(batch)
                if frame is not None:
                    received.append(frame)
                if len(received) == frames:
                    break
            if len(received) == before:
                break  # an epoch without a frame of ours: nothing more will come
    decoded = [d for d in map(codec.decode_frame, received) if isinstance(d, codec.DecodedBatch)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    times: dict[str, tuple[list[int], list[int]]] = {"numpy": ([], []), str(device.type): ([], [])}
    for repeat in range(4):
        for name, to_batch in (("numpy", converter(None, None)), (str(device.type), converter(device, None))):
            for i, d in enumerate(decoded):
                began = time.perf_counter_ns()
                batch = to_batch(d)
                converted = time.perf_counter_ns()
                if batch._ready is not None:
                    batch._ready()
                readied = time.perf_counter_ns()
                if repeat:  # the first pass warms the allocators and caches
                    times[name][0].append(converted - began)
                    times[name][1].append(readied - converted)
                if i % 32 == 31:
                    sync()
            sync()
    out: dict[str, dict[str, float | None]] = {}
    for name, (convert, ready) in times.items():
        c, r = np.asarray(convert) / 1e3, np.asarray(ready) / 1e3
        out[name] = {
            "convert_median_us": _r(float(np.median(c)), 1) if c.size else None,
            "convert_p99_us": _r(float(np.percentile(c, 99)), 1) if c.size else None,
            "ready_median_us": _r(float(np.median(r)), 1) if r.size else None,
        }
    return out


def _ladle_feed(address: str, job: str, device: Any) -> Generator[tuple[Any, int]]:
    from ladle.client import BatchClient

    with BatchClient(0, 1, address, job, prefetch=PREFETCH, device=device, timeout=WAIT_S) as client:
        while True:
            for batch in client:
                yield batch, batch.real_tokens


def _loader_feed(dataset: str, steps: int, config: ScheduleConfig, device: Any) -> Generator[tuple[Any, int]]:
    from torch.utils.data import DataLoader, Dataset

    data = cast("Dataset[dict[str, Any]]", ScheduleBatches(dataset, steps, config))
    pin = device.type == "cuda"
    # spawned workers: a forked one inherits this process's CUDA tensors, and freeing one there aborts it
    loader = DataLoader(data, batch_size=None, num_workers=2, pin_memory=pin, multiprocessing_context="spawn")
    for b in loader:
        tokens = int(b["lengths"].sum())
        moved = {k: v.to(device, non_blocking=True) for k, v in b.items()}
        yield SimpleNamespace(**moved), tokens


def _resident(dataset: str, steps: int, config: ScheduleConfig, device: Any) -> list[tuple[Any, int]]:
    data = ScheduleBatches(dataset, steps, config)
    out = []
    for i in range(len(data)):
        b = data[i]
        out.append((SimpleNamespace(**{k: v.to(device) for k, v in b.items()}), int(b["lengths"].sum())))
    return out


def _train(model: Any, opt: Any, feed: Iterator[tuple[Any, int]], steps: int, device: Any) -> dict[str, Any]:
    """``WARM`` steps, then ``steps`` timed ones; the GPU is synchronized at both ends of the clock."""
    import torch

    from ladle.client.hf import model_inputs

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(batch: Any) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(**model_inputs(batch)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(WARM):
        step(next(feed)[0])
    sync()
    began = time.perf_counter()
    waited = 0.0
    tokens = 0
    loss = None
    for _ in range(steps):
        asked = time.perf_counter()
        batch, real = next(feed)
        waited += time.perf_counter() - asked
        tokens += real
        loss = step(batch)
    sync()
    seconds = time.perf_counter() - began
    return {
        "steps": steps,
        "seconds": _r(seconds),
        "steps_s": _r(steps / seconds, 1),
        "real_tokens_s": round(tokens / seconds),
        "next_ms_per_step": _r(waited / steps * 1e3, 3),
        "last_loss": _r(float(loss.detach()), 3) if loss is not None else None,
    }


def bench_training(
    dataset: Path, server: _Ladle, steps: int, repeats: int, models: dict[str, dict[str, int]],
    config: ScheduleConfig, vocab: int, device: Any,
) -> dict[str, Any]:  # fmt: skip
    import torch

    out: dict[str, Any] = {}
    resident = _resident(str(dataset), WARM + steps, config, device)
    for name, shape in models.items():
        model, opt = _model(shape, vocab, device)
        runs: dict[str, list[dict[str, Any]]] = {"resident": [], "ladle": [], "dataloader": []}
        # every batch shape once before any clock: the first step of a new shape picks its
        # kernels (a cold first pass ran at a fifth of the speed of the next on an H200)
        _train(model, opt, iter(resident), steps, device)
        for r in range(repeats):
            runs["resident"].append(_train(model, opt, iter(resident), steps, device))
            feed = _ladle_feed(server.address, f"train-{name}-{r}", device)
            runs["ladle"].append(_train(model, opt, feed, steps, device))
            feed.close()
            feed = _loader_feed(str(dataset), WARM + steps, config, device)
            runs["dataloader"].append(_train(model, opt, feed, steps, device))
            feed.close()
        rate = {k: statistics.median(x["real_tokens_s"] for x in v) for k, v in runs.items()}
        out[name] = {
            "parameters_M": _r(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            "runs": runs,
            "real_tokens_s": {k: round(v) for k, v in rate.items()},
            "ladle_of_resident": _r(rate["ladle"] / rate["resident"]),
            "dataloader_of_resident": _r(rate["dataloader"] / rate["resident"]),
            "ladle_of_dataloader": _r(rate["ladle"] / rate["dataloader"]),
            "next_ms_per_step": {
                k: _r(statistics.median(x["next_ms_per_step"] for x in v)) for k, v in runs.items()
            },
        }
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(steps: int, repeats: int, cpu: bool) -> dict[str, Any]:
    import torch

    if not cpu and not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device (or --cpu for a check that it runs)")
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    config = CPU_CONFIG if cpu else ScheduleConfig()
    results: dict[str, Any] = {
        "device": "cpu" if cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "steps": steps,
    }
    tmp = Path(tempfile.mkdtemp(prefix="ladle-bench-gpu-"))
    server = None
    try:
        ds = tmp / "ds"
        vocab = CPU_VOCAB if cpu else VOCAB
        if cpu:
            make_dataset(ds, 2000, seed=3, scale=1 / 16, max_seq_len=512, vocab_size=vocab)
        else:
            make_dataset(ds, ROWS, seed=0, vocab_size=vocab)
        server = _Ladle(ds, tmp, "serve", CPU_FLAGS if cpu else ())
        latency_batches = 80 if cpu else 1000  # --cpu: an epoch of its dataset is about 100 batches
        results["next_latency"] = {
            "numpy": _latency(server.address, "latency-numpy", latency_batches),
            str(device.type): _latency(server.address, "latency-device", latency_batches, device=device),
        }
        results["conversion"] = _conversion(server.address, device, 40 if cpu else 200)
        results["training"] = bench_training(
            ds, server, steps, repeats, CPU_MODELS if cpu else MODELS, config, vocab, device
        )
        results["server_log_problems"] = server.log_problems()
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def summary(results: dict[str, Any]) -> list[str]:
    lat = results["next_latency"]
    lines = [f"bench_gpu on {results['device']} (torch {results['torch']}, {results['cpus']} CPUs)"]
    for name, r in lat.items():
        lines.append(f"next() with a full window, {name}: median {r['median_us']} us, p99 {r['p99_us']} us")
    for name, c in results["conversion"].items():
        lines.append(
            f"a batch on one thread, {name}: the reader's conversion median {c['convert_median_us']} us "
            f"(p99 {c['convert_p99_us']}), the trainer's _ready (stream wait, record_stream) "
            f"{c['ready_median_us']} us"
        )
    for name, t in results["training"].items():
        rate = t["real_tokens_s"]
        lines.append(
            f"{name} ({t['parameters_M']}M parameters): real tokens/s resident {rate['resident']:,}, "
            f"ladle {rate['ladle']:,} ({t['ladle_of_resident']}x), dataloader {rate['dataloader']:,} "
            f"({t['dataloader_of_resident']}x); next() a step: ladle {t['next_ms_per_step']['ladle']} ms, "
            f"dataloader {t['next_ms_per_step']['dataloader']} ms"
        )
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cpu", action="store_true")
    a = parser.parse_args()
    out = main(a.steps, a.repeats, a.cpu)
    print(json.dumps(out, indent=2))
    for line in summary(out):
        print(line, file=sys.stderr)
