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


def _release_build_compiler():
    """The C++ compiler build/ was configured with (scripts/build), or None."""
    try:
        with open(os.path.join(ROOT, "build", "CMakeCache.txt")) as cache:
            for line in cache:
                if line.startswith("CMAKE_CXX_COMPILER:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return None


def _fields(stdout):
    return dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)


@pytest.mark.packaging
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

    # A fresh build tree beside build/ (an ignored path), compiled through ccache as
    # scripts/build compiles (CCACHE_BASEDIR the clone, the same compiler): the same sources at
    # the same relative paths hit what the Release build compiled, in seconds rather than minutes.
    build_dir = os.path.join(ROOT, "build-pip-test")
    shutil.rmtree(build_dir, ignore_errors=True)
    args = [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--quiet",
            "-C", f"build-dir={build_dir}"]
    install_env = dict(env)
    if shutil.which("ccache"):
        args += ["-C", "cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        install_env.update(CCACHE_BASEDIR=ROOT, CCACHE_NOHASHDIR="true")
        compiler = _release_build_compiler()
        if compiler:
            args += ["-C", f"cmake.define.CMAKE_CXX_COMPILER={compiler}"]
    try:
        install = subprocess.run(args + [ROOT], env=install_env, cwd=tmp_path,
                                 capture_output=True, text=True, timeout=1200)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
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


def _stub_torch_python(tmp_path, cuda):
    """An interpreter whose `torch` is a stub: a CUDA `cuda` build of 2.15 whose CMake package does
    not exist. What the configure step asks torch before looking for its package is all it
    answers."""
    stub = tmp_path / "stub"
    (stub / "torch" / "utils").mkdir(parents=True)
    (stub / "torch" / "__init__.py").write_text(textwrap.dedent(f"""
        from types import SimpleNamespace
        from . import utils
        __version__ = "2.15.0"
        _C = SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True)
        version = SimpleNamespace(cuda={cuda!r})
    """))
    (stub / "torch" / "utils" / "__init__.py").write_text(
        f"cmake_prefix_path = {str(tmp_path / 'no-such-prefix')!r}\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={stub} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_a_cuda_torch_without_a_cuda_toolkit_is_named_when_configuring(tmp_path):
    # pip's default torch is a CUDA build, whose CMake package stops without a toolkit with a
    # message about "Caffe2"; the configure step says what is missing before that.
    python = _stub_torch_python(tmp_path, "13.2")
    # No toolkit, even on a machine with one: CMake's switch that makes find_package fail.
    base = ["cmake", "-S", ROOT, "-G", "Ninja", "-DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON",
            "-DSPILLWAY_WITH_TESTS=OFF", "-DSPILLWAY_WITH_BENCH=OFF", "-DSPILLWAY_WITH_FUZZ=OFF",
            f"-DPython3_EXECUTABLE={python}"]
    # Under pip (scikit-build-core defines SKBUILD) the torch layer is the package: an error.
    pip = subprocess.run(base + ["-B", str(tmp_path / "pip"), "-DSKBUILD=ON"],
                         capture_output=True, text=True, timeout=300)
    out = " ".join((pip.stdout + pip.stderr).split())  # CMake wraps its messages' lines
    assert pip.returncode != 0, out[-3000:]
    assert "is a CUDA 13.2 build" in out and "CUDA 13.x toolkit" in out, out[-3000:]
    assert "Caffe2" not in out and "Could not find a package configuration" not in out, out[-3000:]
    # A development build goes on without the torch layer (the core and its tests need no torch).
    dev = subprocess.run(base + ["-B", str(tmp_path / "dev")], capture_output=True, text=True,
                         timeout=300)
    out = " ".join((dev.stdout + dev.stderr).split())
    assert dev.returncode == 0, out[-3000:]
    assert "is a CUDA 13.2 build" in out and "torch layer not built" in out, out[-3000:]
