"""``ladle make-dataset --from-jsonl`` beside the tokenizer's own ``encode_batch``, in the same run.

``python -m benchmarks.bench_ingest [--mb 64] [--workers 1,2] [--vocab 32000] [--json]``

The input is a JSONL of real text: the Python standard library's source
files cut into documents of at most ``DOC_CHARS`` characters, repeated until
it holds ``--mb`` megabytes. A byte-level BPE ``tokenizer.json`` (``--vocab``
tokens) is trained on a sample of it. Then, in the same run:

* the baseline: that tokenizer's ``encode_batch`` over the same texts, in one
  process on one thread (``RAYON_NUM_THREADS=1``, ``TOKENIZERS_PARALLELISM=false``),
  reading and parsing not timed; and with its own threads, for reference;
* ``ladle make-dataset OUT --from-jsonl FILE --tokenizer tokenizer.json --no-eos
  --workers N`` as a subprocess for each N, timed end to end (start-up, reading,
  parsing, writing the shards), with the peak RSS of its process tree (the
  sum over the process and its workers, sampled every ``SAMPLE_S`` seconds).

Targets (issue 31): tokens/s at ``--workers 1`` at least ``TARGET_RATIO`` times
the single-threaded baseline, rising with workers; peak RSS at most 1 GB plus
twice one output shard (512 MB) whatever the input size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

TARGET_RATIO = 0.7
RSS_LIMIT_MB = 1000 + 2 * 512
DOC_CHARS = 16_000
SAMPLE_S = 0.1
_SAMPLE_MB = 16


def make_jsonl(path: Path, mb: float) -> int:
    """Write ``mb`` megabytes of stdlib documents as JSONL; return the number of records."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for file in sorted(stdlib.rglob("*.py")):
        if "site-packages" in file.parts or "test" in file.parts:
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        docs += [
            text[i : i + DOC_CHARS] for i in range(0, len(text), DOC_CHARS) if text[i : i + DOC_CHARS].strip()
        ]
    lines = [json.dumps({"text": doc}) + "\n" for doc in docs]
    limit = int(mb * 1e6)
    written = records = 0
    with path.open("w", encoding="utf-8") as out:
        while written < limit:
            for line in lines:
                out.write(line)
                written += len(line)
                records += 1
                if written >= limit:
                    break
    return records


def train_tokenizer(jsonl: Path, path: Path, vocab: int) -> None:
    """A byte-level BPE trained on the first ``_SAMPLE_MB`` MB of the input."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts() -> Any:
        seen = 0
        with jsonl.open(encoding="utf-8") as lines:
            for line in lines:
                seen += len(line)
                yield json.loads(line)["text"]
                if seen > _SAMPLE_MB * 1e6:
                    return

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<pad>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer)
    tokenizer.save(str(path))


# The baseline runs in its own process so that the thread settings apply before tokenizers loads.
_BASELINE = textwrap.dedent(
    """
    import json, sys, time
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(sys.argv[1])
    took = 0.0
    tokens = 0
    def run(batch):
        global took, tokens
        began = time.perf_counter()
        encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
        took += time.perf_counter() - began
        tokens += sum(len(e.ids) for e in encodings)
    batch = []
    with open(sys.argv[2], encoding="utf-8") as lines:
        for line in lines:
            batch.append(json.loads(line)["text"])
            if len(batch) == 256:
                run(batch)
                batch = []
    if batch:
        run(batch)
    print(json.dumps({"tokens": tokens, "seconds": took}))
    """
)


def baseline(tokenizer: Path, jsonl: Path, threads: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if not threads:
        env |= {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    else:
        env.pop("RAYON_NUM_THREADS", None)
        env["TOKENIZERS_PARALLELISM"] = "true"
    done = subprocess.run(
        [sys.executable, "-c", _BASELINE, str(tokenizer), str(jsonl)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    result["tokens_per_s"] = round(result["tokens"] / result["seconds"])
    result["seconds"] = round(result["seconds"], 2)
    return result


def _tree_rss_mb(root: int) -> float:
    """The resident memory of ``root`` and all its descendants, in MB (from /proc)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    tree = {root}
    grew = True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        grew = bool(more)
        tree |= more
    return sum(rss.get(pid, 0) for pid in tree) / 1e6


def ladle_run(jsonl: Path, tokenizer: Path, out: Path, workers: int) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "ladle.service.cli", "make-dataset", str(out), "--from-jsonl", str(jsonl),
        "--tokenizer", str(tokenizer), "--no-eos", "--workers", str(workers), "--no-progress",
    ]  # fmt: skip
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0.0
    while process.poll() is None:
        peak = max(peak, _tree_rss_mb(process.pid))
        time.sleep(SAMPLE_S)
    seconds = time.perf_counter() - began
    _stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"make-dataset failed ({process.returncode}): {stderr.strip()}")
    manifest = json.loads((out / "text.json").read_text())
    shards = sorted(out.glob("data-*.arrow"))
    return {
        "workers": workers,
        "seconds": round(seconds, 2),
        "tokens": manifest["tokens"],
        "rows": manifest["rows"],
        "tokens_per_s": round(manifest["tokens"] / seconds),
        "peak_rss_mb": round(peak),
        "shards": len(shards),
        "largest_shard_mb": round(max(s.stat().st_size for s in shards) / 1e6),
    }


def main(
    mb: float = 64, workers: tuple[int, ...] = (1, 2), vocab: int = 32000, where: str | None = None
) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ladle-bench-ingest-", dir=where))
    try:
        jsonl = tmp / "input.jsonl"
        records = make_jsonl(jsonl, mb)
        tokenizer = tmp / "tokenizer.json"
        train_tokenizer(jsonl, tokenizer, vocab)
        one_thread = baseline(tokenizer, jsonl, threads=False)
        threaded = baseline(tokenizer, jsonl, threads=True)
        runs = []
        for count in workers:
            run = ladle_run(jsonl, tokenizer, tmp / f"out-{count}", count)
            if run["tokens"] != one_thread["tokens"]:
                raise RuntimeError(
                    f"ladle wrote {run['tokens']} tokens, encode_batch made {one_thread['tokens']}"
                )
            run["ratio_vs_encode_batch"] = round(run["tokens_per_s"] / one_thread["tokens_per_s"], 2)
            runs.append(run)
            shutil.rmtree(tmp / f"out-{count}")
        results: dict[str, Any] = {
            "input_mb": round(jsonl.stat().st_size / 1e6),
            "records": records,
            "vocab": vocab,
            "cores": os.cpu_count(),
            "encode_batch_one_thread": one_thread,
            "encode_batch_threaded": threaded,
            "ladle": runs,
            "target_ratio": TARGET_RATIO,
            "rss_limit_mb": RSS_LIMIT_MB,
        }
        results["missed"] = check(results)
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check(results: dict[str, Any]) -> list[str]:
    missed = []
    runs = results["ladle"]
    first = next((r for r in runs if r["workers"] == 1), None)
    if first is not None and first["ratio_vs_encode_batch"] < TARGET_RATIO:
        missed.append(f"workers 1: {first['ratio_vs_encode_batch']}x encode_batch < {TARGET_RATIO}")
    for run in runs:
        if run["peak_rss_mb"] > RSS_LIMIT_MB:
            missed.append(f"workers {run['workers']}: peak RSS {run['peak_rss_mb']} MB > {RSS_LIMIT_MB}")
    return missed


def summary(results: dict[str, Any]) -> list[str]:
    base = results["encode_batch_one_thread"]
    lines = [
        f"ingest {results['input_mb']} MB JSONL ({results['records']:,} records, vocab {results['vocab']}, "
        f"{results['cores']} cores): encode_batch one thread {base['tokens_per_s']:,} tokens/s, "
        f"own threads {results['encode_batch_threaded']['tokens_per_s']:,} tokens/s"
    ]
    for run in results["ladle"]:
        lines.append(
            f"  make-dataset --workers {run['workers']}: {run['tokens_per_s']:,} tokens/s "
            f"({run['ratio_vs_encode_batch']}x encode_batch, target >= {TARGET_RATIO} at 1), "
            f"{run['seconds']}s, "
            f"peak RSS {run['peak_rss_mb']} MB (limit {RSS_LIMIT_MB}), {run['shards']} shard(s)"
        )
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mb", type=float, default=64, help="input size (default 64; 1024 for the issue's 1 GB)"
    )
    parser.add_argument("--workers", default="1,2", help="worker counts to run (default 1,2)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--where", help="a folder for the temporary files (default: the system's)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    args = parser.parse_args()
    out = main(args.mb, tuple(int(w) for w in args.workers.split(",")), args.vocab, args.where)
    if args.json:
        print(json.dumps(out, indent=2))
    for line in summary(out):
        print(line, file=sys.stderr)
    print("targets: " + ("all met" if not out["missed"] else "; ".join(out["missed"])), file=sys.stderr)
    sys.exit(1 if out["missed"] else 0)
