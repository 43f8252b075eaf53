"""Reads Spillway snapshots (spillway.dump_snapshot) and reports what holds memory.

    python -m spillway.report SNAPSHOT [SNAPSHOT2] [-o OUT.png] [--device N]

Prints the largest blocks with their keepers, the storages kept alive only by tensors saved for
backward whose views reach less than the whole storage (views you hold yourself are not seen:
such a storage has other holders and is not listed), and the storages released while other
tensors still held them; writes a PNG timeline of device memory (allocated, reserved, spilled to
host) over the recorded history. Given two snapshots (say, without and with offload) it plots both
on one figure; a snapshot with several devices gets one panel per device (--device N: only N).
"""

import argparse
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
    `reserved` and `spilled` (bytes after each event). The starting levels are
    derived from the end state, so the curves end where the snapshot's segments are."""
    traces = snapshot["device_traces"]
    trace = traces[device] if device < len(traces) else []
    section = snapshot.get("spillway", {})
    offload_events = [e for e in section.get("events", []) if e.get("device", 0) == device]
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
           "spilled": [start_spilled]}
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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m spillway.report",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshots", nargs="+",
                        help="one or two pickles from spillway.dump_snapshot")
    parser.add_argument("-o", "--output", default="spillway_timeline.png",
                        help="image to write (.png, .svg or .pdf; default: spillway_timeline.png "
                             "in the current directory)")
    parser.add_argument("--device", type=int, default=None,
                        help="plot only this device (default: every device with data)")
    args = parser.parse_args(argv)
    if len(args.snapshots) > 2:
        parser.error("give one or two snapshots")
    if not args.output.lower().endswith((".png", ".svg", ".pdf")):
        parser.error(f"--output {args.output}: the timeline is an image; name a .png, .svg or "
                     ".pdf file")
    if os.path.isdir(args.output):
        parser.error(f"--output {args.output}: is a directory; name an image file in it")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        parser.error(f"--output {args.output}: no directory {out_dir}")
    if not os.access(out_dir, os.W_OK):
        parser.error(f"--output {args.output}: directory {out_dir} is not writable")
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
