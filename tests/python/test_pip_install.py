"""`pip install --no-build-isolation .` into a fresh virtual environment: the installed package,
its extension, the C ABI library and the start-up hook serve a training script run from another
directory with nothing sourced and no PYTHONPATH, under SPILLWAY_ALLOC_CONF alone."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Two steps of a small MLP; the first step's saves are 4 MiB each, past the default min_bytes.
TRAIN = textwrap.dedent("""
    import sys
    import torch
    import spillway

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU())
                                  for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(1024, 1024)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
    stats = spillway.memory_stats() if spillway.installed() else {}
    print("spillway_file", spillway.__file__)
    print("installed", spillway.installed())
    print("to_host", stats.get("spillway.bytes_to_host", 0))
    print("losses", ",".join(losses))
    print("weights", sum(float(p.double().sum()) for p in model.parameters()).hex())
""")


def _clean_env(venv):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONUSERBASE", "SPILLWAY_PYTHON_SITE", "VIRTUAL_ENV",
                        "SPILLWAY_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
    return env


def _fields(stdout):
    return dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_pip_install_serves_a_plain_training_script_from_another_directory(tmp_path):
    venv = str(tmp_path / "venv")
    # --system-site-packages: the environment's torch (2.13 from requirements.txt), which the
    # package must build against and run with; nothing of Spillway is there.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    env = _clean_env(venv)
    probe = subprocess.run([python, "-c", "import spillway"], env=env, cwd=tmp_path,
                           capture_output=True, text=True)
    assert probe.returncode != 0, "spillway importable before the install: the test proves nothing"

    args = [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--quiet",
            "-C", f"build-dir={tmp_path / 'build'}"]
    if shutil.which("ccache"):
        args += ["-C", "cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    install = subprocess.run(args + [ROOT], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=1200)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    (workdir / "train.py").write_text(TRAIN)
    runs = {}
    for name, conf in (("plain", None), ("spillway", "device:sim,capacity_mb:1024,offload:eager")):
        run_env = dict(env)
        if conf:
            run_env["SPILLWAY_ALLOC_CONF"] = conf
        result = subprocess.run([python, "train.py"], env=run_env, cwd=workdir,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = _fields(result.stdout)

    site = os.path.join(venv, "lib")
    for fields in runs.values():
        assert fields["spillway_file"].startswith(site), fields["spillway_file"]
    assert runs["plain"]["installed"] == "None"
    assert runs["spillway"]["installed"] == "sim"
    assert int(runs["spillway"]["to_host"]) > 0  # the start-up hook turned offload on
    assert runs["spillway"]["losses"] == runs["plain"]["losses"]
    assert runs["spillway"]["weights"] == runs["plain"]["weights"]
