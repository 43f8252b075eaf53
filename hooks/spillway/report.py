"""Reads Spillway snapshots (spillway.dump_snapshot) and reports what holds memory.

    python -m spillway.report SNAPSHOT [SNAPSHOT2] [-o OUT.png] [--device N]
    python -m spillway.report --html OUT.html SNAPSHOT [--device N]

Prints the largest blocks with their keepers, the storages kept alive only by tensors saved for
backward whose views reach less than the whole storage (views you hold yourself are not seen:
such a storage has other holders and is not listed), and the storages released while other
tensors still held them; writes a PNG timeline of device memory (allocated, reserved, spilled to
host) over the recorded history. Given two snapshots (say, without and with offload) it plots both
on one figure; a snapshot with several devices gets one panel per device (--device N: only N).
With --html it writes a page instead of the PNG: device and host lanes over time, spills and
reloads per storage, and the bytes saved for backward per place in the code.
"""

import argparse
import html
import os
import pickle
import sys

MIB = float(1 << 20)


class RefusedGlobalError(pickle.UnpicklingError):
    """A snapshot file named a global (a class or function), which load() never imports."""


class _PlainUnpickler(pickle.Unpickler):
    """Reads only what pickle writes with opcodes of its own: dict, list, tuple, str, bytes, int,
    float, bool and None (and sets), what memory snapshots are made of. A class or function comes
    in only as a global, and loading one runs code of the file's choosing (os.system through
    __reduce__): snapshots are shared in bug reports, so every global is refused. Nothing
    legitimate needs one: spillway.dump_snapshot writes plain types only, as do PyTorch's writers
    (torch.cuda.memory._dump_snapshot pickles the dict of _cuda_memorySnapshot, and the C++
    _memory_snapshot_pickled uses untyped lists and dicts, which its pickler writes without type
    tags), and pytorch.org/memory_viz's own unpickler has no opcode for a global at all. (Below
    protocol 3 bytes are written through the global _codecs.encode, refused too: no snapshot
    writer puts bytes in a pickle of those protocols.)"""

    def find_class(self, module, name):
        raise RefusedGlobalError(
            f"refused to load the global {module}.{name}: a memory snapshot holds only plain types "
            "(dict, list, tuple, str, bytes, int, float, bool, None), so this file is no snapshot "
            "and loading it could run code")


def load(path):
    """The snapshot pickled in `path`. Refuses (RefusedGlobalError) a file that names any class
    or function, rather than import and call it as pickle.load would."""
    with open(path, "rb") as f:
        return _PlainUnpickler(f).load()


def devices(snapshot):
    """The devices the snapshot has anything for (history, segments or offload events), in
    order; [0] when it has nothing at all."""
    found = {i for i, trace in enumerate(snapshot["device_traces"]) if trace}
    found.update(s["device"] for s in snapshot["segments"])
    found.update(e.get("device", 0) for e in snapshot.get("spillway", {}).get("events", []))
    return sorted(found) or [0]


def devices_of(snapshots):
    """The devices any of the snapshots has anything for, in order (see devices)."""
    return sorted({d for snap in snapshots for d in devices(snap)})


def series(snapshot, device=0):
    """Timelines from the snapshot's history: a dict of lists `t` (seconds from the first event),
    `allocated` (bytes requested by live allocations, as the history and memory_viz count them),
    `reserved` and `spilled` (bytes after each event), and `t0_us`, the first event's time. The
    starting levels are derived from the end state, so the curves end where the snapshot's
    segments are."""
    traces = snapshot["device_traces"]
    trace = traces[device] if device < len(traces) else []
    section = snapshot.get("spillway", {})
    offload_events = [e for e in section.get("events", []) if e.get("device", 0) == device]
    if trace:
        # The engine keeps its last 65536 events whether history is recorded or not: those from
        # before the history began would stretch the timeline back over a span it knows nothing
        # else of (the allocated curve flat there). The spilled level they left is the start's.
        offload_events = [e for e in offload_events if e["time_us"] >= trace[0]["time_us"]]
    segments = [s for s in snapshot["segments"] if s["device"] == device]
    # The history's allocation events carry the requested sizes, as PyTorch's do (block sizes in
    # snapshots Spillway wrote before it said so).
    size_key = "requested_size" if section.get("trace_sizes") == "requested" else "size"
    end_allocated = sum(b.get(size_key, b["size"]) for s in segments for b in s["blocks"]
                        if b["state"] == "active_allocated")
    end_reserved = sum(s["total_size"] for s in segments)
    d_alloc = {"alloc": 1, "free_requested": -1}
    d_reserved = {"segment_alloc": 1, "segment_free": -1}
    start_allocated = end_allocated - sum(d_alloc.get(e["action"], 0) * e["size"] for e in trace)
    start_reserved = end_reserved - sum(d_reserved.get(e["action"], 0) * e["size"] for e in trace)
    # "failed" is noted only for a spill whose copy failed: its bytes never reached the host.
    d_spill = {"spill": 1, "reload": -1, "drop_spilled": -1, "prefetch_given_back": 1,
               "failed": -1}
    by_device = section.get("spilled_bytes_by_device")
    if by_device:
        end_spilled = by_device[device] if device < len(by_device) else 0
    else:  # a snapshot from before the per-device count: the engine's total
        end_spilled = section.get("stats", {}).get("spilled_bytes.current", 0)
    start_spilled = end_spilled - sum(d_spill.get(e["action"], 0) * e["bytes"]
                                      for e in offload_events)
    merged = [(e["time_us"], 0, e) for e in trace] + [(e["time_us"], 1, e) for e in offload_events]
    merged.sort(key=lambda item: (item[0], item[1]))
    t0 = merged[0][0] if merged else 0
    out = {"t": [0.0], "allocated": [start_allocated], "reserved": [start_reserved],
           "spilled": [start_spilled], "t0_us": t0}
    allocated, reserved, spilled = start_allocated, start_reserved, start_spilled
    for time_us, kind, e in merged:
        if kind == 0:
            allocated += d_alloc.get(e["action"], 0) * e["size"]
            reserved += d_reserved.get(e["action"], 0) * e["size"]
        else:
            spilled += d_spill.get(e["action"], 0) * e["bytes"]
        out["t"].append((time_us - t0) / 1e6)
        out["allocated"].append(allocated)
        out["reserved"].append(reserved)
        out["spilled"].append(spilled)
    return out


def _keepers_text(keepers, external):
    parts = [f"saved {tuple(k['shape'])} stride {tuple(k['stride'])} offset {k['offset']}"
             + (" (a nested tensor's buffer)" if k.get("nested") else "")
             + (" (lost: its backward raises)" if k.get("lost") else "")
             for k in keepers]
    if external:
        parts.append(f"{external} other holder(s)")
    return "; ".join(parts) or "no holders known"


def _span_bytes(keeper, element_size):
    """Bytes from the storage's start to the end of the view's last element."""
    if any(s == 0 for s in keeper["shape"]):
        return 0
    last = keeper["offset"] + sum((s - 1) * st for s, st in zip(keeper["shape"], keeper["stride"]))
    return (last + 1) * element_size


def _element_bytes(keeper, element_size):
    """Bytes of the view's distinct elements (what a reader of the view can use): a dimension of
    stride 0 (a broadcast) repeats the same elements."""
    count = 1
    for s, st in zip(keeper["shape"], keeper["stride"]):
        count *= s if st != 0 else min(s, 1)
    return count * element_size


def summary(snapshot, top=10):
    lines = []
    section = snapshot.get("spillway", {})
    annotated = section.get("blocks", {})
    blocks = [(b, s) for s in snapshot["segments"] for b in s["blocks"]
              if b["state"] != "inactive"]
    blocks.sort(key=lambda item: -item[0]["size"])
    lines.append(f"Largest blocks ({min(top, len(blocks))} of {len(blocks)} active):")
    for b, s in blocks[:top]:
        # Snapshots of older PyTorch releases name no block addresses: no annotation then.
        note = annotated.get(b.get("address"))
        who = _keepers_text(note["keepers"], note["external_holders"]) if note else \
            "not saved for backward"
        where = ""
        if b.get("frames"):
            f = b["frames"][0]
            where = f"  at {f['filename']}:{f['line']} ({f['name']})"
        lines.append(f"  {b['size'] / MIB:9.2f} MiB  {b['state']:<20} {who}{where}")

    lines.append("")
    lines.append("Storages held alive only by views saved for backward (the rest of the storage is "
                 "pinned by them):")
    found = False
    for e in section.get("entries", []):
        if e["external_holders"] or not e["keepers"]:
            continue
        element = e.get("element_size", 1)
        span = max(_span_bytes(k, element) for k in e["keepers"])
        # Extent is not use: a (512, 100) slice of 512 x 512 reaches nearly the end of the
        # storage but reads a fifth of it. (Views that overlap count twice: at most the storage.)
        used = min(e["nbytes"], sum(_element_bytes(k, element) for k in e["keepers"]))
        if used < e["nbytes"]:
            found = True
            lines.append(f"  entry {e['entry']:#x}: {e['nbytes'] / MIB:.2f} MiB kept by views "
                         f"using {used / MIB:.2f} MiB of it, reaching {span / MIB:.2f} MiB "
                         f"({e['residency']}): {_keepers_text(e['keepers'], 0)}")
    if not found:
        lines.append("  none")

    lines.append("")
    lines.append("Storages released while other tensors still held them:")
    releases = [r for r in section.get("releases", []) if r["other_holders"] > 0]
    for r in releases:
        line = f"  {r['freed_bytes'] / MIB:.2f} MiB freed; {r['other_holders']} other holder(s)"
        saved = [k for k in r["keepers"] if k["kind"] == "saved"]
        if saved:
            line += f"; {_keepers_text(saved, 0)}"
        lines.append(line)
    if not releases:
        lines.append("  none")

    stats = section.get("stats", {})
    if stats:
        lines.append("")
        lines.append(f"Offload: {stats.get('num_spills', 0)} spills, "
                     f"{stats.get('num_reloads', 0)} reloads, "
                     f"{stats.get('bytes_to_host', 0) / MIB:.1f} MiB to host, "
                     f"{stats.get('num_prefetch_hits', 0)} prefetch hits, "
                     f"{stats.get('num_stalls', 0)} stalls")
    return "\n".join(lines)


def host_reserved_series(snapshot, t0_us):
    """Pinned host memory reserved over time, from torch 2.14's host_segments and host_traces
    (spillway.record_history(..., record_pinned_host_memory=True) records the offload engine's
    pinned pools there): lists `t` (seconds from `t0_us`; an event before it at 0) and `reserved`
    (bytes after each chunk taken or given back, the start derived from the end state). None when
    the snapshot recorded no host history. The pools of all devices together: host segments name
    no device."""
    trace = snapshot.get("host_traces") or []
    if not trace:
        return None
    d_reserved = {"segment_alloc": 1, "segment_free": -1}
    reserved = sum(s["total_size"] for s in snapshot.get("host_segments", []))
    reserved -= sum(d_reserved.get(e["action"], 0) * e["size"] for e in trace)
    out = {"t": [0.0], "reserved": [reserved]}
    for e in trace:
        reserved += d_reserved.get(e["action"], 0) * e["size"]
        out["t"].append(max(0.0, (e["time_us"] - t0_us) / 1e6))
        out["reserved"].append(reserved)
    return out


def legend_labels(paths):
    """The plot's name for each snapshot: none for one; for two their file names, or their whole
    paths where the file names are the same (run1/snap.pickle and run2/snap.pickle)."""
    if len(paths) < 2:
        return [""]
    labels = [os.path.basename(str(p)) for p in paths]
    return labels if len(set(labels)) == len(labels) else [str(p) for p in paths]


def plot(snapshots, labels, path, device=None):
    """Writes the timeline to `path`: one panel per device any snapshot has data for, or only
    `device`'s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [device] if device is not None else devices_of(snapshots)
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 4.8 * len(shown)), squeeze=False)
    styles = ["-", "--"]
    for d, ax in zip(shown, axes[:, 0]):
        for snap, label, style in zip(snapshots, labels, styles):
            s = series(snap, d)
            prefix = f"{label}: " if len(snapshots) > 1 else ""
            ax.step(s["t"], [v / MIB for v in s["allocated"]], where="post", linestyle=style,
                    color="tab:blue", label=f"{prefix}allocated")
            ax.step(s["t"], [v / MIB for v in s["reserved"]], where="post", linestyle=style,
                    color="tab:gray", label=f"{prefix}reserved")
            ax.step(s["t"], [v / MIB for v in s["spilled"]], where="post", linestyle=style,
                    color="tab:orange", label=f"{prefix}spilled to host")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("MiB")
        ax.set_title(f"Device {d} memory over the recorded history")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    `prefetch_given_back`, `drop_spilled`, `failed`), `first_spill_s` and `last_reload_s`
    (seconds from the timeline's start, None if none) and its `residency` at the snapshot
    ("released" once the engine no longer holds it). Largest first. The engine names a storage
    by its address, which a later storage may take over: their events then share a row."""
    section = snapshot.get("spillway", {})
    live = {e["entry"]: e for e in section.get("entries", [])}
    t0 = series(snapshot, device)["t0_us"]
    rows = {}
    for e in section.get("events", []):
        if e.get("device", 0) != device or e["time_us"] < t0:
            continue  # another device's, or from before the recorded history (see series)
        row = rows.setdefault(e["entry"], {
            "entry": e["entry"], "bytes": 0, "spill": 0, "reload": 0, "prefetch_given_back": 0,
            "drop_spilled": 0, "failed": 0, "first_spill_s": None, "last_reload_s": None})
        row["bytes"] = max(row["bytes"], e["bytes"])
        if e["action"] in row:
            row[e["action"]] += 1
        seconds = (e["time_us"] - t0) / 1e6
        if e["action"] == "spill" and row["first_spill_s"] is None:
            row["first_spill_s"] = seconds
        if e["action"] == "reload":
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
                                  r["prefetch_given_back"], r["drop_spilled"], r["failed"], first,
                                  last, r["residency"]])
        out.extend(_table(["storage entry", "bytes", "spills", "reloads", "prefetches given back",
                           "dropped spilled", "failed", "first spill", "last reload",
                           "at the snapshot"], (0, 9), storage_cells, len(rows), "storages",
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


def _check_output(parser, option, path, suffixes, what):
    """Refuses (a one-line usage error) an output `path` that cannot be written: a wrong suffix, a
    directory, or a directory that is missing or not writable."""
    if not path.lower().endswith(suffixes):
        parser.error(f"{option} {path}: {what}; name a " + ", ".join(suffixes[:-1])
                     + f" or {suffixes[-1]} file")
    if os.path.isdir(path):
        parser.error(f"{option} {path}: is a directory; name a file in it")
    out_dir = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(out_dir):
        parser.error(f"{option} {path}: no directory {out_dir}")
    if not os.access(out_dir, os.W_OK):
        parser.error(f"{option} {path}: directory {out_dir} is not writable")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m spillway.report",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshots", nargs="+",
                        help="one or two pickles from spillway.dump_snapshot")
    parser.add_argument("-o", "--output", default=None,
                        help="image to write (.png, .svg or .pdf; default: spillway_timeline.png "
                             "in the current directory, none with --html)")
    parser.add_argument("--html", default=None, metavar="OUT.html",
                        help="write a self-contained page (device and host lanes over time, "
                             "spills and reloads per storage, saved bytes per place in the code) "
                             "for one snapshot; needs no matplotlib")
    parser.add_argument("--device", type=int, default=None,
                        help="plot only this device (default: every device with data)")
    args = parser.parse_args(argv)
    if len(args.snapshots) > 2:
        parser.error("give one or two snapshots")
    if args.html is not None and len(args.snapshots) > 1:
        parser.error(f"--html {args.html}: the page shows one snapshot; give one (run it once "
                     "per snapshot)")
    if args.output is None and args.html is None:
        args.output = "spillway_timeline.png"
    if args.output is not None:
        _check_output(parser, "--output", args.output, (".png", ".svg", ".pdf"),
                      "the timeline is an image")
    if args.html is not None:
        _check_output(parser, "--html", args.html, (".html", ".htm"), "the page is HTML")
    snaps = []
    for path in args.snapshots:
        try:
            snap = load(path)
        except Exception as error:  # noqa: BLE001 - missing, unreadable, not a pickle, ...
            if isinstance(error, OSError) and error.strerror:
                reason = error.strerror
            elif isinstance(error, RefusedGlobalError):
                reason = error
            elif isinstance(error, (pickle.UnpicklingError, EOFError)):
                # pickle's own words ("Memo value not found at index 104") do not say this.
                reason = f"not a pickle file ({error}); write one with spillway.dump_snapshot"
            else:
                reason = error
            print(f"{parser.prog}: error: cannot read snapshot {path}: {reason}", file=sys.stderr)
            return 2
        if not isinstance(snap, dict) or "segments" not in snap or "device_traces" not in snap:
            print(f"{parser.prog}: error: {path} is not a memory snapshot (write one with "
                  "spillway.dump_snapshot)", file=sys.stderr)
            return 2
        snaps.append(snap)
    if args.device is not None and args.device not in devices_of(snaps):
        parser.error(f"--device {args.device}: no snapshot has data for it; devices with data: "
                     + ", ".join(str(d) for d in devices_of(snaps)))
    texts = []
    for path, snap in zip(args.snapshots, snaps):
        # The right keys with the wrong contents (a hand-made or damaged file): one line, as for
        # a file that is no snapshot at all, rather than a traceback.
        try:
            texts.append(summary(snap))
            for device in devices(snap):
                series(snap, device)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            what = f"missing key {error}" if isinstance(error, KeyError) else error
            print(f"{parser.prog}: error: {path} is not a memory snapshot this tool can read "
                  f"({type(error).__name__}: {what}); write one with spillway.dump_snapshot",
                  file=sys.stderr)
            return 2
    for path, text in zip(args.snapshots, texts):
        print(f"== {path}")
        print(text)
        print()
    if args.html is not None:
        try:
            page = html_report(snaps[0], os.path.basename(args.snapshots[0]), args.device)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            what = f"missing key {error}" if isinstance(error, KeyError) else error
            print(f"{parser.prog}: error: {args.snapshots[0]} is not a memory snapshot this tool "
                  f"can read ({type(error).__name__}: {what}); write one with "
                  "spillway.dump_snapshot", file=sys.stderr)
            return 2
        try:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(page)
        except OSError as error:
            print(f"{parser.prog}: error: cannot write {args.html}: {error.strerror or error}",
                  file=sys.stderr)
            return 2
        print(f"page: {args.html}")
    if args.output is None:
        return 0
    labels = legend_labels(args.snapshots)
    # The summary above stands without the plot: a machine with no matplotlib (a pip torch often
    # comes without it) or a full disk still gets it, and one line saying why there is no plot.
    try:
        print(f"timeline: {plot(snaps, labels, args.output, args.device)}")
    except ImportError as error:
        print(f"{parser.prog}: error: cannot plot the timeline: {error.name or 'matplotlib'} is "
              "not installed (pip install matplotlib)",
              file=sys.stderr)
        return 2
    except OSError as error:
        print(f"{parser.prog}: error: cannot write {args.output}: {error.strerror or error}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
