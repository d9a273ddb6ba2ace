"""The page at ``/``: one job's schedule and progress for people, as HTML with inline SVG.

Rendered on the server from the same ``Inspector`` calls as the JSON API, so
the page and the API cannot disagree; a little plain JavaScript polls
``/v1/jobs/{job}/cursor`` every two seconds to move the ranks' progress, lag
and markers while the job runs, and reloads the page when the leading rank
leaves the window of steps it follows. No build step, no external asset: the
page works on a machine with no internet access. What it draws is bounded
however many ranks a job has: the ribbon draws (and outlines) at most
``RIBBON_RANKS`` ranks and the rank table lists ``TABLE_RANKS``, the ones to
look at first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from typing import Any, Final

from ..errors import LadleError
from ..jobs import Job
from ..report import BUCKET_HEADER, bucket_cells, ratio_cell
from ..schedule.stats import LossFigures, Quality, batch_mates_note
from ..standing import JobStanding, RankStanding, attention, standing
from ..store.base import JobState, Position
from .inspector import DEFAULT_PAGE_STEPS, PREVIEW_WORLD_SIZE, Inspector, page_steps

__all__ = ["PREVIEW_WORLD_SIZE", "RIBBON_RANKS", "TABLE_RANKS", "bucket_colour", "render", "render_error"]

PAGE_JOBS: Final = 50  # job links in the page's header
RIBBON_RANKS: Final = 8  # rank rows the ribbon draws in mixed mode (ranks 0..7)
TABLE_RANKS: Final = 64  # rows of the rank table; a bigger job lists the ranks to look at first

# viridis, short buckets dark to long buckets light: the order of lengths reads at a glance
_VIRIDIS: Final = ((68, 1, 84), (65, 68, 135), (42, 120, 142), (34, 168, 132), (122, 209, 81), (253, 231, 37))
_LABEL_W: Final = 70  # px left of the ribbon for row labels
_ROW_H: Final = 14
_ROW_GAP: Final = 2
_POLL_MS: Final = 2000


def bucket_colour(bucket: int, num_buckets: int) -> str:
    """The colour of ``bucket`` of ``num_buckets`` (a viridis ramp from the shortest to the longest)."""
    t = bucket / (num_buckets - 1) if num_buckets > 1 else 0.0
    pos = t * (len(_VIRIDIS) - 1)
    i = min(int(pos), len(_VIRIDIS) - 2)
    f = pos - i
    a, b = _VIRIDIS[i], _VIRIDIS[i + 1]
    r, g, bl = (round(x + (y - x) * f) for x, y in zip(a, b, strict=True))
    return f"#{r:02x}{g:02x}{bl:02x}"


def _cell_width(steps: int) -> int:
    return max(2, min(12, 1000 // max(steps, 1)))


def _ribbon(
    svg_id: str, page: dict[str, Any], rows: int, mixed: bool, markers: Sequence[Position] = ()
) -> str:
    """One ribbon: a cell per step (per rank of the ``rows`` first in mixed mode), coloured by bucket,
    and a marker at ``markers[r]`` for each of the first ranks (on its row in mixed mode)."""
    batches = page["batches"]
    steps = sorted({b["step"] for b in batches})
    cw = _cell_width(len(steps))
    width = _LABEL_W + cw * max(len(steps), 1)
    height = rows * (_ROW_H + _ROW_GAP)
    out = [
        f'<svg id="{svg_id}" class="ribbon" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" data-start="{page["start"]}" data-steps="{len(steps)}" '
        f'data-cell="{cw}" data-rows="{rows}" role="img" aria-label="buckets of steps">'
    ]
    for row in range(rows):
        y = row * (_ROW_H + _ROW_GAP)
        label = f"rank {row}" if mixed else "all ranks"
        out.append(f'<text x="{_LABEL_W - 6}" y="{y + _ROW_H - 3}" text-anchor="end">{label}</text>')
    first = page["start"]
    for b in batches:
        if not mixed and b["rank"] != 0:
            continue
        row = b["rank"] if mixed else 0
        x = _LABEL_W + (b["step"] - first) * cw
        y = row * (_ROW_H + _ROW_GAP)
        who = f"rank {b['rank']}" if mixed else "every rank"
        out.append(
            f'<rect class="cell b{b["bucket"]}" x="{x}" y="{y}" width="{cw}" height="{_ROW_H}">'
            f"<title>step {b['step']}, {who}: bucket {b['bucket']}, {b['rows']} rows x "
            f"{b['padded_len']}</title></rect>"
        )
    for rank, at in enumerate(markers):  # the page's script moves them (place)
        y = (rank if mixed else 0) * (_ROW_H + _ROW_GAP)
        i = at.step - first
        here = at.epoch == page["epoch"] and 0 <= i < len(steps)
        out.append(
            f'<rect class="marker" data-rank="{rank}" x="{_LABEL_W + i * cw if here else 0}" y="{y - 1}" '
            f'width="{max(cw, 3)}" height="{_ROW_H + 2}" visibility="{"visible" if here else "hidden"}"/>'
        )
    out.append("</svg>")
    return "".join(out)


def _table(table_id: str, header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _ints(values: list[int] | None) -> str:
    return " ".join(str(v) for v in values) if values is not None else "-"


def _quality_rows(q: Quality, r: Quality, lq: LossFigures, lr: LossFigures) -> list[list[str]]:
    return [
        ["padding efficiency", f"{q.padding_efficiency:.4f}", f"{r.padding_efficiency:.4f}"],
        ["longest run per bucket", _ints(q.max_run), _ints(r.max_run)],
        ["  its lower bound", _ints(q.max_run_lower_bound), _ints(r.max_run_lower_bound)],
        ["share deviation, ranks", f"{q.share_deviation_ranks:.2f}", f"{r.share_deviation_ranks:.2f}"],
        ["share deviation, steps", f"{q.share_deviation_steps:.2f}", f"{r.share_deviation_steps:.2f}"],
        [
            "distinct buckets/step min, mean",
            f"{q.distinct_per_step_min}, {q.distinct_per_step_mean:.2f}",
            f"{r.distinct_per_step_min}, {r.distinct_per_step_mean:.2f}",
        ],
        ["buckets run out within (steps)", str(q.finish_spread_steps), str(r.finish_spread_steps)],
        [
            "batch-mates: row-id span / random's",
            ratio_cell(q.batch_span_ratio),
            ratio_cell(r.batch_span_ratio),
        ],
        [
            "batch-mates: meeting again / chance",
            ratio_cell(q.batch_mates_again),
            ratio_cell(r.batch_mates_again),
        ],
        ["simulated loss: std of windowed loss", f"{lq.windowed_std:.4f}", f"{lr.windowed_std:.4f}"],
        [
            "simulated loss: longest streak above mean",
            str(lq.longest_above_mean_streak),
            str(lr.longest_above_mean_streak),
        ],
    ]


def _rank_rows(now: JobStanding | None) -> str:
    """The rank table's rows: every rank in order, or the ``TABLE_RANKS`` to look at first."""
    if now is None:
        return '<tr><td colspan="6">no trainers yet: this is a preview</td></tr>'
    listed = now.ranks if len(now.ranks) <= TABLE_RANKS else attention(now.ranks, TABLE_RANKS)
    return "".join(_rank_row(r) for r in listed)


def _rank_row(r: RankStanding) -> str:
    """One rank's row (the page's script writes the same in ``row``)."""
    pct = 100 * round(r.position.step / r.steps_in_epoch, 4) if r.steps_in_epoch else 100.0  # as /cursor
    return (
        f'<tr id="rank-{r.rank}"><td>{r.rank}</td>'
        f'<td class="pos">{r.position.epoch}:{r.position.step}</td>'
        f'<td><span class="bar"><span style="width:{pct:.1f}%"></span></span> '
        f'<span class="pct">{pct:.1f}%</span> of <span class="steps">{r.steps_in_epoch}</span></td>'
        f'<td class="lag">{r.lag_steps}</td><td class="seen">{_ago(r.seen_ago_s if r.joined else None)}</td>'
        f'<td class="gen">{r.generation}</td></tr>'
    )


def _rank_note(now: JobStanding | None) -> str:
    """Under a table that lists some of the ranks: how many it leaves out, and how far behind they are."""
    if now is None or len(now.ranks) <= TABLE_RANKS:
        return ""
    listed = {r.rank for r in attention(now.ranks, TABLE_RANKS)}
    rest = [r for r in now.ranks if r.rank not in listed]
    lag = max(r.lag_steps for r in rest)
    seen = max((r.seen_ago_s for r in rest if r.joined), default=0.0)
    return (
        f"the {TABLE_RANKS} of {len(now.ranks)} ranks to look at first (never seen, then not seen for "
        f"longest, then furthest behind); the other {len(rest)} are at most {lag} steps behind, "
        f"seen within {_ago(seen).removesuffix(' ago')}"
    )


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _pick(
    inspector: Inspector, job: str | None, world_size: int
) -> tuple[Job, JobState | None, list[JobState]]:
    """The job to show: the one asked for, else the served job updated last, else a preview."""
    states = inspector.job_states()
    if job is not None:
        state = inspector.state(job)
        return inspector.job(state), state, states
    served = [s for s in states if inspector.served(s)]
    if served:
        state = max(served, key=lambda s: (s.updated, s.job))
        return inspector.job(state), state, states
    return inspector.preview(world_size), None, states


def render(
    inspector: Inspector,
    *,
    job: str | None = None,
    epoch: int | None = None,
    start: int | None = None,
    world_size: int = PREVIEW_WORLD_SIZE,
) -> str:
    """The whole page (raises ``LadleError`` for an unknown job or one this server cannot show).

    Without ``epoch`` it shows the leading rank's epoch, and without ``start``
    the window of steps that holds the leading rank (step 0 in another epoch).
    Without either it follows the leader: its script reloads the page when
    the leader leaves the window.
    """
    shown, state, states = _pick(inspector, job, world_size)
    preview = state is None
    now = None if state is None else standing(shown, state)
    lead = now.leader if now is not None else Position(0, 0)
    follow = now is not None and epoch is None and start is None
    e = lead.epoch if epoch is None else epoch
    mixed = shown.config.rank_mode == "mixed"
    # the ranks whose batches the ribbon draws: the first ones in mixed mode, rank 0 for all in sync mode
    drawn = range(min(shown.world_size, RIBBON_RANKS)) if mixed else range(1)
    size = page_steps(len(drawn), DEFAULT_PAGE_STEPS)
    if start is None:
        start = lead.step - lead.step % size if e == lead.epoch else 0
    baseline = inspector.variant(shown, "random")
    ours = inspector.page(shown, e, start=start, limit=size, ranks=drawn)
    theirs = inspector.page(baseline, e, start=start, limit=size, ranks=drawn)
    buckets = inspector.buckets(shown, e)
    sched = inspector.schedule(shown, e)
    q, qr = inspector.quality(shown, e), inspector.quality(baseline, e, again=False)
    lq, lr = inspector.loss(shown, e), inspector.loss(baseline, e)
    ds = inspector.dataset
    k = sched.num_buckets
    num_steps = ours["num_steps"]
    on_page = len({b["step"] for b in ours["batches"]})
    title = "preview" if preview else shown.name

    css_buckets = "".join(f".b{b}{{fill:{bucket_colour(b, k)}}}" for b in range(k))
    legend = "".join(
        f'<span class="swatch"><svg width="12" height="12"><rect class="b{b}" width="12" height="12"/></svg> '
        f"{b}: [{sched.bounds[b]}, {sched.bounds[b + 1]})</span>"
        for b in range(k)
    )
    nav = []
    # the jobs updated last (a store of a cluster's runs can hold thousands; /v1/jobs pages them all)
    recent = sorted(states, key=lambda s: (s.updated, s.job), reverse=True)[:PAGE_JOBS]
    if not preview and state is not None and state not in recent:
        recent.append(state)
    for s in sorted(recent, key=lambda s: s.job):
        label = escape(s.job)
        if not inspector.served(s):
            nav.append(f'<span class="other" title="another dataset or config">{label}</span>')
        elif not preview and s.job == shown.name:
            nav.append(f'<a class="current" href="./?job={label}">{label}</a>')
        else:
            nav.append(f'<a href="./?job={label}">{label}</a>')
    jobs_nav = " ".join(nav) if nav else "none yet"
    if len(states) > len(recent):
        jobs_nav += f' <span class="other">and {len(states) - len(recent)} more (/v1/jobs)</span>'

    def link(**params: Any) -> str:
        base: dict[str, Any] = {"world_size": shown.world_size} if preview else {"job": shown.name}
        merged = {**base, **params}
        return "./?" + "&amp;".join(f"{key}={escape(str(v))}" for key, v in merged.items())

    pager = []
    if start > 0:
        # a full page back, from the epoch's end at most: a page past the end leads to the last one
        earlier = max(0, min(start, num_steps) - size)
        pager.append(f'<a id="prev" href="{link(epoch=e, start=earlier)}">&larr; earlier steps</a>')
    if ours["next_start"] is not None:
        pager.append(f'<a id="next" href="{link(epoch=e, start=ours["next_start"])}">later steps &rarr;</a>')
    if e > 0:
        pager.append(f'<a href="{link(epoch=e - 1)}">epoch {e - 1}</a>')
    pager.append(f'<a href="{link(epoch=e + 1)}">epoch {e + 1}</a>')
    if not preview and not follow:
        pager.append(f'<a id="follow" href="{link()}">follow the leader</a>')

    banner = ""
    if preview:
        # jobs of another dataset or config may be in the store: none is this server's to show
        others = f" ({len(states)} of another dataset or config in the store)" if states else ""
        banner = (
            f'<p class="banner" id="preview">No job on this server\'s dataset and config yet{others}. '
            f"This is the schedule a job of {shown.world_size} ranks would follow on this dataset "
            "(change it with <code>?world_size=N</code>). Start trainers with "
            '<code>BatchClient(rank, world_size, job="run-42")</code>; the page switches to their job '
            "when it appears.</p>"
        )
    last = on_page and ours["batches"][-1]["step"]
    heading = (
        f"Epoch {e}: steps {ours['start']}&ndash;{last} of {num_steps}"
        if on_page
        else f"Epoch {e}: no steps from {start} (the epoch has {num_steps})"
    )
    summary = [
        ("job", escape(title)),
        ("world size", str(shown.world_size)),
        ("rank mode", shown.config.rank_mode),
        ("epoch", f"{e}"),
        ("steps per epoch", f"{num_steps}"),
        ("padding efficiency", f"{q.padding_efficiency:.4f} (random {qr.padding_efficiency:.4f})"),
        ("longest run per bucket", f"{_ints(q.max_run)} (random {_ints(qr.max_run)})"),
        ("leader", f'<span id="leader">{"-" if now is None else f"{lead.epoch}:{lead.step}"}</span>'),
    ]  # fmt: skip
    state_doc = {
        "job": None if preview else shown.name,
        "epoch": e,
        "start": ours["start"],
        "steps": on_page,
        "mixed": mixed,
        "cell": _cell_width(on_page),
        "label": _LABEL_W,
        "world_size": shown.world_size,
        "poll_ms": _POLL_MS,
        "follow": follow,
        "table_ranks": TABLE_RANKS,
    }
    marked = now.ranks[:RIBBON_RANKS] if now is not None else ()  # the ranks with an outline
    if not mixed:
        rows_word = "every rank trains on the same bucket each step"
    elif len(drawn) < shown.world_size:
        rows_word = f"one row per rank, ranks 0&ndash;{len(drawn) - 1} of {shown.world_size}"
    else:
        rows_word = "one row per rank"
    outlined = min(shown.world_size, RIBBON_RANKS)
    marked_word = "each rank" if outlined == shown.world_size else f"each of ranks 0&ndash;{outlined - 1}"
    return _PAGE.format(
        title=escape(title),
        css_buckets=css_buckets,
        dataset=escape(ds.path),
        rows=f"{ds.num_rows:,}",
        fingerprint=escape(ds.fingerprint),
        jobs_nav=jobs_nav,
        banner=banner,
        summary="".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in summary),
        heading=heading,
        pager=" ".join(pager),
        legend=legend,
        interleave=escape(shown.config.interleave),
        rows_word=rows_word,
        marked_word=marked_word,
        ribbon=_ribbon("ribbon-ladle", ours, len(drawn), mixed, [r.position for r in marked]),
        ribbon_random=_ribbon("ribbon-random", theirs, len(drawn), mixed),
        rank_rows=_rank_rows(now),
        rank_note=escape(_rank_note(now)),
        bucket_table=_table("bucket-table", BUCKET_HEADER, [bucket_cells(r) for r in buckets]),
        quality_table=_table(
            "quality-table", ["figure", "ladle", "random shuffle"], _quality_rows(q, qr, lq, lr)
        ),
        batch_mates_note=escape(f"{batch_mates_note(q)} (the counts are ladle's)"),
        state=json.dumps(state_doc).replace("</", "<\\/"),
        script=_SCRIPT,
    )


def render_error(exc: LadleError) -> str:
    """A short page for a refusal: a job that cannot be shown (unknown, or on another dataset or
    config), a malformed parameter, a missing token."""
    message = str(exc)
    if exc.kind == "unauthenticated":
        # the API's words name the bearer header and BatchClient; a person in a browser needs these
        message = (
            f"{message.partition(':')[0]}: this server needs its token. Give it as the password when "
            "the browser asks (any user name), or open the page as http://ladle:TOKEN@HOST:PORT/."
        )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">'
        f'<title>ladle: error</title></head><body><h1>ladle</h1><p id="error">{escape(message)}</p>'
        '<p><a href="./">all jobs</a></p></body></html>'
    )


_SCRIPT: Final = """
(function () {
  "use strict";
  var state = JSON.parse(document.getElementById("ladle-state").textContent);
  var status = document.getElementById("status");
  var table = document.querySelector("#rank-table tbody");
  var note = document.getElementById("rank-note");
  var markers = {};
  document.querySelectorAll("#ribbon-ladle .marker").forEach(function (m) {
    markers[m.getAttribute("data-rank")] = m;
  });

  function ago(s) {
    if (s === null) return "never";
    if (s < 60) return s.toFixed(0) + " s ago";
    if (s < 3600) return (s / 60).toFixed(0) + " min ago";
    return (s / 3600).toFixed(1) + " h ago";
  }

  // standing.attention's order: never seen, then not seen for longest, then furthest behind, by decades
  function decade(x) { return x < 10 ? 0 : String(Math.floor(x)).length - 1; }
  function key(r) { return [r.seen_ago_s === null ? 99 : decade(r.seen_ago_s), decade(r.lag_steps)]; }
  function first(a, b) {
    var ka = key(a), kb = key(b);
    return kb[0] - ka[0] || kb[1] - ka[1] || a.rank - b.rank;
  }

  function row(r) {
    var pct = (100 * r.progress).toFixed(1);
    return '<tr id="rank-' + r.rank + '"><td>' + r.rank + '</td><td class="pos">' + r.epoch + ":" + r.step +
      '</td><td><span class="bar"><span style="width:' + pct + '%"></span></span> <span class="pct">' + pct +
      '%</span> of <span class="steps">' + r.steps_in_epoch + '</span></td><td class="lag">' + r.lag_steps +
      '</td><td class="seen">' + ago(r.seen_ago_s) + '</td><td class="gen">' + r.generation + "</td></tr>";
  }

  function update(tr, r) {
    var pct = (100 * r.progress).toFixed(1);
    tr.querySelector(".pos").textContent = r.epoch + ":" + r.step;
    tr.querySelector(".bar > span").style.width = pct + "%";
    tr.querySelector(".pct").textContent = pct + "%";
    tr.querySelector(".steps").textContent = String(r.steps_in_epoch);
    tr.querySelector(".lag").textContent = String(r.lag_steps);
    tr.querySelector(".seen").textContent = ago(r.seen_ago_s);
    tr.querySelector(".gen").textContent = String(r.generation);
  }

  function holds(p) {
    return p.epoch === state.epoch && p.step >= state.start && p.step < state.start + state.steps;
  }

  function place(marker, r) {
    var i = r.step - state.start;
    var here = r.epoch === state.epoch && i >= 0 && i < state.steps;
    marker.setAttribute("visibility", here ? "visible" : "hidden");
    if (here) marker.setAttribute("x", String(state.label + i * state.cell));
  }

  function show(c) {
    if (c.ranks.length !== state.world_size) { window.location.reload(); return; }
    if (state.follow && state.steps > 0 && !holds(c.leader)) {
      // the leader left the window: the page of the window that holds it (no start=, so it follows on)
      var here = window.location.origin + window.location.pathname;
      window.location.replace(new URL("?job=" + encodeURIComponent(state.job), here).href);
      return;
    }
    document.getElementById("leader").textContent = c.leader.epoch + ":" + c.leader.step;
    var listed = c.ranks;
    if (listed.length > state.table_ranks) {
      listed = c.ranks.slice().sort(first).slice(0, state.table_ranks);
      var rest = c.ranks.length - listed.length, shown = {}, lag = 0, seen = 0;
      listed.forEach(function (r) { shown[r.rank] = true; });
      c.ranks.forEach(function (r) {
        if (shown[r.rank]) return;
        lag = Math.max(lag, r.lag_steps);
        seen = Math.max(seen, r.seen_ago_s);
      });
      note.textContent = "the " + state.table_ranks + " of " + c.ranks.length + " ranks to look at first " +
        "(never seen, then not seen for longest, then furthest behind); the other " + rest + " are at most " +
        lag + " steps behind, seen within " + ago(seen).replace(" ago", "");
    }
    var rows = table.rows;
    var same = rows.length === listed.length && listed.every(function (r, i) {
      return rows[i].id === "rank-" + r.rank;
    });
    if (same) listed.forEach(function (r, i) { update(rows[i], r); });  // in place: a selection stays
    else table.innerHTML = listed.map(row).join("");
    c.ranks.forEach(function (r) {
      var marker = markers[r.rank];
      if (marker) place(marker, r);
    });
    status.textContent = "updated " + new Date(c.now * 1000).toLocaleTimeString();
  }

  function poll() {
    if (document.hidden) { window.setTimeout(poll, state.poll_ms); return; }
    // relative to the page (it may be served under a path prefix: an ingress, kubectl proxy), and
    // from origin + path: a page opened as http://user:TOKEN@host/ must not fetch a URL with credentials
    var path = state.job === null ? "v1/jobs" : "v1/jobs/" + encodeURIComponent(state.job) + "/cursor";
    var here = window.location.origin + window.location.pathname;
    fetch(new URL(path, here).href, {cache: "no-store"}).then(function (response) {
      if (!response.ok) throw new Error("HTTP " + response.status);
      return response.json();
    }).then(function (doc) {
      if (state.job === null) {
        if (doc.jobs.some(function (j) { return j.served; })) { window.location.reload(); return; }
        status.textContent = "waiting for a job";
      } else {
        var began = performance.now();
        show(doc);
        window.ladleUpdateMs = performance.now() - began;
      }
    }).catch(function (err) {
      status.textContent = "not updating: " + err.message;
    }).then(function () {
      window.setTimeout(poll, state.poll_ms);
    });
  }

  window.setTimeout(poll, state.job === null ? state.poll_ms : 0);
})();
"""

_PAGE: Final = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>ladle: {title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.4em; margin: 0 0 .2em; }} h2 {{ font-size: 1.1em; margin: 1.4em 0 .4em; }}
.muted, .other {{ color: #888; }} code {{ background: #f3f3f3; padding: 0 .2em; }}
nav a {{ margin-right: .6em; }} a.current {{ font-weight: bold; }}
.banner {{ background: #fff8d8; border: 1px solid #e8d890; padding: .6em .8em; }}
dl {{ display: grid; grid-template-columns: max-content auto; gap: .1em 1em; margin: .6em 0; }}
dt {{ color: #666; }} dd {{ margin: 0; font-variant-numeric: tabular-nums; }}
figure {{ margin: .6em 0; }} figcaption {{ color: #444; margin-bottom: .2em; }}
.scroll {{ overflow-x: auto; }}
svg.ribbon text {{ font-size: 11px; fill: #555; }}
svg.ribbon .marker {{ fill: none; stroke: #d62728; stroke-width: 2; }}
{css_buckets}
.swatch {{ margin-right: 1em; white-space: nowrap; }}
table {{ border-collapse: collapse; font-variant-numeric: tabular-nums; }}
th, td {{ padding: .2em .7em; border-bottom: 1px solid #eee; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
#quality-table td:first-child {{ white-space: pre; }}
.bar {{ display: inline-block; width: 120px; height: 10px; background: #eee; vertical-align: middle; }}
.bar > span {{ display: block; height: 100%; background: #2a788e; }}
footer {{ margin-top: 2em; color: #888; }}
</style>
</head>
<body>
<header>
<h1>ladle</h1>
<div class="muted">dataset {dataset}: {rows} rows, fingerprint {fingerprint}</div>
<nav id="jobs">jobs: {jobs_nav}</nav>
</header>
{banner}
<section id="summary"><dl>{summary}</dl></section>
<section id="schedule">
<h2>{heading}</h2>
<nav class="pager">{pager}</nav>
<div class="legend">buckets (token lengths): {legend}</div>
<figure><figcaption>ladle ({interleave} interleaving, {rows_word}): each cell is a batch, coloured by
its bucket; a red outline marks where {marked_word} is</figcaption><div class="scroll">{ribbon}</div></figure>
<figure><figcaption>a random shuffle of the same config, for comparison</figcaption>
<div class="scroll">{ribbon_random}</div></figure>
</section>
<section id="ranks">
<h2>Ranks</h2>
<table id="rank-table"><thead><tr><th>rank</th><th>epoch:step</th><th>progress</th><th>lag (steps)</th>
<th>last seen</th><th>generation</th></tr></thead><tbody>{rank_rows}</tbody></table>
<p class="muted" id="rank-note">{rank_note}</p>
<p class="muted" id="status"></p>
</section>
<section id="buckets"><h2>Buckets</h2>{bucket_table}</section>
<section id="quality"><h2>Quality</h2>{quality_table}
<p class="muted" id="batch-mates-note">{batch_mates_note}</p></section>
<footer>API: <a href="openapi.json">/openapi.json</a>, <a href="v1/jobs">/v1/jobs</a>,
<a href="metrics">/metrics</a></footer>
<script id="ladle-state" type="application/json">{state}</script>
<script>{script}</script>
</body>
</html>
"""
