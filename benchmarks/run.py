"""Run every benchmark and print its figures beside their baselines.

``python -m benchmarks.run`` (quick: 1M lengths, serving a 0.4 GB dataset, 1.5 s per
cursor-store case, a 15 s connection soak, make-dataset from 32 MB of JSONL, ladle serve on 10^6 tiny
rows) or ``--full`` (10M lengths, the sizes the issues' targets name; serving 1 GB and a 4.1 GB dataset
for the server's memory; the wire-layout comparison; three 5 s rounds per store case; the soak with 200
idle connections and 50 connects a second for a minute; make-dataset from 1 GB of JSONL; ladle serve on
10^8 tiny rows, about 10 minutes more).
Results are JSON on stdout and a short table on stderr.
"""

from __future__ import annotations

import json
import sys

from benchmarks import (
    bench_assemble,
    bench_auth,
    bench_batchmates,
    bench_client_lifetime,
    bench_dataset,
    bench_http,
    bench_ingest,
    bench_ranks,
    bench_roundtrips,
    bench_rows,
    bench_sampler,
    bench_scale,
    bench_schedule,
    bench_serving,
    bench_shards,
    bench_soak,
    bench_store,
    bench_wire,
)


def main(argv: list[str]) -> int:
    full = "--full" in argv
    results = {
        "schedule": bench_schedule.main(full),
        "batchmates": bench_batchmates.main(quick=not full),
        "dataset": bench_dataset.bench_make_dataset(1_000_000 if full else 100_000),
        "ingest": bench_ingest.main(1024 if full else 32),
        "serving": bench_serving.main(full),
        "assemble": bench_assemble.main(50_000 if full else 20_000),
        "shards": bench_shards.main(6000, 512),
        "store": bench_store.main(full),
        "roundtrips": bench_roundtrips.main(full),
        "http": bench_http.main(full),
        "ranks": bench_ranks.main(full),
        "auth": bench_auth.main(full),
        "soak": bench_soak.main(full),
        "client_lifetime": bench_client_lifetime.main(full),
        "sampler": bench_sampler.main(50_000 if full else 20_000),
        "rows": bench_rows.run(10**8, boundary_rows=10**7) if full else bench_rows.run(10**6),
        "scale": bench_scale.main(["--full"] if full else []),
    }
    if full:  # the transport comparison behind the frame layout (about 7 minutes)
        results["wire"] = bench_wire.main([])
    print(json.dumps(results, indent=2))
    build = results["schedule"]["build"]
    print(
        f"\nbuild_schedule {build['rows']:,} lengths W={build['world_size']}: {build['build_schedule_s']}s; "
        f"np.sort {build['np_sort_s']}s ({build['lengths_dtype']}) -> {build['ratio_vs_np_sort']}x "
        f"({build['ratio_vs_np_sort_int64']}x vs int64 sort); peak RSS {build['peak_rss_mib']} MiB; "
        f"one schedule holds {build['schedule_held_mib']} MiB "
        f"({build['schedule_held_bytes_per_row']} bytes a row)",
        file=sys.stderr,
    )
    ds = results["dataset"]
    print(
        f"make_dataset {ds['rows']:,} rows ({ds['gb_on_disk']} GB): {ds['make_dataset_s']}s; "
        f"raw write of the same bytes {ds['raw_write_same_bytes_s']}s -> {ds['ratio_vs_raw_write']}x; "
        f"open_dataset {ds['open_dataset_s']}s",
        file=sys.stderr,
    )
    for case in results["schedule"]["quality"]["cases"]:
        print(
            f"{case['rank_mode']:5} W={case['world_size']}: run excess {case['max_run_excess']} "
            f"(runs {case['max_run']} bound {case['max_run_lower_bound']}; random {case['random_max_run']}), "
            f"share dev ranks {case['share_dev_ranks']} steps {case['share_dev_steps']}, "
            f"loss std {case['loss_std']} vs random {case['random_loss_std']}, "
            f"streak {case['above_mean_streak']} vs {case['random_above_mean_streak']}",
            file=sys.stderr,
        )
    shards = results["shards"]
    print(
        f"frame a batch: 1 shard {shards['one_shard_us']} us, {shards['shards']} shards "
        f"{shards['many_shards_us']} us (every file checked, as before: "
        f"{shards['many_shards_every_file_checked_us']} us)",
        file=sys.stderr,
    )
    for line in bench_serving.summary(results["serving"]):
        print(line, file=sys.stderr)
    for line in bench_store.summary(results["store"]):
        print(line, file=sys.stderr)
    for line in bench_roundtrips.summary(results["roundtrips"]):
        print(line, file=sys.stderr)
    for line in bench_http.summary(results["http"]):
        print(line, file=sys.stderr)
    for line in bench_ranks.summary(results["ranks"]):
        print(line, file=sys.stderr)
    for line in bench_auth.summary(results["auth"]):
        print(line, file=sys.stderr)
    for line in bench_soak.summary(results["soak"]):
        print(line, file=sys.stderr)
    for line in bench_client_lifetime.summary(results["client_lifetime"]):
        print(line, file=sys.stderr)
    for line in bench_batchmates.summary(results["batchmates"]):
        print(line, file=sys.stderr)
    for line in bench_ingest.summary(results["ingest"]):
        print(line, file=sys.stderr)
    for line in bench_sampler.summary(results["sampler"]):
        print(line, file=sys.stderr)
    for line in bench_rows.summary(results["rows"]):
        print(line, file=sys.stderr)
    for line in bench_scale.summary(results["scale"]):
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
