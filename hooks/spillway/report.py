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
import os
import pickle
import sys

from . import _report_html, _report_series, _report_summary
from ._report_html import (
    DEVICE_FILL,
    HOST_FILL,
    LANE_HEIGHT,
    LANE_LEFT,
    LANE_WIDTH,
    RESERVED_STROKE,
    ROW_LIMIT,
    SAVED_CATEGORIES,
    column_peaks,
    html_report,
    saved_by_place,
    storage_rows,
)
from ._report_plot import legend_labels, plot
from ._report_series import (
    MIB,
    RefusedGlobalError,
    devices,
    devices_of,
    host_reserved_series,
    load,
    series,
)
from ._report_summary import summary

# The command line (main) is this module's own; the work is in the private modules above, one job
# each, and every name stays reachable here as it was when this module held them all
# (spillway.report.series, spillway.report.html_report).
__all__ = [
    "DEVICE_FILL",
    "HOST_FILL",
    "LANE_HEIGHT",
    "LANE_LEFT",
    "LANE_WIDTH",
    "MIB",
    "RESERVED_STROKE",
    "ROW_LIMIT",
    "SAVED_CATEGORIES",
    "RefusedGlobalError",
    "column_peaks",
    "devices",
    "devices_of",
    "host_reserved_series",
    "html_report",
    "legend_labels",
    "load",
    "main",
    "plot",
    "saved_by_place",
    "series",
    "storage_rows",
    "summary",
]
# Their private helpers too (tests/python/test_report_html.py reads report._mib).
_PlainUnpickler = _report_series._PlainUnpickler
_keepers_text = _report_summary._keepers_text
_span_bytes = _report_summary._span_bytes
_element_bytes = _report_summary._element_bytes
_mib = _report_html._mib
_lane_svg = _report_html._lane_svg
_where = _report_html._where
_table = _report_html._table
_PAGE_STYLE = _report_html._PAGE_STYLE


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
