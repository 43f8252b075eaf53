"""bench/llm_step.py's report: each row's physical bound (annotate), the out-of-memory frontier, the
markdown tables, the plot of memory saved against step-time overhead, and the summary."""

import math

from llm_step_common import CHECKPOINTED, CONFIGS, GIB, MIB, warmup_steps


def ok_rows(rows, model, config):
    return {r["seq"]: r for r in rows
            if r["model"] == model and r["config"] == config and r["status"] == "ok"}


def flops_per_step(m, seq):
    """Training FLOPs of one step: 6 per weight per token (the embedding lookup is free, the head
    is not), plus causal attention's 6 * layers * width * length per token."""
    weights = m["params"] - m["vocab_size"] * m["hidden_size"] * (
        0 if m["tie_word_embeddings"] else 1)
    tokens = m["batch"] * seq
    return tokens * (6 * weights + 6 * m["layers"] * m["hidden_size"] * seq)


def link_text(link):
    """The link the bounds use, in words: measured on a GPU, or the simulated device's as
    configured (its copies take their bytes over that bandwidth, allocator/sim_link.h)."""
    if "sim_link_mb_per_s" in link:
        return (f"the simulated device's, {link['sim_link_mb_per_s']} MiB/s each way "
                f"(sim_link_mb_per_s; {link['d2h_gbps']:.3g} GB/s)")
    if "d2h_gbps" in link:
        return (f"pinned, {link['link_bytes'] / GIB:.0f} GiB copies, best of 5: "
                f"D2H {link['d2h_gbps']:.1f} GB/s, H2D {link['h2d_gbps']:.1f} GB/s")
    return link.get("reason") or link.get("error") or "not measured"


def held(r):
    """The most memory a row's step held for tensors: peak active bytes, which count a block
    whose free waits for a copy still reading it (a spill's, until its bytes have crossed the
    link), where peak allocated bytes count it as freed. Rows of older runs have allocated only."""
    return r.get("peak_active", r["peak_allocated"])


def scaled(base, key, m, seq):
    """`key` of the base rows at `seq`: measured there, or scaled by training FLOPs from the
    longest length measured; (value, basis), or (None, None) with no base row."""
    if seq in base:
        return base[seq][key], "measured"
    if not base:
        return None, None
    s = max(base)
    return base[s][key] * flops_per_step(m, seq) / flops_per_step(m, s), f"FLOPs-scaled from {s}"


def annotate(rows, models, link):
    """Adds to each row what is read against the reference: memory saved (held memory, see
    `held`), step-time overhead, the losses' comparison, and the physical bound.

    The bound is the larger of two. The link's: max(compute, bytes to the host / D2H bandwidth,
    bytes back / H2D bandwidth), each direction overlapping the whole step. The peak's: memory a
    row holds below its base at the peak (the end of forward) must have crossed to the host by
    then, and must cross back after it, before backward reads it: max(forward compute, saved /
    D2H bandwidth) + max(the rest of the step, saved / H2D bandwidth). The second binds where a
    row saves much on a slow link; it needs the base row at the same length (its held memory)."""
    for r in rows:
        if r["status"] != "ok":
            continue
        ref = ok_rows(rows, r["model"], "pytorch").get(r["seq"])
        if r["config"] == "pytorch":
            r["losses_vs_reference"] = "(reference)"
        elif ref is not None:
            if r["losses"] == ref["losses"]:
                r["losses_vs_reference"] = "bitwise equal"
            else:
                diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
                r["losses_vs_reference"] = f"differ (max |d| {diff:.3g})"
        else:
            r["losses_vs_reference"] = "no reference at this length"
        if ref is not None:
            r["saved_fraction"] = 1 - held(r) / held(ref)
            r["overhead_fraction"] = r["median_step_s"] / ref["median_step_s"] - 1
        if not link or "d2h_gbps" not in link or not r.get("to_host_per_step"):
            continue
        base_config = "checkpoint" if r["config"] in CHECKPOINTED else "pytorch"
        base = ok_rows(rows, r["model"], base_config)
        m = models[r["model"]]
        compute, basis = scaled(base, "median_step_s", m, r["seq"])
        if compute is None:
            continue
        d2h_bps, h2d_bps = link["d2h_gbps"] * 1e9, link["h2d_gbps"] * 1e9
        d2h = r["to_host_per_step"] / d2h_bps
        h2d = r["to_device_per_step"] / h2d_bps
        bound = {"compute_s": compute, "compute_basis": f"{base_config}, {basis}",
                 "d2h_s": d2h, "h2d_s": h2d, "link_bound_s": max(compute, d2h, h2d)}
        # Only where the base row ran at this length: its held memory is what the row saved from.
        forward = base.get(r["seq"], {}).get("median_forward_s")
        if forward is not None:
            saved = max(0, held(base[r["seq"]]) - held(r))
            bound.update(forward_s=forward, saved_at_peak=saved, peak_bound_s=(
                max(forward, saved / d2h_bps) + max(compute - forward, saved / h2d_bps)))
        bound["bound_s"] = max(bound["link_bound_s"], bound.get("peak_bound_s", 0))
        r["bound"] = bound
        r["step_over_bound"] = r["median_step_s"] / bound["bound_s"]


def frontier(rows, models, configs):
    """Per model and configuration: the longest length trained and what stopped it."""
    out = []
    for config in configs:
        for name, m in models.items():
            mine = [r for r in rows if r["model"] == name and r["config"] == config]
            unavailable = [r for r in mine if r["status"] == "unavailable"]
            entry = {"model": name, "config": config, "longest": None, "stopped": None}
            if unavailable:
                entry["stopped"] = unavailable[0]["reason"]
                out.append(entry)
                continue
            by_seq = {r["seq"]: r for r in mine}
            for seq in m["seqs"]:
                r = by_seq.get(seq)
                if r is None:
                    entry["stopped"] = f"not run at {seq}"
                    break
                if r["status"] == "ok":
                    entry["longest"] = seq
                    continue
                entry["stopped"] = {"oom": f"out of memory at {seq}",
                                    "skipped": f"skipped at {seq} (host-memory cap)",
                                    "no_time": f"no time at {seq}",
                                    "error": f"error at {seq}"}.get(r["status"], r["status"])
                if r["status"] == "oom":
                    entry["first_oom"] = seq
                break
            else:
                entry["stopped"] = "trained every length tried"
            out.append(entry)
    return out


def chosen(front):
    """The configurations of this run (--configs may name a few), as (name, label), in order."""
    names = {f["config"] for f in front}
    return [(c, label) for c, label in CONFIGS if c in names]


def fmt(value, scale=1.0, digits=1):
    if value is None:
        return ""
    return f"{value / scale:.{digits}f}"


def markdown(meta, rows, models, front):
    sim = meta["device"] == "sim"
    unit, scale = ("MiB", MIB) if sim else ("GiB", GIB)
    time_label = "step (s, host CPU)" if sim else "step (s)"
    lines = [f"# llm_step: {meta['device_name']}, {meta['date']}", ""]
    lines.append(f"torch {meta['torch']}, transformers {meta['transformers']}, Python "
                 f"{meta['python']}; {meta['steps']} steps per length (the first "
                 f"{warmup_steps(meta['steps'])} warm-up); "
                 f"determinism {meta['determinism']}; {meta['elapsed_s']:.0f} s of a "
                 f"{meta['budget_s']:.0f} s budget.")
    if meta.get("stopped"):
        lines.append(f"**Cut short**: {meta['stopped']}; the rows not run say no_time.")
    lines.append(f"Link: {link_text(meta.get('link') or {})}.")
    lines.append("Peak held: the most memory held for tensors (active bytes: allocated, or freed "
                 "and awaiting a copy still reading it, as a spill's block is until its bytes "
                 "have crossed); memory saved and its \"vs ref\" are read from it. Bound: the "
                 "larger of the link's, max(compute, bytes to the host / D2H bandwidth, bytes "
                 "back / H2D bandwidth), and the peak's, max(forward, saved / D2H bandwidth) + "
                 "max(rest of the step, saved / H2D bandwidth), saved being the memory held "
                 "below the base row at the peak.")
    if sim:
        lines.append("On the simulated device the reference runs on Spillway's allocator (it is "
                     "the device) without offload; step times are the host CPU's, and say "
                     "nothing of a GPU's.")
    for name, m in models.items():
        lines += ["", f"## {name}: {m['label']}", "",
                  f"{m['params'] / 1e9:.3f} B parameters, batch {m['batch']}, lengths "
                  f"{', '.join(map(str, m['seqs']))}" +
                  (f", simulated device of {m['capacity_mb']} MiB" if sim else ""), "",
                  f"| configuration | length | result | tokens/s | {time_label} | vs ref step |"
                  f" peak held ({unit}) | vs ref | peak alloc ({unit}) | peak reserved ({unit}) "
                  f"| to host / step ({unit}) | back / step ({unit}) | stall / step (ms) | "
                  f"bound (s) | step / bound | losses |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
                  "---|"]
        for config, label in chosen(front):
            mine = [r for r in rows if r["model"] == name and r["config"] == config]
            for r in mine:
                if r["status"] == "skipped" and "beyond" in r.get("reason", ""):
                    continue
                if r["status"] != "ok":
                    seq = r["seq"] if r["seq"] is not None else ""
                    reason = r.get("reason", "").replace("|", "/")
                    lines.append(f"| {label} | {seq} | {r['status']}: {reason} |" + " |" * 13)
                    continue
                bound = r.get("bound") or {}
                step_ratio = r["overhead_fraction"] + 1 if "overhead_fraction" in r else None
                peak_ratio = 1 - r["saved_fraction"] if "saved_fraction" in r else None
                cells = [label, r["seq"], "ok", f"{r['tokens_per_s']:.0f}",
                         f"{r['median_step_s']:.3f}", fmt(step_ratio, 1, 2),
                         fmt(held(r), scale, 2), fmt(peak_ratio, 1, 2),
                         fmt(r["peak_allocated"], scale, 2), fmt(r["peak_reserved"], scale, 2),
                         fmt(r.get("to_host_per_step"), scale, 2),
                         fmt(r.get("to_device_per_step"), scale, 2),
                         fmt(r.get("stall_per_step_s"), 1e-3, 1),
                         fmt(bound.get("bound_s"), 1, 3), fmt(r.get("step_over_bound"), 1, 2),
                         r["losses_vs_reference"]]
                lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "## Out-of-memory frontier: the longest length each configuration trained", "",
              "| configuration | " + " | ".join(models) + " |",
              "|---|" + "---|" * len(models)]
    for config, label in chosen(front):
        cells = []
        for name in models:
            e = next(f for f in front if f["model"] == name and f["config"] == config)
            longest = e["longest"] if e["longest"] is not None else "none"
            cells.append(f"{longest} ({e['stopped']})".replace("|", "/"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(meta, rows, models, front, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 8.5))
    colors = plt.get_cmap("tab20").colors
    markers = ["o", "s", "^", "D"]
    configs = chosen(front)
    for ci, (config, label) in enumerate(configs):
        for mi, name in enumerate(models):
            pts = [r for r in rows if r["model"] == name and r["config"] == config
                   and r["status"] == "ok" and "saved_fraction" in r]
            if not pts:
                continue
            xs = [100 * r["saved_fraction"] for r in pts]
            ys = [100 * r["overhead_fraction"] for r in pts]
            ax.scatter(xs, ys, color=colors[ci % len(colors)], marker=markers[mi % 4], s=45,
                       label=f"{label} [{name}]")
            for x, y, r in zip(xs, ys, pts):
                ax.annotate(str(r["seq"]), (x, y), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
    ax.axhline(0, color="grey", lw=0.5)
    ax.axvline(0, color="grey", lw=0.5)
    ax.set_xlabel("memory saved: 1 - peak held / reference's (%; held: allocated, or awaiting "
                  "a copy out)")
    ax.set_ylabel("step-time overhead over the reference (%)")
    ax.set_title("Memory saved against step time (labels: sequence length)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)

    names = list(models)
    height = 0.8 / max(1, len(names))
    low = math.log2(min(min(m["seqs"]) for m in models.values())) - 1
    for mi, name in enumerate(names):
        for ci, (config, _) in enumerate(configs):
            e = next(f for f in front if f["model"] == name and f["config"] == config)
            y = ci + mi * height
            value = e["longest"] or 0
            width = math.log2(value) - low if value else 0
            bx.barh(y, width, left=low, height=height * 0.9,
                    color=colors[(2 * mi) % len(colors)], label=name if ci == 0 else None)
            tag = e["stopped"] or ""
            tag = ("OOM" if tag.startswith("out of memory") else
                   "host cap" if "host-memory" in tag else
                   "time" if tag.startswith("no time") or tag.startswith("not run") else
                   "all" if tag.startswith("trained every") else
                   "n/a" if e["longest"] is None else tag.split(" ")[0])
            bx.text(low + width + 0.05, y, f"{value or '-'} ({tag})", va="center", fontsize=6)
    bx.set_yticks([c + 0.4 - height / 2 for c in range(len(configs))])
    bx.set_yticklabels([label for _, label in configs], fontsize=7)
    bx.invert_yaxis()
    bx.set_xlim(left=low)
    bx.set_xlabel("longest sequence trained (log2)")
    bx.set_title("Out-of-memory frontier (what stopped it in brackets)")
    bx.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"llm_step on {meta['device_name']} ({meta['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(meta, rows, models, front):
    """The lines printed last: the link, the frontier, and per model the rows at the longest
    length the reference trained."""
    sim = meta["device"] == "sim"
    unit, scale = ("MiB", MIB) if sim else ("GiB", GIB)
    out = [f"llm_step summary: {meta['device_name']}, {meta['elapsed_s']:.0f} s"
           + (f" (cut short: {meta['stopped']})" if meta.get("stopped") else "")]
    out.append(f"link: {link_text(meta.get('link') or {})}")
    for name in models:
        ref = ok_rows(rows, name, "pytorch")
        if not ref:
            out.append(f"{name}: the reference trained no length")
            continue
        seq = max(ref)
        out += ["", f"{name} at length {seq} (the longest the reference trained):",
                f"| configuration | tokens/s | vs ref step | peak held ({unit}) | vs ref | "
                f"to host/step ({unit}) | step/bound | losses |", "|---|---:|---:|---:|---:|---:|"
                "---:|---|"]
        for config, label in chosen(front):
            r = ok_rows(rows, name, config).get(seq)
            if r is None:
                continue
            out.append(f"| {label} | {r['tokens_per_s']:.0f} | "
                       f"{r['median_step_s'] / ref[seq]['median_step_s']:.2f} | "
                       f"{held(r) / scale:.2f} | {1 - r['saved_fraction']:.2f} | "
                       f"{fmt(r.get('to_host_per_step'), scale, 2)} | "
                       f"{fmt(r.get('step_over_bound'), 1, 2)} | {r['losses_vs_reference']} |")
    out += ["", "OOM frontier (longest length trained; what stopped it):",
            "| configuration | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for config, label in chosen(front):
        cells = []
        for name in models:
            e = next(f for f in front if f["model"] == name and f["config"] == config)
            stopped = e["stopped"] or ""
            if e["longest"] is None and ":" in stopped:  # not run here: the reason's head
                stopped = stopped.split(":")[0]
            cells.append(f"{e['longest'] or 'none'} ({stopped})".replace("|", "/"))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)
