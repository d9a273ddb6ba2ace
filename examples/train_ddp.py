"""Train a small causal transformer on real text served by ladle, with DDP, and draw the ladder.

For each ``--interleave`` mode (``stride``: ladle's schedule; ``random``: the
naive bucket shuffle) it starts a ``ladle serve`` on loopback (or uses
``--server``), spawns ``--world-size`` processes joined by
``torch.distributed`` (gloo on the CPU; NCCL with ``--device cuda``, one GPU
a rank, each rank's batches copied to its GPU by ``BatchClient(device="cuda")``),
and each reads its rank's batches through ``BatchClient``, trains, and logs
the loss and bucket of every step. Then it
draws the loss of every mode against the step in one PNG and prints the
ladder's figures: the std of the windowed loss (minus its trend) and the
longest streak of windows above the mean, as ``ladle plan --simulate-loss``
defines them, each bucket's measured loss level and batch-to-batch noise, and
what those levels and noise give when replayed through many seeds' schedules
of both modes. See docs/training.md for what the command that drew
docs/ladder.png measured:

    python examples/train_ddp.py --out runs/ladder --steps 400 --plot docs/ladder.png

Without ``--dataset`` it tokenizes the Python standard library's own sources
(``--text``, split into functions, BPE trained here) into ``OUT/dataset``
once. ``--mix copyright`` adds a second source, the Debian copyright files
(``/usr/share/doc/*/copyright``, or ``--mix-docs``) cut into 256-token
pieces, tokenizes the code into paragraphs with one tokenizer for both, and
shuffles the rows once (see ``mix_dataset``; ``--cut code`` swaps the roles). Needs torch and matplotlib
(``pip install -e '.[examples]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import spawn
from torch.nn import functional

from ladle.client import BatchClient
from ladle.service.launch import ServeProcess
from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.schedule.stats import LossFigures, longest_runs, loss_figures

Interleave = Literal["stride", "random"]
MODES: tuple[Interleave, ...] = ("stride", "random")
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


# --- the model -----------------------------------------------------------------


class TinyLM(nn.Module):
    """A pre-norm causal transformer with learned positions and a tied output head."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight
        # small embeddings: with the tied head, unit-variance ones start at a loss far above log(vocab)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Rows are padded on the right, so the causal mask alone keeps real tokens off padding.
        length = ids.shape[1]
        x = self.embed(ids) + self.pos(torch.arange(length, device=ids.device))
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        x = self.blocks(x, mask=causal, is_causal=True)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def token_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over the trained positions of a batch, and their count."""
    ids = batch.input_ids.long()
    logits = model(ids[:, :-1])
    weight = (batch.loss_mask[:, 1:] * batch.attention_mask[:, 1:]).float()
    losses = functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    )
    return (losses * weight.reshape(-1)).sum(), weight.sum()


# --- one rank ------------------------------------------------------------------


@dataclass(frozen=True)
class RankJob:
    """What a spawned rank needs (picklable)."""

    world: int
    server: str
    job: str
    rendezvous: str
    log_dir: str
    steps: int
    vocab: int
    max_len: int
    d_model: int
    layers: int
    heads: int
    lr: float
    warmup: int
    decay: str
    seed: int
    report_every: int
    device: str = "cpu"


def lr_factor(step: int, spec: RankJob, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then (cosine ``decay``) down to 10% at step ``total``."""
    if step < spec.warmup:
        return (step + 1) / spec.warmup
    if spec.decay != "cosine" or total <= spec.warmup:
        return 1.0
    done = min(1.0, (step - spec.warmup) / max(1, total - 1 - spec.warmup))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * done))


def train_rank(rank: int, spec: RankJob) -> None:
    """One DDP process: read this rank's batches from ladle, train, log every step."""
    torch.set_num_threads(1)
    cuda = spec.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)  # one GPU a rank (parse_args checked there are enough)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=spec.rendezvous, rank=rank, world_size=spec.world)
    try:
        torch.manual_seed(spec.seed)  # every rank starts from the same weights (DDP also broadcasts them)
        model = nn.parallel.DistributedDataParallel(
            TinyLM(spec.vocab, spec.d_model, spec.layers, spec.heads, spec.max_len).to(device),
            device_ids=[rank] if cuda else None,
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
        log_path = Path(spec.log_dir, f"rank-{rank}.jsonl")
        began = time.perf_counter()
        with BatchClient(rank, spec.world, spec.server, spec.job, device=device, timeout=120) as client:
            # the decay's horizon: --steps, else the epoch's length (the server's count, the same on
            # every rank; asking joins nothing)
            total = min(spec.steps, len(client)) if spec.steps else len(client)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, spec, total))
            with log_path.open("w") as log:
                for batch in client:
                    loss_sum, count = token_loss(model, batch)
                    loss = loss_sum / count.clamp(min=1)  # this rank's mean token loss
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()  # type: ignore[no-untyped-call]
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    schedule.step()
                    # every rank's bucket and loss; the step's loss is their mean, as DDP averages
                    # the ranks' gradients (and as `ladle plan --simulate-loss` averages over ranks)
                    row = torch.zeros(spec.world, 2, device=device)  # NCCL reduces GPU tensors only
                    row[rank, 0], row[rank, 1] = batch.bucket, loss.detach()
                    dist.all_reduce(row)
                    step_loss = float(row[:, 1].mean())
                    record = {
                        "step": batch.step,
                        "epoch": batch.epoch,
                        "bucket": batch.bucket,
                        "loss": loss.item(),
                        "tokens": int(count.item()),
                        "step_loss": step_loss,
                        "step_buckets": [int(b) for b in row[:, 0].tolist()],
                        "rows": batch.rows,
                        "padded_len": batch.padded_len,
                        "samples": [int(i) for i in batch.sample_ids.tolist()],
                    }
                    log.write(json.dumps(record) + "\n")
                    done = batch.step + 1
                    if rank == 0 and (done % spec.report_every == 0 or done == spec.steps):
                        print(
                            f"  step {done:>4}  loss {step_loss:.3f}  buckets {record['step_buckets']}  "
                            f"{time.perf_counter() - began:.0f}s",
                            flush=True,
                        )
                    if done == spec.steps:
                        break
            state = client.state_dict()
        Path(spec.log_dir, f"rank-{rank}.state.json").write_text(json.dumps(state))
    finally:
        dist.destroy_process_group()


# --- the server and the runs ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def schedule_config(args: argparse.Namespace, mode: Interleave) -> ScheduleConfig:
    return ScheduleConfig(
        bucket_bounds=args.bucket_bounds,
        num_buckets=args.num_buckets,
        max_seq_len=args.max_seq_len,
        token_budget=args.token_budget,
        max_batch_size=args.max_batch_size,
        seed=args.seed,
        interleave=mode,
        rank_mode=args.rank_mode,
    )


def run_mode(args: argparse.Namespace, dataset: Path, vocab: int, mode: Interleave) -> Path:
    """Train with one interleave mode; returns the folder of its logs."""
    run_dir = Path(args.out, mode)
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank-*"):
        old.unlink()
    config = schedule_config(args, mode)
    (run_dir / "ladle.toml").write_text(config.to_toml())
    job = args.job or f"train-ddp-{mode}-{os.getpid()}"
    print(f"{mode}: {args.world_size} ranks, job {job!r}", flush=True)

    def train(server: str) -> None:
        spec = RankJob(
            world=args.world_size,
            server=server,
            job=job,
            rendezvous=f"tcp://127.0.0.1:{free_port()}",
            log_dir=str(run_dir),
            steps=args.steps,
            vocab=vocab,
            max_len=args.max_seq_len,
            d_model=args.d_model,
            layers=args.layers,
            heads=args.heads,
            lr=args.lr,
            warmup=args.warmup,
            decay=args.decay,
            seed=args.seed,
            report_every=args.report_every,
            device=args.device,
        )
        spawn(train_rank, args=(spec,), nprocs=args.world_size, join=True)  # type: ignore[no-untyped-call]

    if args.server:
        train(args.server)
    else:
        with ServeProcess(dataset, run_dir, config=run_dir / "ladle.toml") as server:
            train(server.address)
    return run_dir


# --- logs, figures and the plot --------------------------------------------------


@dataclass(frozen=True)
class RunLog:
    """One mode's steps: the loss (mean over ranks), each rank's bucket and its own loss."""

    mode: str
    loss: F64  # [steps]
    buckets: I64  # [steps, world]
    rank_loss: F64  # [steps, world]

    @property
    def num_buckets(self) -> int:
        return int(self.buckets.max()) + 1


def read_run(run_dir: Path, world: int) -> RunLog:
    ranks = [
        [json.loads(line) for line in (run_dir / f"rank-{r}.jsonl").read_text().splitlines()]
        for r in range(world)
    ]
    steps = min(len(records) for records in ranks)
    loss = np.array([ranks[0][s]["step_loss"] for s in range(steps)], dtype=np.float64)
    buckets = np.array([[ranks[r][s]["bucket"] for r in range(world)] for s in range(steps)], dtype=np.int64)
    rank_loss = np.array(
        [[ranks[r][s]["loss"] for r in range(world)] for s in range(steps)], dtype=np.float64
    )
    return RunLog(run_dir.name, loss, buckets.reshape(steps, world), rank_loss.reshape(steps, world))


def moving_average(values: F64, span: int) -> F64:
    """Centered mean over ``span`` steps (fewer at the ends; at most the run's length)."""
    kernel = np.ones(max(1, min(span, len(values))))
    sums = np.convolve(values, kernel, mode="same")
    counts = np.convolve(np.ones_like(values), kernel, mode="same")
    out: F64 = sums / counts
    return out


def detrended(loss: F64, trend: int) -> F64:
    """The loss minus its centered moving average over ``trend`` steps (much longer than a ladder).

    Training makes the loss fall, which alone would put every early window
    above the mean; what is left is what the order of the buckets (and noise) adds.
    """
    out: F64 = loss - moving_average(loss, trend)
    return out


def ladder_figures(loss: F64, *, skip: int, trend: int, window: int) -> LossFigures:
    """``loss_figures`` (as ``ladle plan --simulate-loss`` defines them) of the detrended loss."""
    return loss_figures(detrended(loss, trend)[skip:], window=window)


@dataclass(frozen=True)
class BucketLevel:
    """One bucket's batches after ``skip`` (every rank): their share, loss level and spread.

    ``level`` is the mean of a batch's loss minus the run's trend at its step
    (training lowers every bucket's loss; this is what is left of each bucket's
    own level); ``noise`` is the std of the same differences, i.e. how far one
    batch of the bucket lands from the next. A ladder needs levels that differ
    by more than the noise. ``loss`` is the plain mean of the batches' losses.
    """

    bucket: int
    share: float
    level: float
    noise: float
    loss: float


def bucket_levels(run: RunLog, skip: int, trend: int) -> list[BucketLevel]:
    """The ``BucketLevel`` of every bucket of a run."""
    above = (run.rank_loss - moving_average(run.loss, trend)[:, None])[skip:]
    buckets, losses = run.buckets[skip:], run.rank_loss[skip:]
    out = []
    for bucket in range(run.num_buckets):
        mine = buckets == bucket
        if not mine.any():
            out.append(BucketLevel(bucket, 0.0, float("nan"), float("nan"), float("nan")))
            continue
        out.append(
            BucketLevel(
                bucket,
                share=round(float(mine.mean()), 3),
                level=round(float(above[mine].mean()), 3),
                noise=round(float(above[mine].std()), 3),
                loss=round(float(losses[mine].mean()), 3),
            )
        )
    return out


def replay(
    runs: list[RunLog],
    lengths: npt.NDArray[np.integer],
    config: ScheduleConfig,
    *,
    seeds: int,
    skip: int,
    trend: int,
    window: int,
) -> dict[str, dict[str, float]]:
    """The figures the measured bucket levels and noise give, over ``seeds`` schedules of each mode.

    Every batch of a run, after ``skip``, leaves one value: its loss minus the
    trend at its step. Pooled per bucket over all runs, these are the buckets'
    measured levels and batch-to-batch noise, training's own drift removed.
    For each seed, both modes' schedules (that seed, everything else as
    ``config``) get, for every batch, a value drawn from its bucket's pool; the
    figures of the mean over ranks are then averaged over the seeds. This
    separates what the order of the buckets does from the luck of one run.
    """
    world = runs[0].buckets.shape[1]
    steps = min(len(run.loss) for run in runs)
    pools = [
        np.concatenate(
            [
                (run.rank_loss - moving_average(run.loss, trend)[:, None])[skip:][run.buckets[skip:] == b]
                for run in runs
            ]
        )
        for b in range(max(run.num_buckets for run in runs))
    ]
    out: dict[str, dict[str, float]] = {}
    for mode in MODES:
        stds, streaks = [], []
        for seed in range(seeds):
            cfg = config.replace(interleave=mode, seed=seed)
            grids: list[I64] = []
            epoch = 0
            while sum(len(g) for g in grids) < steps:
                grids.append(build_schedule(lengths, cfg, epoch=epoch, world_size=world).buckets)
                epoch += 1
            buckets = np.concatenate(grids)[:steps]
            rng = np.random.default_rng(seed)
            values = np.zeros(buckets.shape)
            for b, pool in enumerate(pools):
                mine = buckets == b
                if mine.any() and len(pool):
                    values[mine] = pool[rng.integers(len(pool), size=int(mine.sum()))]
            figures = loss_figures(values.mean(axis=1)[skip:], window=window)
            stds.append(figures.windowed_std)
            streaks.append(figures.longest_above_mean_streak)
        out[mode] = {
            "seeds": seeds,
            "windowed_std": round(float(np.mean(stds)), 4),
            "windowed_std_sd": round(float(np.std(stds)), 4),
            "longest_above_mean_streak": round(float(np.mean(streaks)), 2),
            "longest_above_mean_streak_sd": round(float(np.std(streaks)), 2),
        }
    return out


def plot(
    runs: list[RunLog],
    path: Path,
    *,
    skip: int,
    trend: int,
    window: int,
    bounds: tuple[int, ...] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"stride": "tab:blue", "random": "tab:orange"}
    fig, (top, middle, bottom) = plt.subplots(
        3, 1, figsize=(11, 8.5), sharex=True, height_ratios=(3, 2, 1.2), layout="constrained"
    )
    for run in runs:
        color = colors.get(run.mode)
        steps = np.arange(len(run.loss))
        figures = ladder_figures(run.loss, skip=skip, trend=trend, window=window)
        top.plot(steps, run.loss, color=color, alpha=0.25, linewidth=0.7)
        top.plot(steps, moving_average(run.loss, window), color=color, linewidth=1.6, label=run.mode)
        residual = detrended(run.loss, trend)[skip:]
        n = len(residual) // window
        centers = skip + window * np.arange(n) + (window - 1) / 2
        middle.plot(
            centers,
            residual[: n * window].reshape(n, window).mean(axis=1),
            color=color,
            linewidth=1.4,
            label=f"{run.mode}: std {figures.windowed_std:.3f}, longest streak above mean "
            f"{figures.longest_above_mean_streak} windows",
        )
    top.set_ylabel("loss (per token)")
    top.set_title(
        f"{runs[0].buckets.shape[1]} ranks; loss per step (thin) and its {window}-step moving average"
    )
    top.legend()
    lines = [f"each bucket's batches (steps {skip}+): loss minus trend, mean ± std"]
    for run in runs:
        cells = []
        for level in bucket_levels(run, skip, trend):
            name = (
                f"[{bounds[level.bucket]},{bounds[level.bucket + 1]})" if bounds else f"bucket {level.bucket}"
            )
            cells.append(f"{name} {level.share:.0%}: {level.level:+.2f} ± {level.noise:.2f}")
        lines.append(f"{run.mode}: " + ",  ".join(cells))
    top.text(
        0.01,
        0.03,
        "\n".join(lines),
        transform=top.transAxes,
        fontsize=8,
        va="bottom",
        bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "lightgrey"},
    )
    top.set_ylim(top=float(np.percentile(np.concatenate([r.loss for r in runs]), 99.5)))
    middle.axhline(0.0, color="grey", linewidth=0.8)
    middle.set_ylabel(f"loss minus {trend}-step trend,\nwindows of {window} steps")
    middle.legend(loc="upper right", fontsize=8)
    # the bucket of every rank's batch at every step, one row per (mode, rank)
    strips = np.concatenate([run.buckets.T for run in runs])
    bottom.imshow(
        strips,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        extent=(-0.5, len(strips[0]) - 0.5, len(strips), 0),
    )
    labels = [f"{run.mode} r{rank}" for run in runs for rank in range(run.buckets.shape[1])]
    bottom.set_yticks(np.arange(len(labels)) + 0.5, labels, fontsize=8)
    bottom.set_ylabel("bucket\n(dark: short)")
    bottom.set_xlabel("step")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the dataset -----------------------------------------------------------------


def text_dataset(args: argparse.Namespace) -> Path:
    """``OUT/dataset`` tokenized from ``--text`` (made once; refused if made with other options)."""
    from ladle.service.text import MANIFEST, make_text_dataset

    out = Path(args.out, "dataset")
    wanted = {
        "sources": [str(p) for p in args.text],
        "include": args.include,
        "exclude": args.exclude,
        "split": args.split,
    }
    if (out / MANIFEST).exists():
        manifest = json.loads((out / MANIFEST).read_text())
        made = {key: manifest[key] for key in wanted}
        if made != wanted or manifest["tokenizer"]["vocab_size"] > args.vocab_size:
            raise SystemExit(f"{out} was made from {made}; remove it to make it from {wanted}")
        print(f"dataset {out}: {manifest['rows']} rows, {manifest['tokens']:,} tokens (made before)")
        return out
    began = time.perf_counter()
    made_now = make_text_dataset(
        out,
        args.text,
        split=args.split,
        include=args.include,
        exclude=args.exclude,
        vocab_size=args.vocab_size,
    )
    print(
        f"dataset {out}: {made_now.dataset.num_rows} rows, {made_now.dataset.num_tokens:,} tokens from "
        f"{made_now.files} files in {time.perf_counter() - began:.0f}s"
    )
    return out


def copyright_files() -> list[str]:
    """The Debian copyright files on this machine (``/usr/share/doc/*/copyright``), sorted."""
    found: dict[str, str] = {}  # each file once: some /usr/share/doc/NAME are links to another package's
    for path in sorted(Path("/usr/share/doc").glob("*/copyright")):
        if path.is_file():
            found.setdefault(os.path.realpath(path), str(path))
    return sorted(found.values())


def mix_dataset(args: argparse.Namespace) -> Path:
    """``OUT/dataset``: ``--text`` split into paragraphs, plus ``--mix-docs`` cut into ``--piece``-token rows.

    Both sources share one BPE tokenizer trained on all their text. The
    documents (whole files) are tokenized and cut into consecutive pieces of
    ``--piece`` tokens (the last piece of a document keeps what is left).
    ``--cut code`` swaps the roles: the code files are cut into pieces and
    the documents split into paragraphs.
    Then the rows of both are shuffled once with ``--shuffle-seed`` (-1: keep
    file order), as a pretraining set is shuffled row-wise before training,
    and saved with ``datasets.Dataset.save_to_disk``.
    """
    from ladle.service.text import MANIFEST, TOKENIZER_FILE, BpeTokenizer, read_text, split_text

    out = Path(args.out, "dataset")
    docs = [str(p) for p in args.mix_docs] if args.mix_docs else copyright_files()
    wanted = {
        "sources": [str(p) for p in args.text],
        "include": args.include,
        "exclude": args.exclude,
        "split": "paragraphs",
        "mix": args.mix,
        "mix_docs": len(docs),
        "piece": args.piece,
        "cut": args.cut,
        "shuffle_seed": args.shuffle_seed,
    }
    if (out / MANIFEST).exists():
        manifest = json.loads((out / MANIFEST).read_text())
        made = {key: manifest.get(key) for key in wanted}
        if made != wanted or manifest["tokenizer"]["vocab_size"] > args.vocab_size:
            raise SystemExit(f"{out} was made from {made}; remove it to make it from {wanted}")
        print(f"dataset {out}: {manifest['rows']} rows, {manifest['tokens']:,} tokens (made before)")
        return out
    if not docs:
        raise SystemExit("--mix copyright: no /usr/share/doc/*/copyright files; name some with --mix-docs")
    import datasets

    from ladle.service.errors import TextSourceError
    from ladle.service.text import _files

    began = time.perf_counter()

    def read_all(paths: list[str]) -> list[str]:
        texts: list[str] = []
        for path in paths:
            try:
                texts.append(read_text(path))
            except TextSourceError:  # unreadable, binary or empty: skipped
                continue
        return texts

    code = read_all([path for path, _ in _files(args.text, args.include, args.exclude)])
    texts = read_all(docs)
    split, whole = (code, texts) if args.cut == "docs" else (texts, code)
    paragraphs = [p for text in split for p in split_text(text, "paragraphs")]
    tokenizer = BpeTokenizer.train(paragraphs + whole, args.vocab_size)
    rows = [ids for ids in tokenizer.encode_batch(paragraphs) if len(ids)]
    pieces = 0
    for ids in tokenizer.encode_batch(whole):
        for at in range(0, len(ids), args.piece):
            rows.append(ids[at : at + args.piece])
            pieces += 1
    # source 0: the code, 1: the documents
    code_source = 0 if args.cut == "docs" else 1
    source = np.array([code_source] * (len(rows) - pieces) + [1 - code_source] * pieces, dtype=np.int8)
    order = np.arange(len(rows))
    if args.shuffle_seed >= 0:
        order = np.random.default_rng(args.shuffle_seed).permutation(len(rows))
    rows = [rows[i] for i in order]
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
            "seq_len": datasets.Value("int32"),
            "source": datasets.Value("int8"),
        }
    )
    table = datasets.Dataset.from_dict(
        {
            "input_ids": [r.tolist() for r in rows],
            "loss_mask": [[1] * len(r) for r in rows],
            "seq_len": [len(r) for r in rows],
            "source": source[order].tolist(),
        },
        features=features,
    )
    table.save_to_disk(str(out))
    tokens = int(sum(len(r) for r in rows))
    manifest = {
        **wanted,
        "tokenizer": {"kind": "bpe", "vocab_size": tokenizer.vocab_size, "file": TOKENIZER_FILE},
        "rows": len(rows),
        "pieces": pieces,
        "tokens": tokens,
    }
    (out / TOKENIZER_FILE).write_text(tokenizer.to_json())
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(
        f"dataset {out}: {len(rows)} rows ({len(rows) - pieces} paragraphs of {len(split)} files, "
        f"{pieces} pieces of {len(whole)} files; --cut {args.cut}), {tokens:,} tokens in "
        f"{time.perf_counter() - began:.0f}s"
    )
    return out


def vocab_of(dataset: Path) -> int:
    from ladle.service.dataset import open_dataset
    from ladle.service.text import MANIFEST

    manifest = dataset / MANIFEST
    if manifest.exists():
        return int(json.loads(manifest.read_text())["tokenizer"]["vocab_size"])
    ids = open_dataset(dataset).table.column("input_ids")
    return int(ids.combine_chunks().flatten().to_numpy().max()) + 1


# --- the command -----------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    stdlib = sysconfig.get_paths()["stdlib"]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=Path("runs/train_ddp"), help="logs, dataset, server state")
    data = p.add_argument_group("data")
    data.add_argument("--dataset", type=Path, help="a saved dataset (default: tokenize --text into OUT)")
    data.add_argument("--text", nargs="+", default=[stdlib], help=f"files or folders (default {stdlib})")
    data.add_argument("--include", action="append", help="file names to read (default *.py)")
    data.add_argument("--exclude", action="append", help="names to skip (default site-packages)")
    data.add_argument("--split", default="functions", choices=["documents", "functions", "paragraphs"])
    data.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary")
    data.add_argument(
        "--mix", default="none", choices=["none", "copyright"], help="add documents cut into --piece rows"
    )
    data.add_argument("--mix-docs", nargs="+", help="the documents (default /usr/share/doc/*/copyright)")
    data.add_argument("--piece", type=int, default=256, help="tokens per piece of a --mix document")
    data.add_argument(
        "--cut",
        default="docs",
        choices=["docs", "code"],
        help="with --mix: which source is cut into --piece rows (the other is split into paragraphs)",
    )
    data.add_argument("--shuffle-seed", type=int, default=0, help="with --mix: shuffle rows (-1: file order)")
    run = p.add_argument_group("runs")
    run.add_argument("--interleave", nargs="+", choices=MODES, default=list(MODES))
    run.add_argument("--server", help="use this running server (its own schedule config) instead")
    run.add_argument("--job", help="job name (default: one per run)")
    run.add_argument("--world-size", type=int, default=2)
    run.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: NCCL, rank r on GPU r (needs --world-size GPUs)",
    )
    run.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: one epoch)")
    run.add_argument("--report-every", type=int, default=25)
    sched = p.add_argument_group("schedule")
    sched.add_argument("--bucket-bounds", default="0,16,96,257", help="edges, or auto")
    sched.add_argument("--num-buckets", type=int, default=3, help="with --bucket-bounds auto")
    sched.add_argument("--max-seq-len", type=int, default=256)
    sched.add_argument("--token-budget", type=int, default=4096)
    sched.add_argument("--max-batch-size", type=int, default=64)
    sched.add_argument("--rank-mode", default="mixed", choices=["mixed", "sync"])
    sched.add_argument("--seed", type=int, default=0, help="schedule and model initialisation")
    model = p.add_argument_group("model")
    model.add_argument("--d-model", type=int, default=128)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--lr", type=float, default=3e-3)
    model.add_argument("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up")
    model.add_argument(
        "--decay",
        default="cosine",
        choices=["cosine", "none"],
        help="after warm-up, to 10%% by --steps (or the epoch's end)",
    )
    figures = p.add_argument_group("figures")
    figures.add_argument("--plot", type=Path, help="draw the loss of every mode into this PNG")
    figures.add_argument("--window", type=int, default=8, help="steps per window (moving average)")
    figures.add_argument("--trend", type=int, default=64, help="steps of the trend removed before figures")
    figures.add_argument("--skip", type=int, default=50, help="first steps left out of the figures")
    figures.add_argument(
        "--replay-seeds", type=int, default=20, help="schedules to replay the levels over (0: none)"
    )
    args = p.parse_args(argv)
    args.include = args.include or ["*.py"]
    args.exclude = args.exclude or (["site-packages", "test"] if args.mix != "none" else ["site-packages"])
    if args.server and len(args.interleave) != 1:
        p.error("with --server, name the one --interleave mode that server was started with")
    if args.device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < args.world_size:
            # NCCL refuses two ranks on one GPU
            p.error(f"--device cuda runs one rank a GPU: --world-size {args.world_size}, {gpus} GPU(s) here")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.dataset or (mix_dataset(args) if args.mix != "none" else text_dataset(args))
    vocab = vocab_of(dataset)
    runs = []
    for mode in args.interleave:
        began = time.perf_counter()
        run_dir = run_mode(args, dataset, vocab, mode)
        runs.append(read_run(run_dir, args.world_size))
        print(f"{mode}: {len(runs[-1].loss)} steps in {time.perf_counter() - began:.0f}s", flush=True)
    summary: dict[str, Any] = {}
    shortest, needed = min(len(run.loss) for run in runs), args.skip + 2 * args.window
    if shortest < needed:
        print(
            f"note: {shortest} steps; the figures below need at least --skip + 2 x --window = {needed} "
            "(train longer, or lower --skip and --window)"
        )
    print(f"\nloss minus its {args.trend}-step trend, steps {args.skip}+, windows of {args.window} steps")
    header = [
        "mode  ",
        "std of windowed loss",
        "longest streak above mean",
        "last loss",
        "longest run/bucket",
    ]
    print("  ".join(header))
    for run in runs:
        figures = ladder_figures(run.loss, skip=args.skip, trend=args.trend, window=args.window)
        last = float(run.loss[-args.window :].mean())
        runs_per_bucket = np.max([longest_runs(col, run.num_buckets) for col in run.buckets.T], axis=0)
        summary[run.mode] = {
            **vars(figures),
            "steps": len(run.loss),
            "last_loss": round(last, 4),
            "longest_run_per_bucket": runs_per_bucket.tolist(),
            "buckets": [vars(level) for level in bucket_levels(run, args.skip, args.trend)],
        }
        cells = [
            run.mode.ljust(len(header[0])),
            f"{figures.windowed_std:.4f}".rjust(len(header[1])),
            str(figures.longest_above_mean_streak).rjust(len(header[2])),
            f"{last:.3f}".rjust(len(header[3])),
            " ".join(str(int(r)) for r in runs_per_bucket).rjust(len(header[4])),
        ]
        print("  ".join(cells))
    print(f"\neach bucket's batches, steps {args.skip}+ (level, noise: mean and std of loss minus trend)")
    print("mode    bucket  share  level   noise  loss")
    for run in runs:
        for level in bucket_levels(run, args.skip, args.trend):
            print(
                f"{run.mode:<7} {level.bucket:>6}  {level.share:5.3f}  {level.level:+.3f}  "
                f"{level.noise:.3f}  {level.loss:.3f}"
            )
    if args.replay_seeds and not args.server and len(runs) > 0:
        from ladle.service.dataset import open_dataset

        replayed = replay(
            runs,
            open_dataset(dataset).lengths,
            schedule_config(args, "stride"),
            seeds=args.replay_seeds,
            skip=args.skip,
            trend=args.trend,
            window=args.window,
        )
        print(f"\nthose levels and noise replayed through {args.replay_seeds} seeds' schedules (mean, sd)")
        for mode, fig in replayed.items():
            print(
                f"{mode:<7} std of windowed loss {fig['windowed_std']:.4f} "
                f"({fig['windowed_std_sd']:.4f}), longest streak above mean "
                f"{fig['longest_above_mean_streak']:.1f} ({fig['longest_above_mean_streak_sd']:.1f})"
            )
            if mode in summary:
                summary[mode]["replay"] = fig
    Path(args.out, "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot:
        config = schedule_config(args, "stride")
        bounds = None if args.server or config.bucket_bounds == "auto" else tuple(config.bucket_bounds)
        plot(runs, args.plot, skip=args.skip, trend=args.trend, window=args.window, bounds=bounds)
        print(f"drew {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
