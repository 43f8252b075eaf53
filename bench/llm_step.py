"""Training steps of a Llama-architecture model from transformers (random init, SDPA) under every
activation-memory configuration, at sequence lengths from where the run without offload fits to
where each configuration runs out of memory.

    python3 bench/llm_step.py --device cuda --out OUTDIR --budget-s 420   # bf16, fills the GPU
    python3 bench/llm_step.py --device sim --out OUTDIR --budget-s 60     # tiny fp32 models

The parent process runs the matrix: for each configuration in priority order, and each model,
one child process (forked from the parent, which imports torch and transformers but never touches
CUDA) that installs its allocator once and trains each sequence length in ascending order, the
model re-initialised in place with the same seed before each length, so that losses compare
bitwise across configurations. A child stops at its first out-of-memory length (the longer ones
are skipped: that is the configuration's OOM frontier) or when its share of --budget-s is spent;
none runs past --budget-s (a length then in progress is killed, its row "no time"). The parent
writes llm_step.json (every row) and llm_step.md (the tables) to --out after every job, at the end
llm_step.png (memory saved against step-time overhead, and the frontier; matplotlib optional), and
prints a summary last. On SIGTERM it stops the job in progress and writes what ran.

Configurations: PyTorch's allocator without offload (the reference; on the simulated device
Spillway's allocator is the device, without offload), full activation checkpointing,
torch.autograd.graph.save_on_cpu(pin_memory=True), torchtune's OffloadActivations, TRL's activation
offloading, PyTorch's compile-time offload (torch._functorch.config.enable_activation_offloading
with every saved tensor of at least 1 MiB marked), Spillway eager, Spillway auto at three budgets
(its default, and half and a quarter of the reference's activation memory above the step's
resident state and the weights' gradients), and Spillway eager around a checkpointed forward.
Rows whose dependency is absent say so (the CUDA-only ones are "n/a" on the simulated device,
whose memory is host memory).

Memory is read as the peak held for tensors (active bytes: allocated, or freed and awaiting a
copy still reading it): a spill's block holds memory until its bytes have crossed, and counting
it as freed at the spill (allocated bytes) would credit a slow link with memory it did not save.

On CUDA the run first measures the link (pinned D2H and H2D copies, timed with CUDA events) and
gives each row that moved bytes its physical bound, the larger of the link's, max(compute time,
bytes to the host / D2H bandwidth, bytes back / H2D bandwidth), and the peak's, max(forward time,
saved / D2H bandwidth) + max(the rest of the step, saved / H2D bandwidth), where saved is the
memory the row held below its no-offload counterpart at the peak, which must have left the device
by the end of forward and come back after it. Compute and forward times are the counterpart's
(the reference, or checkpointing for Spillway with checkpointing) at the same length: measured,
or scaled by training FLOPs from the longest length it trained (then the peak's bound is not
given). On sim the link is the simulated device's (--sim-link-mb-per-s): its copies take their
bytes over that bandwidth, so the bounds there are exact for the link.

`--one SPEC_JSON` runs one child in this process (for debugging) and prints its rows.
"""

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The parts: what they share, the child's job, its process, the report.
from llm_step_common import (  # noqa: E402
    AUTO_FRACTION, CONFIGS, GIB, HERE, HOST_OFFLOAD, LABELS, MIB, MODELS, SIM_LINK_MB_PER_S,
    WARMUP_STEPS, WEIGHT)
from llm_step_job import llama_config, run_job  # noqa: E402
from llm_step_proc import STOP, host_ram_bytes, job_window, run_forked  # noqa: E402
from llm_step_report import annotate, frontier, markdown, ok_rows, plot, summary  # noqa: E402


def run_plan(spec, emit):
    """In a child, as everything that may touch CUDA: on CUDA the link, then the models' layer
    counts and parameters (counted on the meta device). Emits {"link": ..., "models": ...}."""
    link = measure_link(spec) if spec["device"] == "cuda" else None
    models = plan_models(spec["device"], spec["names"], link and link["device_total"],
                         spec["fill"], spec["seqs_override"])
    emit({"link": link, "models": models})


def measure_link(spec):
    """The device's memory, then pinned D2H and H2D bandwidth with torch, timed with CUDA events
    (PyTorch's allocator). A failed bandwidth measurement is reported (link["error"]), not
    fatal: the matrix runs without the rows' bounds."""
    import torch

    free, total = torch.cuda.mem_get_info()
    result = {"device_name": torch.cuda.get_device_name(), "device_total": total,
              "device_free": free}
    try:
        result.update(measure_bandwidth(torch, spec.get("link_bytes", GIB)))
    except Exception as error:  # noqa: BLE001 - the benchmark goes on without the bounds
        traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {str(error).strip()[:200]}"
    return result


def measure_bandwidth(torch, size):
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    host.fill_(1)
    dev.fill_(2)
    result = {"link_bytes": size}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(6):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        best = min(times[1:])
        result[f"{name}_gbps"] = size / best / 1e9
        result[f"{name}_median_gbps"] = size / statistics.median(times[1:]) / 1e9
    del host, dev
    return result


# --------------------------------------------------------------------------------------------
# The parent: the matrix, the time budget, the tables and the plot.
# --------------------------------------------------------------------------------------------

def count_params(model, layers):
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        m = LlamaForCausalLM(llama_config(dict(model, layers=layers), 128))
    return sum(p.numel() for p in m.parameters())


def plan_models(device, names, device_total, fill, seqs_override):
    """The models of this run, with their layer counts ("fill": weights, gradients and AdamW's two
    states in bf16, 8 bytes a parameter, within `fill` of the GPU's memory) and parameters."""
    models = {}
    for name in names:
        m = dict(MODELS[device][name])
        if m["layers"] == "fill":
            one, two = count_params(m, 1), count_params(m, 2)
            per_layer, rest = two - one, one - (two - one)
            m["layers"] = max(1, int((fill * device_total / 8 - rest) // per_layer))
            m["label"] += f" ({m['layers']} on this GPU: state <= {fill:.2f} of its memory)"
        m["params"] = count_params(m, m["layers"])
        if name in seqs_override:
            m["seqs"] = seqs_override[name]
        models[name] = m
    return models


def availability(device, config):
    """Why a configuration cannot run here, before any process starts (None: it may)."""
    import importlib.util

    if config in HOST_OFFLOAD and device == "sim":
        extra = ""
        if config in ("torchtune", "trl") and importlib.util.find_spec(config) is None:
            extra = f"; {config} is not installed either"
        return ("n/a on the simulated device: its memory is host memory, so there is no host "
                "to offload to" + extra)
    if config in ("torchtune", "trl") and importlib.util.find_spec(config) is None:
        return f"not installed: no {config} package in this Python"
    if config == "compile_offload":
        import torch._functorch.config as fc

        if not hasattr(fc, "enable_activation_offloading"):
            import torch

            return (f"n/a: torch {torch.__version__} has no compile-time activation offloading "
                    "(torch._functorch.config.enable_activation_offloading)")
    return None


def activation_estimate(rows, model, seq, gradients=0):
    """The reference's activation memory (peak allocated above the step's resident state, less
    `gradients`: the weights' gradients, which no offload of saved tensors moves and which do not
    grow with the length) at `seq`: measured, or proportional to the length from the longest
    length it trained, or from Spillway eager's bytes to the host when the reference trained
    none. (estimate, basis)."""
    ref = ok_rows(rows, model, "pytorch")
    if seq in ref:
        r = ref[seq]
        return max(r["peak_allocated"] - r["base_allocated"] - gradients, 0), "measured"
    if ref:
        s = max(ref)
        r = ref[s]
        act = max(r["peak_allocated"] - r["base_allocated"] - gradients, 0)
        return act * seq / s, f"scaled from {s}"
    eager = ok_rows(rows, model, "spillway_eager")
    if eager:
        s = max(eager)
        return eager[s]["to_host_per_step"] * seq / s, f"eager's spills at {s}, scaled"
    return None, "none"


def resident_estimate(rows, model, models):
    """The allocated bytes at a step's start (weights and AdamW's states): the reference's, else
    three times the weights' bytes."""
    for r in rows:
        if r["model"] == model and r.get("base_allocated") is not None:
            return r["base_allocated"]
    m = models[model]
    return 3 * m["params"] * m["dtype_bytes"]


def host_bytes_estimate(rows, model, models, config, seq, host_limit):
    """The pinned host memory a host-offload peer would take at `seq`: Spillway eager's bytes to
    the host (what a hook-based offload copies), measured at `seq` or proportional from its
    longest length that stayed clear of its host_limit_mb; else the reference's activation
    memory (which also counts the gradients and the loss's temporaries, so it is high).
    save_on_cpu also copies every weight a layer saves (its hook sees the parameters, which
    torchtune's and TRL's skip). (estimate, basis)."""
    eager = {s: r for s, r in ok_rows(rows, model, "spillway_eager").items()
             if r.get("to_host_per_step") and (r.get("host_peak") or 0) < 0.9 * host_limit}
    if seq in eager:
        act, basis = eager[seq]["to_host_per_step"], "Spillway eager's bytes to the host"
    elif eager:
        s = max(eager)
        act = eager[s]["to_host_per_step"] * seq / s
        basis = f"Spillway eager's bytes to the host at {s}, scaled"
    else:
        act, basis = activation_estimate(rows, model, seq)
        basis = f"the reference's activation memory, {basis}"
    if act is not None and config == "save_on_cpu":
        m = models[model]
        weights = m["params"] * m["dtype_bytes"]
        act += weights
        basis += f", and {weights / GIB:.1f} GiB of weights"
    return act, basis


def job_spec(args, models, model_name, config, rows, link, host_ram, deadline):
    m = models[model_name]
    host_limit = int(args.host_fraction * host_ram) // MIB
    spec = dict(device=args.device, config=config, model_name=model_name, model=m,
                seqs=m["seqs"], steps=args.steps, seed=args.seed, deadline=deadline,
                deterministic=args.deterministic, skip={}, budgets={},
                link_d2h_gbps=(link or {}).get("d2h_gbps"),
                device_free=(link or {}).get("device_free"), host_limit_mb=host_limit,
                sim_link_mb_per_s=args.sim_link_mb_per_s)
    if config in AUTO_FRACTION:
        # Above the step's resident state and the weights' gradients: backward holds both at its
        # end whatever is spilled, so a budget below them cannot be kept (the simulated device's
        # quarter budget was 15.0 MiB against 15.5 of them, and auto spent its link on prefetches
        # given back and reloaded; docs/benchmarks.md).
        base = resident_estimate(rows, model_name, models)
        gradients = m["params"] * m["dtype_bytes"]
        for seq in m["seqs"]:
            act, basis = activation_estimate(rows, model_name, seq, gradients)
            if act is None:
                capacity = (m["capacity_mb"] * MIB if args.device == "sim"
                            else link["device_total"])
                act, basis = capacity - base - gradients, "device memory (no reference)"
            spec["budgets"][str(seq)] = int(base + gradients + AUTO_FRACTION[config] * max(act, 0))
            spec.setdefault("budget_basis", {})[str(seq)] = (
                f"{basis}, above the resident state and {gradients / MIB:.0f} MiB of gradients")
    if config in HOST_OFFLOAD and args.device == "cuda":
        cap = args.host_fraction * host_ram
        for seq in m["seqs"]:
            act, basis = host_bytes_estimate(rows, model_name, models, config, seq,
                                             host_limit * MIB)
            if act is None:
                spec["skip"][str(seq)] = ("no estimate of its activation bytes (the reference "
                                          "and Spillway eager trained no length), so nothing "
                                          "bounds the pinned host memory it would take")
            elif act > cap:
                spec["skip"][str(seq)] = (
                    f"host-memory cap: about {act / GIB:.1f} GiB ({basis}) would be pinned, "
                    f"over {args.host_fraction:.2f} of the host's {host_ram / GIB:.0f} GiB")
    return spec


def write_outputs(args, meta, rows, models, configs, t0, final):
    """llm_step.json and llm_step.md from the rows so far (after every job, so that a run cut
    short keeps them); at the end also the plot and the summary, printed last. Each part that
    fails (the plot without matplotlib, say) is reported, and the others are written all the
    same: the rows of a run that had one try come back whatever the report makes of them."""
    def attempt(what, fn):
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - the other parts still get written
            traceback.print_exc()
            return f"no {what} ({type(error).__name__}: {str(error).strip()[:120]})"

    # The link the bounds use: measured on CUDA, the simulated device's as configured on sim.
    front = attempt("frontier", lambda: (annotate(rows, models, meta.get("link")),
                                         frontier(rows, models, configs))[1])
    if isinstance(front, str):
        front = []
    meta["elapsed_s"] = time.time() - t0
    meta["configs"] = [{"name": c, "label": LABELS[c]} for c in configs]
    with open(os.path.join(args.out, "llm_step.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "frontier": front}, f, indent=1, default=str)

    def write_markdown():
        text = markdown(meta, rows, models, front)
        with open(os.path.join(args.out, "llm_step.md"), "w") as f:
            f.write(text)
        return "llm_step.md"
    md = attempt("llm_step.md", write_markdown)
    if not final:
        return
    png = attempt("llm_step.png", lambda: os.path.basename(
        plot(meta, rows, models, front, os.path.join(args.out, "llm_step.png"))))
    text = attempt("summary", lambda: summary(meta, rows, models, front))
    print()
    print(text if text.startswith("llm_step summary") else f"llm_step summary: {text}")
    print(f"\nwritten: {args.out}/llm_step.json, {md}, {png}; logs in "
          f"{os.path.join(args.out, 'logs')}/", flush=True)


def parent(args):
    t0 = time.time()
    deadline = t0 + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)

    def stop(signum, frame):
        STOP.setdefault("why", f"stopped by signal {signum} after {time.time() - t0:.0f} s")
    # The script's timeout (gpu_bench.sh) sends SIGTERM: the rows so far are written all the same.
    signal.signal(signal.SIGTERM, stop)
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # torch.cuda.is_available() (transformers calls it) then asks NVML instead of initialising
    # the CUDA driver, which a forked child could not use afterwards.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    # Models come from configurations, never the Hub: on the GPU machine, which has no network,
    # nothing may wait on a connection (transformers' hub kernels, telemetry).
    for var in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    import torch
    import transformers
    from transformers import LlamaForCausalLM  # imported once here, for every child

    host_ram = host_ram_bytes()
    meta = {"device": args.device, "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "model_class": f"transformers.{LlamaForCausalLM.__name__}, attn_implementation "
                           "sdpa, random init",
            "steps": args.steps, "budget_s": args.budget_s, "host_ram": host_ram,
            "host_fraction": args.host_fraction, "seed": args.seed,
            "determinism": args.deterministic if args.device == "cuda" else "n/a (CPU)"}
    seqs_override = {}
    for item in args.seqs or []:
        name, _, values = item.partition(":")
        seqs_override[name] = [int(v) for v in values.split(",")]
    plan_spec = {"device": args.device, "names": args.models, "fill": args.fill,
                 "seqs_override": seqs_override}
    got, ended = run_forked(run_plan, plan_spec, max(1.0, min(180, deadline - time.time())),
                            os.path.join(logs, "plan.log"))
    if not got:
        try:  # its cause, for gpu_bench.sh's summary line
            with open(os.path.join(logs, "plan.log")) as f:
                cause = " / ".join(line.strip() for line in f.readlines()[-2:])
        except OSError:
            cause = ""
        sys.exit(f"llm_step: the plan (link, models) failed: {cause} ({ended}; "
                 f"{logs}/plan.log)")
    link, models = got[0]["link"], got[0]["models"]
    if link is not None:
        meta["link"] = link
        meta["device_name"] = link["device_name"]
        bandwidth = (f"pinned D2H {link['d2h_gbps']:.1f} GB/s, H2D {link['h2d_gbps']:.1f} GB/s"
                     if "d2h_gbps" in link else
                     f"the link's bandwidth not measured: {link.get('error')}")
        print(f"[{time.time() - t0:.0f} s] {link['device_name']}, "
              f"{link['device_total'] / GIB:.1f} GiB; {bandwidth}", flush=True)
    else:
        meta["device_name"] = "simulated device (host CPU)"
        # The simulated device's copies take their bytes over this bandwidth: the bound is exact
        # for the link, not measured.
        gbps = args.sim_link_mb_per_s * MIB / 1e9
        meta["link"] = ({"sim_link_mb_per_s": args.sim_link_mb_per_s, "d2h_gbps": gbps,
                         "h2d_gbps": gbps} if gbps else
                        {"reason": "none: the simulated device's link is unlimited "
                                   "(--sim-link-mb-per-s 0), so no bound is given"})
    for item in args.capacity_mb or []:
        name, _, value = item.partition(":")
        if name in models:
            models[name]["capacity_mb"] = int(value)
    for m in models.values():
        m["dtype_bytes"] = 2 if args.device == "cuda" else 4
    meta["models"] = models
    configs = [c for c, _ in CONFIGS if c in args.configs]
    for name, m in models.items():
        print(f"model {name}: {m['params'] / 1e9:.3f} B parameters, {m['layers']} layers, "
              f"lengths {m['seqs']}", flush=True)

    # Pinned memory cannot be swapped: a job that leaves less than this available is killed.
    host_guard = max(8 * GIB, int(0.08 * host_ram)) if args.device == "cuda" else 0
    rows = []
    jobs = [(c, name) for c in configs for name in models]
    for i, (config, name) in enumerate(jobs):
        if STOP:
            break
        why = availability(args.device, config)
        if why:
            rows.append({"model": name, "config": config, "seq": None, "status": "unavailable",
                         "reason": why})
            print(f"[{time.time() - t0:.0f} s] {config} / {name}: {why}", flush=True)
            continue
        left = deadline - time.time()
        rest = [(c, n) for c, n in jobs[i:] if not availability(args.device, c)]
        # Its weighted part of what is left, or, when more, all of it but the least each later
        # job needs: the jobs that come first matter most.
        share = max(left * WEIGHT.get(config, 1.0) / sum(WEIGHT.get(c, 1.0) for c, _ in rest),
                    left - args.min_job_s * (len(rest) - 1))
        if share < args.min_job_s:
            for seq in models[name]["seqs"]:
                rows.append({"model": name, "config": config, "seq": seq, "status": "no_time",
                             "reason": f"{left:.0f} s of the budget left for {len(rest)} jobs"})
            print(f"[{time.time() - t0:.0f} s] {config} / {name}: no time", flush=True)
            continue
        job_deadline, kill_at = job_window(time.time(), deadline, share, args.grace_s)
        spec = job_spec(args, models, name, config, rows, link, host_ram, job_deadline)
        got, ended = run_forked(run_job, spec, kill_at - time.time(),
                                os.path.join(logs, f"{name}.{config}.log"), host_guard)
        got = settle(got, ended, spec, name, config)
        rows += got
        brief = ", ".join(f"{r['seq']}:{r['status']}" for r in got)
        print(f"[{time.time() - t0:.0f} s] {config} / {name}: {brief}"
              + (f" ({ended})" if ended else ""), flush=True)
        write_outputs(args, meta, rows, models, configs, t0, final=False)
    if STOP:
        meta["stopped"] = STOP["why"]
        print(f"[{time.time() - t0:.0f} s] llm_step: {STOP['why']}; writing what ran",
              flush=True)
        for config, name in jobs:
            if not any(r["model"] == name and r["config"] == config for r in rows):
                rows += [{"model": name, "config": config, "seq": seq, "status": "no_time",
                          "reason": STOP["why"]} for seq in models[name]["seqs"]]
    write_outputs(args, meta, rows, models, configs, t0, final=True)
    if STOP:
        sys.exit(124)


def settle(got, ended, spec, name, config):
    """A job's rows, with a row for each length it did not report: the first one that took the
    host's memory (as out of memory), those past its first out-of-memory or error (skipped),
    and the rest (no time when it was killed for time, else an error), in length order."""
    done = {r["seq"] for r in got}
    if ended and "host's available memory" in ended:
        # The length in progress took the host's memory: its frontier, as for the device.
        seq = next((q for q in spec["seqs"] if q not in done), None)
        if seq is not None:
            got.append({"model": name, "config": config, "seq": seq, "status": "oom",
                        "reason": f"host memory: {ended}"})
            done.add(seq)
    stop = next((r for r in got if r["status"] in ("oom", "error")), None)
    for seq in spec["seqs"]:
        if seq in done or any(r["seq"] is None for r in got):
            continue
        if stop is not None and seq > stop["seq"]:
            got.append({"model": name, "config": config, "seq": seq, "status": "skipped",
                        "reason": f"beyond the first {stop['status']} at {stop['seq']}"})
        else:
            killed = ended is not None and ended.startswith(("killed after", "stopped by"))
            got.append({"model": name, "config": config, "seq": seq,
                        "status": "no_time" if killed else "error",
                        "reason": ended or "the job ended without a row for this length"})
    got.sort(key=lambda r: (r["seq"] is not None, r["seq"] or 0))
    return got


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("sim", "cuda"), required=True)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "out", "llm_step"))
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of the whole matrix (default: 60 on sim, 420 on "
                        "cuda)")
    parser.add_argument("--steps", type=int, default=4,
                        help=f"steps per length, the first {WARMUP_STEPS} warm-up (fewer with 2 "
                        "or 1 step; default 4)")
    parser.add_argument("--models", nargs="+", default=None, help="default: every model")
    parser.add_argument("--configs", nargs="+", default=[c for c, _ in CONFIGS],
                        choices=[c for c, _ in CONFIGS])
    parser.add_argument("--seqs", nargs="+", default=None, metavar="MODEL:L1,L2,...",
                        help="other sequence lengths for a model")
    parser.add_argument("--capacity-mb", nargs="+", default=None, metavar="MODEL:MIB",
                        help="another simulated-device capacity for a model (sim)")
    parser.add_argument("--fill", type=float, default=0.85,
                        help="llama-w4096's layers: weights, gradients and AdamW's states within "
                        "this fraction of the GPU's memory")
    parser.add_argument("--host-fraction", type=float, default=0.3,
                        help="pinned host memory allowed: Spillway's host_limit_mb, and the "
                        "estimated activation bytes above which the host-offload peers skip a "
                        "length (their pinned pool can round up to twice that)")
    parser.add_argument("--sim-link-mb-per-s", type=int, default=None,
                        help="the simulated device's link to the host, MiB/s each way (its copies "
                        f"take their bytes over it; 0: unlimited; default {SIM_LINK_MB_PER_S} on "
                        "sim): the rows' bounds use it")
    parser.add_argument("--deterministic", choices=("strict", "warn", "off"), default="strict",
                        help="torch.use_deterministic_algorithms on CUDA (strict: the "
                        "flash-attention backward too, so that losses compare bitwise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-job-s", type=float, default=None,
                        help="a job with less time than this is not started (default 3 on sim, "
                        "25 on cuda)")
    parser.add_argument("--grace-s", type=float, default=None,
                        help="how long past its share a job may run before it is killed "
                        "(default 5 on sim, 20 on cuda)")
    parser.add_argument("--one", default=None, metavar="SPEC_JSON",
                        help="run one job in this process and print its rows (debugging)")
    args = parser.parse_args()
    if args.one:
        run_job(json.loads(args.one), lambda row: print(json.dumps(row), flush=True))
        return
    sim = args.device == "sim"
    if args.budget_s is None:
        args.budget_s = 60 if sim else 420
    if args.sim_link_mb_per_s is None:
        args.sim_link_mb_per_s = SIM_LINK_MB_PER_S if sim else 0
    elif not sim:
        parser.error("--sim-link-mb-per-s applies to --device sim only (on CUDA the link is "
                     "measured)")
    elif not 0 <= args.sim_link_mb_per_s <= 10_000_000:
        parser.error("--sim-link-mb-per-s takes an integer from 0 to 10000000 (MiB/s; 0 = "
                     "unlimited)")
    if args.min_job_s is None:
        args.min_job_s = 3 if sim else 25
    if args.grace_s is None:
        args.grace_s = 5 if sim else 20
    if args.models is None:
        args.models = list(MODELS[args.device])
    unknown = [m for m in args.models if m not in MODELS[args.device]]
    if unknown:
        parser.error(f"unknown model(s) {unknown}: {', '.join(MODELS[args.device])}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    parent(args)


if __name__ == "__main__":
    main()
