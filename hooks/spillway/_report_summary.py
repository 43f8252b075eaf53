"""spillway.report's text summary of a snapshot: the largest blocks and their keepers, storages
kept alive only by views saved for backward, storages released while others held them, and the
offload counts."""

from ._report_series import MIB


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
                     f"{stats.get('num_taken_back', 0)} taken back before they left, "
                     f"{stats.get('bytes_to_host', 0) / MIB:.1f} MiB to host, "
                     f"{stats.get('num_prefetch_hits', 0)} prefetch hits, "
                     f"{stats.get('num_stalls', 0)} stalls")
    return "\n".join(lines)
