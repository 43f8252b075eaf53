"""spillway.report: the text summary names the right storages, the PNG follows the trace."""

import os
import subprocess
import sys

import torch

import spillway
from spillway import report

BUILD_PY = os.path.dirname(os.path.dirname(spillway.__file__))


def recorded_step(policy):
    spillway.synchronize()
    spillway.reset_peak_stats()
    spillway.record_history(True, max_entries=200000, stacks="python")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                    torch.nn.Linear(512, 256))
        x = torch.randn(1024, 256)
        with spillway.offload(policy, min_bytes=0, prefetch_bytes=0):
            loss = model(x).square().mean()
        loss.backward()
        del model, x, loss
        spillway.synchronize()
        return spillway.snapshot()
    finally:
        spillway.record_history(False)


def test_plotted_allocated_peak_equals_the_allocator_requested_peak(tmp_path):
    snap = recorded_step("eager")
    s = report.series(snap)
    # Requested bytes: the history's events carry those, as PyTorch's do. The statistic lets a
    # block go once its free completes, the timeline at the free: never higher than the peak.
    stats = snap["spillway"]["allocator_stats"]
    assert 0 < max(s["allocated"]) <= stats["requested_bytes.all.peak"]
    assert s["allocated"][-1] == stats["requested_bytes.all.current"]  # nothing pending now
    assert max(s["spilled"]) > 0  # the eager run spilled, and the timeline shows it
    assert s["spilled"][-1] == snap["spillway"]["stats"]["spilled_bytes.current"]
    assert snap["spillway"]["spilled_bytes_by_device"] == [s["spilled"][-1]]  # the one device
    png = report.plot([snap], [""], str(tmp_path / "one.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10000


def test_command_line_with_two_snapshots(tmp_path):
    without = tmp_path / "without.pickle"
    with_offload = tmp_path / "with.pickle"
    import pickle
    for path, policy in ((without, "off"), (with_offload, "eager")):
        with open(path, "wb") as f:
            pickle.dump(recorded_step(policy), f, protocol=4)
    out_png = tmp_path / "both.png"
    result = subprocess.run([sys.executable, "-m", "spillway.report", str(without),
                             str(with_offload), "-o", str(out_png)],
                            env={**os.environ, "PYTHONPATH": BUILD_PY}, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert "Largest blocks" in result.stdout
    assert f"timeline: {out_png}" in result.stdout
    assert out_png.stat().st_size > 10000


def test_summary_names_a_storage_held_alive_only_by_a_view():
    """Seed 000: a saved view of a dead base keeps the whole storage."""
    x = torch.randn(64, 64, requires_grad=True)

    def forward():
        base = torch.randn(1024, 64)   # 256 KiB storage
        view = base[:64]               # 16 KiB view, saved by matmul
        return (x @ view.t()).sum()

    with spillway.offload("off", min_bytes=0):
        loss = forward()
    text = report.summary(spillway.snapshot())
    section = text.split("Storages held alive only by views")[1].split("Storages released")[0]
    assert "0.25 MiB kept by views using 0.02 MiB of it, reaching 0.02 MiB" in section, section
    assert "saved (64, 64) stride (1, 64) offset 0" in section  # the transposed view mm saved
    loss.backward()


def test_summary_tells_use_from_extent():
    """User review: a saved (512, 100) slice of a 512 x 512 storage reaches almost its end but
    uses a fifth of it; the summary said "1.00 MiB kept by views reaching 1.00 MiB"."""
    x = torch.randn(100, 8, requires_grad=True)

    def forward():
        base = torch.randn(512, 512)   # 1 MiB storage
        view = base[:, :100]           # 0.2 MiB of elements, up to the last row
        return (view @ x).sum()

    with spillway.offload("off", min_bytes=0):
        loss = forward()
    text = report.summary(spillway.snapshot())
    section = text.split("Storages held alive only by views")[1].split("Storages released")[0]
    assert "1.00 MiB kept by views using 0.20 MiB of it, reaching 1.00 MiB" in section, section
    loss.backward()


def test_summary_names_storages_released_while_others_held_them():
    padded = torch.zeros(300_000)
    param = padded[:262_144].view(512, 512)
    keep = padded[:10]
    spillway.release(param)
    text = report.summary(spillway.snapshot())
    section = text.split("Storages released while other tensors still held them:")[1]
    assert "1.14 MiB freed; 2 other holder(s)" in section, section
    del keep


def test_a_release_line_names_the_other_holders_once():
    snap = {"segments": [], "device_traces": [], "spillway": {"releases": [
        {"freed_bytes": 1 << 20, "other_holders": 2,
         "keepers": [{"kind": "saved", "shape": (4,), "stride": (1,), "offset": 0},
                     {"kind": "saved", "shape": (8,), "stride": (1,), "offset": 0, "lost": True},
                     {"kind": "external", "count": 3}]},
        {"freed_bytes": 2 << 20, "other_holders": 1,
         "keepers": [{"kind": "external", "count": 2}]}]}}
    lines = report.summary(snap).split("Storages released while other tensors still held them:")[1]
    lines = [line for line in lines.splitlines() if line.strip()]
    assert lines[0] == ("  1.00 MiB freed; 2 other holder(s); saved (4,) stride (1,) offset 0; "
                        "saved (8,) stride (1,) offset 0 (lost: its backward raises)")
    assert lines[1] == "  2.00 MiB freed; 1 other holder(s)"


def run_report(*args):
    return subprocess.run([sys.executable, "-m", "spillway.report", *map(str, args)],
                          env={**os.environ, "PYTHONPATH": BUILD_PY}, capture_output=True,
                          text=True)


def test_blocks_without_addresses_are_summarized():
    """Snapshots of older PyTorch releases name no block addresses; they read all the same."""
    snap = {"segments": [{"device": 0, "total_size": 2 << 20, "blocks": [
        {"size": 1 << 20, "state": "active_allocated"}, {"size": 1 << 20, "state": "inactive"}]}],
        "device_traces": [[]]}
    text = report.summary(snap)
    assert "1.00 MiB  active_allocated     not saved for backward" in text, text


def test_command_line_names_a_file_it_cannot_read(tmp_path):
    not_pickle = tmp_path / "notes.txt"
    not_pickle.write_text("hello\n")
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    not_snapshot = tmp_path / "list.pickle"
    import pickle
    not_snapshot.write_bytes(pickle.dumps([1, 2, 3]))
    # The right keys, the wrong contents: each was a traceback with exit status 1.
    wrong_types = tmp_path / "wrong_types.pickle"
    wrong_types.write_bytes(pickle.dumps({"segments": 5, "device_traces": "x"}))
    no_size = tmp_path / "no_size.pickle"
    no_size.write_bytes(pickle.dumps({"segments": [{"device": 0, "total_size": 1, "blocks": [
        {"state": "active_allocated"}]}], "device_traces": []}))
    for path, reason in ((tmp_path / "missing.pickle", "No such file or directory"),
                         (not_pickle, "cannot read snapshot"),
                         (not_pickle, "not a pickle file"),
                         (empty, "not a pickle file (Ran out of input)"),
                         (not_snapshot, "is not a memory snapshot"),
                         (wrong_types, "is not a memory snapshot this tool can read (TypeError"),
                         (no_size, "missing key 'size'")):
        result = run_report(path, "-o", tmp_path / "out.png")
        assert result.returncode == 2, (path, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("python -m spillway.report: error: ") and str(path) in lines[0]
        assert reason in lines[0], lines[0]
    assert not (tmp_path / "out.png").exists()


def test_command_line_names_an_output_it_cannot_write(tmp_path):
    """User review: -o naming a missing directory or a non-PNG name was a traceback, exit 1."""
    snap = tmp_path / "snap.pickle"
    spillway.dump_snapshot(snap)
    for output, reason in ((tmp_path / "nowhere" / "x.png", "no directory"),
                           (tmp_path / "x.txt", "name a .png, .svg or .pdf file")):
        result = run_report(snap, "-o", output)
        assert result.returncode == 2, (output, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        assert reason in result.stderr and str(output) in result.stderr, result.stderr


def test_two_snapshots_of_the_same_file_name_get_different_labels():
    """Python review: run1/snap.pickle and run2/snap.pickle were both labelled snap.pickle."""
    assert report.legend_labels(["a/x.pickle", "b/y.pickle"]) == ["x.pickle", "y.pickle"]
    assert report.legend_labels(["run1/snap.pickle", "run2/snap.pickle"]) == [
        "run1/snap.pickle", "run2/snap.pickle"]
    assert report.legend_labels(["only.pickle"]) == [""]


def test_an_output_that_is_a_directory_or_no_matplotlib_is_one_line(tmp_path):
    """Python review: -o naming a directory, and a machine without matplotlib, were tracebacks
    with exit status 1 (the README promises one line and status 2). Without matplotlib the text
    summary still comes."""
    snap = tmp_path / "snap.pickle"
    spillway.dump_snapshot(snap)
    folder = tmp_path / "plots.png"
    folder.mkdir()
    result = run_report(snap, "-o", folder)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "is a directory" in result.stderr and str(folder) in result.stderr, result.stderr

    blocker = tmp_path / "blocker"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    result = subprocess.run(
        [sys.executable, "-m", "spillway.report", str(snap), "-o", str(tmp_path / "t.png")],
        env={**os.environ, "PYTHONPATH": f"{blocker}:{BUILD_PY}"}, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "matplotlib is not installed" in lines[0], result.stderr
    assert f"== {snap}" in result.stdout, result.stdout
    assert not (tmp_path / "t.png").exists()


def test_spilled_timeline_follows_every_offload_event_kind():
    """The spilled curve starts at 0 and ends at the engine's spilled bytes whatever happened in
    between: a failed spill and a given-back prefetch move it too."""
    events = [("spill", 4), ("spill", 2), ("failed", 2), ("reload", 4), ("prefetch_given_back", 4),
              ("drop_spilled", 4), ("spill", 8)]
    snap = {"segments": [], "device_traces": [[]],
            "spillway": {"stats": {"spilled_bytes.current": 8},
                         "events": [{"time_us": i, "action": a, "device": 0, "bytes": b}
                                    for i, (a, b) in enumerate(events)]}}
    spilled = report.series(snap)["spilled"]
    assert spilled == [0, 4, 6, 4, 0, 4, 0, 8]


def two_device_snapshot():
    """Device 0 spilled 4 bytes and kept them spilled; device 1 spilled 8 and reloaded 2."""
    def event(t, action, device, size):
        return {"time_us": t, "action": action, "device": device, "bytes": size}

    def alloc(t, size):
        return {"time_us": t, "action": "alloc", "size": size, "addr": t, "stream": 0,
                "frames": []}

    return {"segments": [], "device_traces": [[alloc(0, 16)], [alloc(1, 32)]],
            "spillway": {"stats": {"spilled_bytes.current": 10},
                         "spilled_bytes_by_device": [4, 6],
                         "events": [event(2, "spill", 0, 4), event(3, "spill", 1, 8),
                                    event(4, "reload", 1, 2)]}}


def test_each_device_gets_its_own_timeline(tmp_path):
    """The report plotted device 0 only: a process on device 1 (a DDP rank) got an empty plot."""
    snap = two_device_snapshot()
    assert report.devices(snap) == [0, 1]
    assert report.series(snap, 0)["spilled"] == [0, 0, 4]
    assert report.series(snap, 1)["spilled"] == [0, 0, 8, 6]
    assert report.series(snap, 1)["allocated"][-1] - report.series(snap, 1)["allocated"][0] == 32

    def png_height(path):
        with open(path, "rb") as f:
            header = f.read(24)
        return int.from_bytes(header[20:24], "big")

    both = report.plot([snap], [""], str(tmp_path / "both.png"))
    one = report.plot([snap], [""], str(tmp_path / "one.png"), device=1)
    assert png_height(both) > 1.8 * png_height(one)  # a panel per device


def test_command_line_names_a_device_without_data(tmp_path):
    import pickle
    path = tmp_path / "snap.pickle"
    with open(path, "wb") as f:
        pickle.dump(two_device_snapshot(), f, protocol=4)
    result = subprocess.run([sys.executable, "-m", "spillway.report", str(path), "--device", "3",
                             "-o", str(tmp_path / "t.png")],
                            env={**os.environ, "PYTHONPATH": BUILD_PY}, capture_output=True,
                            text=True)
    assert result.returncode == 2
    assert "--device 3: no snapshot has data for it; devices with data: 0, 1" in result.stderr
    result = subprocess.run([sys.executable, "-m", "spillway.report", str(path), "--device", "1",
                             "-o", str(tmp_path / "t.png")],
                            env={**os.environ, "PYTHONPATH": BUILD_PY}, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "t.png").exists()


class RunsCode:
    """What a crafted "snapshot" holds: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_code_is_refused_and_snapshots_still_load(tmp_path):
    """Security review: load() was pickle.load, and snapshots are shared in bug reports: a file
    whose __reduce__ names os.system ran the command when read."""
    import pickle
    marker = tmp_path / "ran"
    crafted = tmp_path / "crafted.pickle"
    crafted.write_bytes(pickle.dumps({"segments": [], "device_traces": [RunsCode(marker)]},
                                     protocol=4))
    refused = f"{os.system.__module__}.{os.system.__name__}"  # posix.system
    try:
        report.load(crafted)
    except report.RefusedGlobalError as error:
        message = str(error)
    else:
        raise AssertionError("the crafted pickle was loaded")
    assert f"refused to load the global {refused}" in message, message
    assert "only plain types" in message, message
    assert not marker.exists()

    result = run_report(crafted, "-o", tmp_path / "out.png")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"python -m spillway.report: error: cannot read snapshot {crafted}: "
                               f"refused to load the global {refused}"), lines[0]
    assert not marker.exists()
    assert not (tmp_path / "out.png").exists()

    # What the refusal must keep: a real snapshot with history, frames and offload events, and
    # every plain type a snapshot may hold, at every protocol a writer may use (PyTorch's C++
    # pickler writes protocol 2).
    path = tmp_path / "snap.pickle"
    spillway.record_history(True, max_entries=200000, stacks="python")
    try:
        model = torch.nn.Linear(256, 256)
        with spillway.offload("eager", min_bytes=0, prefetch_bytes=0):
            loss = model(torch.randn(512, 256)).square().mean()
        spillway.synchronize()
        spillway.dump_snapshot(path)
        loss.backward()
    finally:
        spillway.record_history(False)
    snap = report.load(path)
    with open(path, "rb") as f:
        assert snap == pickle.load(f)
    assert snap["device_traces"][0] and snap["spillway"]["events"]
    assert report.main([str(path), "-o", str(tmp_path / "t.png")]) == 0

    plain = {"segments": [], "device_traces": [[]], "text": "é",
             "numbers": (0, -1, 1 << 70, 2.5, float("inf")), "flags": [True, False, None],
             "nested": {"pool": (0, 0), "empty": ((), [], {})}}
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        if protocol >= 3:  # bytes have opcodes of their own from protocol 3 on
            plain["raw"] = b"\x00\xff"
        (tmp_path / "plain.pickle").write_bytes(pickle.dumps(plain, protocol=protocol))
        assert report.load(tmp_path / "plain.pickle") == plain, protocol
