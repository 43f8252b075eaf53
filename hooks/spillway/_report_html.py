"""spillway.report's HTML page (--html): self-contained, with SVG lanes of device and host memory
over time, the spills and reloads per storage, and the bytes saved for backward per place in the
code."""

import html

from ._report_series import MIB, devices, host_reserved_series, series

# The lanes' fill colours, used nowhere else on the page: its browser test finds each lane by its
# colour (tests/python/test_report_html.py).
DEVICE_FILL = "#4e79a7"
HOST_FILL = "#f28e2c"
RESERVED_STROKE = "#8c8c8c"
LANE_WIDTH = 900   # pixels of plot, one column each
LANE_HEIGHT = 150
LANE_LEFT = 80     # room for the MiB labels
# Where a trace entry's allocation was saved for backward: its category says so. A reload's
# allocation ("reloaded") holds the same bytes a second time and is not counted again.
SAVED_CATEGORIES = ("saved_for_backward", "spilled")


def column_peaks(t, values, t_end, columns):
    """The highest of `values` held within each of `columns` equal slices of [0, t_end], where
    values[i] holds from t[i] to t[i + 1] (the last one to t_end). A path point per event would
    make a page of megabytes from a long history and still hide what falls inside one pixel; the
    column's peak keeps every high-water mark visible (a value held for no time, such as an
    allocation freed within the same microsecond, included)."""
    span = t_end if t_end > 0 else 1.0
    peaks = [0] * columns
    for i, (start, value) in enumerate(zip(t, values)):
        end = t[i + 1] if i + 1 < len(t) else t_end
        first = min(columns - 1, int(start / span * columns))
        last = min(columns - 1, int(end / span * columns))
        for c in range(first, last + 1):
            if value > peaks[c]:
                peaks[c] = value
    return peaks


def _mib(n):
    return f"{n / MIB:.2f} MiB"


def _lane_svg(title, peaks, line, t_end, fill):
    """One lane: `peaks` (bytes per pixel column) as a filled step area, `line` (optional, the
    same shape) as a grey outline, the MiB scale on the left and seconds below."""
    top_value = max(max(peaks, default=0), max(line or [0]))
    scale = LANE_HEIGHT / top_value if top_value > 0 else 0.0
    base = LANE_HEIGHT + 10
    width = LANE_LEFT + LANE_WIDTH + 20

    def y(v):
        return base - v * scale

    area = [f"M{LANE_LEFT},{base}"]
    for c, v in enumerate(peaks):
        area.append(f"L{LANE_LEFT + c},{y(v):.1f}L{LANE_LEFT + c + 1},{y(v):.1f}")
    area.append(f"L{LANE_LEFT + len(peaks)},{base}Z")
    parts = [f'<svg class="lane" width="{width}" height="{base + 30}" '
             f'viewBox="0 0 {width} {base + 30}" role="img" aria-label="{html.escape(title)}">',
             f"<title>{html.escape(title)}</title>",
             # Crisp edges: the fill is one exact colour, which the browser test counts.
             f'<path d="{"".join(area)}" fill="{fill}" stroke="none" '
             'shape-rendering="crispEdges"/>']
    if line:
        outline = [f"M{LANE_LEFT},{y(line[0]):.1f}"]
        for c, v in enumerate(line):
            outline.append(f"L{LANE_LEFT + c},{y(v):.1f}L{LANE_LEFT + c + 1},{y(v):.1f}")
        parts.append(f'<path d="{"".join(outline)}" fill="none" stroke="{RESERVED_STROKE}" '
                     'stroke-width="1"/>')
    parts.append(f'<line x1="{LANE_LEFT}" y1="{base}" x2="{LANE_LEFT + LANE_WIDTH}" y2="{base}" '
                 'stroke="#333"/>')
    parts.append(f'<line x1="{LANE_LEFT}" y1="10" x2="{LANE_LEFT}" y2="{base}" stroke="#333"/>')
    parts.append(f'<text x="{LANE_LEFT - 6}" y="14" text-anchor="end">'
                 f"{html.escape(_mib(top_value))}</text>")
    parts.append(f'<text x="{LANE_LEFT - 6}" y="{base}" text-anchor="end">0</text>')
    for fraction in (0.0, 0.5, 1.0):
        x = LANE_LEFT + fraction * LANE_WIDTH
        anchor = {0.0: "start", 0.5: "middle", 1.0: "end"}[fraction]
        parts.append(f'<text x="{x:.0f}" y="{base + 18}" text-anchor="{anchor}">'
                     f"{fraction * t_end:.3f} s</text>")
    if top_value == 0:
        parts.append(f'<text x="{LANE_LEFT + LANE_WIDTH / 2:.0f}" y="{base / 2:.0f}" '
                     'text-anchor="middle">nothing held over the recorded history</text>')
    parts.append("</svg>")
    return "".join(parts)


def storage_rows(snapshot, device):
    """Per storage entry with offload events on `device`: a dict of its `entry`, the `bytes` it
    spilled (the largest of its events), counts of each event kind (`spill`, `reload`,
    `taken_back`, `prefetch_given_back`, `drop_spilled`, `failed`), `first_spill_s` and
    `last_reload_s` (seconds from the timeline's start, None if none; a take-back counts as a
    reload there) and its `residency` at the snapshot ("released" once the engine no longer holds
    it). Largest first. The engine names a storage by its address, which a later storage may take
    over: their events then share a row."""
    section = snapshot.get("spillway", {})
    live = {e["entry"]: e for e in section.get("entries", [])}
    t0 = series(snapshot, device)["t0_us"]
    rows = {}
    for e in section.get("events", []):
        if e.get("device", 0) != device or e["time_us"] < t0:
            continue  # another device's, or from before the recorded history (see series)
        row = rows.setdefault(e["entry"], {
            "entry": e["entry"], "bytes": 0, "spill": 0, "reload": 0, "taken_back": 0,
            "prefetch_given_back": 0, "drop_spilled": 0, "failed": 0, "first_spill_s": None,
            "last_reload_s": None})
        row["bytes"] = max(row["bytes"], e["bytes"])
        if e["action"] in row:
            row[e["action"]] += 1
        seconds = (e["time_us"] - t0) / 1e6
        if e["action"] == "spill" and row["first_spill_s"] is None:
            row["first_spill_s"] = seconds
        if e["action"] in ("reload", "taken_back"):
            row["last_reload_s"] = seconds
    for row in rows.values():
        entry = live.get(row["entry"])
        row["residency"] = entry["residency"] if entry else "released"
    return sorted(rows.values(), key=lambda r: (-r["bytes"], r["entry"]))


def _where(frame):
    return f"{frame.get('name', '?')} ({frame.get('filename', '?')})"


def saved_by_place(snapshot, device):
    """The snapshot names no modules, so the bytes saved for backward are grouped by the innermost
    Python frame of each saved allocation (its function and file: for a module's op, its forward,
    such as torch/nn/modules/linear.py's). A list of dicts `where`, `bytes`, `spilled_bytes`
    and `count`, most bytes first. Allocations recorded without frames (history with
    stacks="none", or made outside Python) come under one row of their own."""
    traces = snapshot["device_traces"]
    trace = traces[device] if device < len(traces) else []
    places = {}
    for e in trace:
        if e["action"] != "alloc" or e.get("category") not in SAVED_CATEGORIES:
            continue
        frames = e.get("frames") or []
        where = _where(frames[0]) if frames else "no Python frame recorded"
        place = places.setdefault(where, {"where": where, "bytes": 0, "spilled_bytes": 0,
                                          "count": 0})
        place["bytes"] += e["size"]
        place["count"] += 1
        if e["category"] == "spilled":
            place["spilled_bytes"] += e["size"]
    return sorted(places.values(), key=lambda p: (-p["bytes"], p["where"]))


_PAGE_STYLE = """
body { font-family: sans-serif; margin: 16px; color: #222; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px 0; }
h2 { font-size: 17px; margin: 22px 0 6px 0; }
h3 { font-size: 14px; margin: 10px 0 2px 0; font-weight: normal; }
p.note { font-size: 13px; color: #555; max-width: 980px; margin: 4px 0; }
svg.lane { display: block; }
svg.lane text { font-size: 11px; fill: #333; }
table { border-collapse: collapse; font-size: 12px; margin-top: 4px; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
th { background: #f0f0f0; }
td.left, th.left { text-align: left; }
span.key { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
"""

ROW_LIMIT = 200  # table rows shown; a note says how many more there were


def html_report(snapshot, name, device=None):
    """The self-contained page (no script, style sheet or font from anywhere else) for one
    snapshot: per device a lane of device memory allocated and a lane of bytes spilled to
    pinned host memory, on one time axis; the spills and reloads per storage; the bytes saved
    for backward per place in the code."""
    section = snapshot.get("spillway", {})
    stats = section.get("stats", {})
    shown = [device] if device is not None else devices(snapshot)
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>Spillway snapshot: {html.escape(name)}</title>",
           f"<style>{_PAGE_STYLE}</style></head><body>",
           f"<h1>Spillway snapshot: {html.escape(name)}</h1>"]
    if stats:
        out.append(f'<p class="note">Offload since the engine started: '
                   f'{stats.get("num_spills", 0)} spills, '
                   f'{stats.get("num_reloads", 0)} reloads, '
                   f'{html.escape(_mib(stats.get("bytes_to_host", 0)))} to host, '
                   f'{stats.get("num_prefetch_hits", 0)} prefetch hits, '
                   f'{stats.get("num_stalls", 0)} stalls.</p>')
    for d in shown:
        s = series(snapshot, d)
        t_end = s["t"][-1]
        allocated = column_peaks(s["t"], s["allocated"], t_end, LANE_WIDTH)
        reserved = column_peaks(s["t"], s["reserved"], t_end, LANE_WIDTH)
        spilled = column_peaks(s["t"], s["spilled"], t_end, LANE_WIDTH)
        out.append(f"<h2>Device {d}</h2>")
        out.append(f'<h3><span class="key" style="background:{DEVICE_FILL}"></span>device '
                   f"memory allocated (peak {html.escape(_mib(max(s['allocated'])))}; grey line: "
                   f"reserved, peak {html.escape(_mib(max(s['reserved'])))})</h3>")
        out.append(_lane_svg(f"device {d}: allocated bytes over time", allocated, reserved,
                             t_end, DEVICE_FILL))
        # A history that begins with the host's (no device event) starts the axis there.
        host = host_reserved_series(
            snapshot, s["t0_us"] or snapshot.get("host_traces", [{}])[0].get("time_us", 0))
        pinned = None
        pinned_note = ""
        if host is not None:
            pinned = column_peaks(host["t"], host["reserved"], t_end, LANE_WIDTH)
            pinned_note = ("; grey line: pinned host memory reserved, all devices' pools, peak "
                           f"{html.escape(_mib(max(host['reserved'])))}")
        out.append(f'<h3><span class="key" style="background:{HOST_FILL}"></span>host: bytes '
                   f"spilled to pinned host memory (peak {html.escape(_mib(max(s['spilled'])))}"
                   f"{pinned_note})</h3>")
        out.append(_lane_svg(f"device {d}: bytes spilled to host over time", spilled, pinned,
                             t_end, HOST_FILL))
        out.append('<p class="note">Allocated: the bytes live allocations requested, as the '
                   "memory viewer's timeline counts them; each pixel column shows the highest "
                   "level within it. Spilled: Spillway's own spill and reload events (the "
                   "snapshot's <code>spillway</code> section). Pinned host memory reserved: the "
                   "snapshot's <code>host_segments</code> and <code>host_traces</code>, there when "
                   "history was recorded with <code>record_pinned_host_memory=True</code>.</p>")

        rows = storage_rows(snapshot, d)
        out.append(f"<h3>Spills and reloads per storage ({len(rows)} storages)</h3>")
        out.append('<p class="note">A storage is named by its address (the offload engine\'s '
                   "key), which a later storage may take over: its events then share the row. "
                   "Only events within the recorded history are counted.</p>")
        storage_cells = []
        for r in rows[:ROW_LIMIT]:
            first = "" if r["first_spill_s"] is None else f"{r['first_spill_s']:.3f} s"
            last = "" if r["last_reload_s"] is None else f"{r['last_reload_s']:.3f} s"
            storage_cells.append([f"{r['entry']:#x}", _mib(r["bytes"]), r["spill"], r["reload"],
                                  r["taken_back"], r["prefetch_given_back"], r["drop_spilled"],
                                  r["failed"], first, last, r["residency"]])
        out.extend(_table(["storage entry", "bytes", "spills", "reloads", "taken back",
                           "prefetches given back", "dropped spilled", "failed", "first spill",
                           "last reload", "at the snapshot"], (0, 10), storage_cells, len(rows),
                          "storages",
                          "No spills or reloads on this device."))

        places = saved_by_place(snapshot, d)
        out.append("<h3>Bytes saved for backward, per place in the code</h3>")
        out.append('<p class="note">The snapshot names no modules: each allocation saved for '
                   "backward (trace category <code>saved_for_backward</code> or "
                   "<code>spilled</code>) is counted under the innermost Python frame of its "
                   "allocation, its function and file (a module's op is counted under the "
                   "forward that called it). Only allocations the recorded history saw are "
                   "counted.</p>")
        place_cells = [[p["where"], _mib(p["bytes"]), _mib(p["spilled_bytes"]), p["count"]]
                       for p in places[:ROW_LIMIT]]
        out.extend(_table(["innermost frame", "saved", "of which spilled", "allocations"], (0,),
                          place_cells, len(places), "places",
                          "No allocation saved for backward in the recorded history."))
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _table(headers, left, cells, total, noun, empty_note):
    """An HTML table of `cells` (escaped; the columns numbered in `left` left-aligned), a note of
    the `total` - len(cells) smaller `noun` not shown, or `empty_note` when `total` is 0."""
    if total == 0:
        return [f'<p class="note">{html.escape(empty_note)}</p>']

    def row(tag, values):
        return "<tr>" + "".join(
            f"<{tag}{' class=left' if i in left else ''}>{html.escape(str(v))}</{tag}>"
            for i, v in enumerate(values)) + "</tr>"

    out = ["<table>" + row("th", headers)] + [row("td", c) for c in cells] + ["</table>"]
    if total > len(cells):
        out.append(f'<p class="note">{total - len(cells)} smaller {noun} not shown.</p>')
    return out
