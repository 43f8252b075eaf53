"""spillway.report's PNG (or SVG, PDF) timeline: device memory allocated, reserved and spilled to
host over the recorded history, with matplotlib (imported only when a plot is drawn)."""

import os

from ._report_series import MIB, devices_of, series


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
