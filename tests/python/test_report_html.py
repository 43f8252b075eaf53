"""spillway.report --html: the page of a real offloaded training run, checked as data and as
rendered by headless Chromium (the lanes found by their fill colours in a screenshot)."""

import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import torch

import spillway
from spillway import report

BUILD_PY = os.path.dirname(os.path.dirname(spillway.__file__))


@pytest.fixture(scope="module")
def trained_snapshot(tmp_path_factory):
    """Three SGD steps of a small MLP with eager offload on the simulated device, history with
    Python frames. Path and the loaded snapshot."""
    spillway.synchronize()
    # None clears what earlier tests recorded (False would keep it for the next start).
    spillway.record_history(None)
    spillway.record_history(True, max_entries=200000, stacks="python")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                                    torch.nn.Linear(1024, 256))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            x = torch.randn(512, 256)
            with spillway.offload("eager", min_bytes=0, prefetch_bytes=0):
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        spillway.synchronize()
        path = tmp_path_factory.mktemp("html") / "train.pickle"
        spillway.dump_snapshot(path)
    finally:
        spillway.record_history(False)
    return path, report.load(path)


def run_report(*args, env=None):
    return subprocess.run([sys.executable, "-m", "spillway.report", *map(str, args)],
                          env=env or {**os.environ, "PYTHONPATH": BUILD_PY}, capture_output=True,
                          text=True)


def chromium():
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def test_column_peaks_keep_every_high_water_mark():
    # 5 is held for no time at t=0.25 (an allocation freed within the same microsecond): still
    # the peak of its column.
    t = [0.0, 0.25, 0.25, 0.5, 1.0]
    values = [1, 5, 2, 3, 0]
    assert report.column_peaks(t, values, 1.0, 4) == [1, 5, 3, 3]
    assert report.column_peaks([0.0], [7], 0.0, 3) == [7, 0, 0]  # one event: no time span


def test_page_tables_follow_the_snapshot(trained_snapshot, tmp_path):
    path, snap = trained_snapshot
    out = tmp_path / "page.html"
    result = run_report("--html", out, path)
    assert result.returncode == 0, result.stderr
    assert f"page: {out}" in result.stdout
    assert not (tmp_path / "spillway_timeline.png").exists()  # --html alone writes no PNG
    page = out.read_text()

    # Self-contained: nothing fetched from anywhere (no script, style sheet, image or font
    # reference at all).
    assert not re.search(r"(src|href)\s*=", page), "the page refers to another file"
    assert "http://" not in page and "https://" not in page and "@import" not in page

    t0 = report.series(snap)["t0_us"]
    events = [e for e in snap["spillway"]["events"] if e["time_us"] >= t0]
    spills = [e for e in events if e["action"] == "spill"]
    assert spills, "the run spilled nothing: the page would show an empty host lane"
    rows = report.storage_rows(snap, 0)
    assert {r["entry"] for r in rows} == {e["entry"] for e in events}
    assert sum(r["spill"] for r in rows) == len(spills)
    assert sum(r["reload"] for r in rows) == sum(e["action"] == "reload" for e in events)
    assert f"Spills and reloads per storage ({len(rows)} storages)" in page
    for r in rows:
        assert f"<td class=left>{r['entry']:#x}</td>" in page

    saved = [e for e in snap["device_traces"][0]
             if e["action"] == "alloc" and e.get("category") in ("saved_for_backward", "spilled")]
    places = report.saved_by_place(snap, 0)
    assert sum(p["bytes"] for p in places) == sum(e["size"] for e in saved) > 0
    assert sum(p["spilled_bytes"] for p in places) == sum(
        e["size"] for e in saved if e["category"] == "spilled") > 0
    # Linear's and GELU's saves are counted under their modules' forward.
    wheres = [p["where"] for p in places]
    assert any(w.startswith("forward (") and w.endswith("linear.py)") for w in wheres), wheres
    assert any(w.startswith("forward (") and w.endswith("activation.py)") for w in wheres), wheres
    assert "The snapshot names no modules" in page and "innermost Python frame" in page

    s = report.series(snap)
    assert f"(peak {report._mib(max(s['allocated']))};" in page
    assert f"pinned host memory (peak {report._mib(max(s['spilled']))})" in page
    assert max(s["spilled"]) > 0


def count_rows(image, colour, tolerance=6):
    """Per row of an RGB image (an array), how many pixels are within `tolerance` of `colour`."""
    import numpy as np

    close = np.all(np.abs(image.astype(int) - np.array(colour)) <= tolerance, axis=2)
    return close.sum(axis=1).tolist()


def hex_rgb(code):
    return tuple(int(code[i:i + 2], 16) for i in (1, 3, 5))


def test_headless_chromium_draws_the_device_and_host_lanes(trained_snapshot, tmp_path):
    """The page as a browser draws it: the device lane's fill and the host lane's fill each
    cover a band of their own, the device's above the host's. A lane left out, or both drawn
    alike, fails."""
    browser = chromium()
    if browser is None:
        pytest.skip("chromium is not installed (scripts/setup installs Debian's chromium)")
    from PIL import Image

    path, _ = trained_snapshot
    out = tmp_path / "page.html"
    assert run_report("--html", out, path).returncode == 0
    png = tmp_path / "page.png"
    # The browser gets no sanitizer runtime (scripts/python_asan preloads one into the tests).
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    result = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--force-color-profile=srgb", f"--user-data-dir={tmp_path / 'profile'}",
         f"--screenshot={png}", "--window-size=1100,900", out.as_uri()],
        env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and png.exists(), result.stderr[-2000:]

    import numpy as np

    image = np.asarray(Image.open(png).convert("RGB"))
    device_rows = count_rows(image, hex_rgb(report.DEVICE_FILL))
    host_rows = count_rows(image, hex_rgb(report.HOST_FILL))
    # The legend keys are 10 x 10 squares of the same colours: a lane is rows with more.
    device_band = [y for y, n in enumerate(device_rows) if n > 20]
    host_band = [y for y, n in enumerate(host_rows) if n > 20]
    assert device_band and host_band, (sum(device_rows), sum(host_rows))
    assert sum(device_rows[y] for y in device_band) > 5000, sum(device_rows)
    assert sum(host_rows[y] for y in host_band) > 1000, sum(host_rows)
    assert max(device_band) < min(host_band), (device_band[-5:], host_band[:5])
    assert max(host_band) - min(host_band) <= report.LANE_HEIGHT + 1  # one lane, not the page


def test_html_errors_are_one_line(trained_snapshot, tmp_path):
    path, _ = trained_snapshot
    not_pickle = tmp_path / "notes.txt"
    not_pickle.write_text("hello\n")
    out = tmp_path / "page.html"
    for snapshot, reason in ((tmp_path / "missing.pickle", "No such file or directory"),
                             (not_pickle, "not a pickle file")):
        result = run_report("--html", out, snapshot)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot read snapshot" in lines[0], result.stderr
        assert str(snapshot) in lines[0] and reason in lines[0], lines[0]
    # A snapshot whose events lack what the page needs: one line too.
    broken = tmp_path / "broken.pickle"
    broken.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]], "spillway": {
        "events": [{"time_us": 1, "action": "spill", "device": 0, "bytes": 4}]}}))
    result = run_report("--html", out, broken)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "missing key 'entry'" in result.stderr, result.stderr
    for html_out, args, reason in (
            (tmp_path / "page.txt", [path], "name a .html or .htm file"),
            (tmp_path / "nowhere" / "page.html", [path], "no directory"),
            (tmp_path, [path], "the page is HTML"),
            (out, [path, path], "the page shows one snapshot")):
        result = run_report("--html", html_out, *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert reason in result.stderr and str(html_out) in result.stderr, result.stderr
    assert not out.exists()


def test_html_needs_no_matplotlib(trained_snapshot, tmp_path):
    path, _ = trained_snapshot
    blocker = tmp_path / "blocker"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    out = tmp_path / "page.html"
    result = run_report("--html", out, path,
                        env={**os.environ, "PYTHONPATH": f"{blocker}:{BUILD_PY}"})
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 1000


def test_a_snapshot_of_plain_pytorch_gets_both_lanes():
    """A snapshot with no `spillway` section (PyTorch's own, say): the host lane is there, empty,
    and says so; the tables say there is nothing to list. Names are escaped."""
    def entry(action, t):
        return {"action": action, "addr": 4096, "size": 1 << 20, "stream": 0, "time_us": t,
                "frames": []}

    snap = {"segments": [], "device_traces": [[entry("alloc", 10), entry("free_requested", 20),
                                               entry("free_completed", 20)]]}
    page = report.html_report(snap, "<b>.pickle")
    assert page.count('<svg class="lane"') == 2
    assert page.count("nothing held over the recorded history") == 1  # the host lane only
    assert "No spills or reloads on this device." in page
    assert "No allocation saved for backward in the recorded history." in page
    assert "Spillway snapshot: &lt;b&gt;.pickle" in page and "<b>.pickle" not in page


def test_the_host_lane_draws_the_pinned_host_memory_of_torch_2_14s_host_keys():
    """Issue #39: snapshots recorded with record_pinned_host_memory=True carry torch 2.14's
    host_segments and host_traces; the host lane outlines the pinned memory reserved from them
    (its chunks taken and given back), which it could not show before."""
    def entry(action, t, size=1 << 20, **extra):
        return {"action": action, "addr": 4096, "size": size, "stream": 0, "time_us": t,
                **extra}

    host = {"compile_context": "", "user_metadata": "", "pool_id": (0, 0)}
    device_trace = [entry("alloc", 10, frames=[]), entry("free_requested", 30, frames=[]),
                    entry("free_completed", 30, frames=[])]
    snap = {"segments": [], "device_traces": [device_trace],
            "host_segments": [],
            "host_traces": [entry("segment_alloc", 12, 2 << 20, **host),
                            entry("alloc", 12, 1 << 20, **host),
                            entry("free_requested", 15, 1 << 20, **host),
                            entry("free_completed", 15, 1 << 20, **host),
                            entry("segment_free", 20, 2 << 20, **host)]}
    series = report.host_reserved_series(snap, 10)
    assert series["reserved"] == [0, 2 << 20, 2 << 20, 2 << 20, 2 << 20, 0]
    assert series["t"] == pytest.approx([0, 2e-6, 2e-6, 5e-6, 5e-6, 10e-6])
    page = report.html_report(snap, "host.pickle")
    lanes = re.findall(r'<svg class="lane".*?</svg>', page)
    assert len(lanes) == 2
    assert f'stroke="{report.RESERVED_STROKE}"' in lanes[1]  # the host lane's outline
    assert "pinned host memory reserved, all devices' pools, peak 2.00 MiB" in page
    assert "nothing held over the recorded history" not in page

    # Without host history (torch writes the keys empty then): no outline in the host lane.
    snap["host_traces"] = []
    assert report.host_reserved_series(snap, 10) is None
    lanes = re.findall(r'<svg class="lane".*?</svg>', report.html_report(snap, "host.pickle"))
    assert f'stroke="{report.RESERVED_STROKE}"' not in lanes[1]
