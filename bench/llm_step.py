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
are skipped: that is the configuration's OOM frontier) or when its share of --budget-s is spent.
The parent writes llm_step.json (every row), llm_step.md (the tables) and llm_step.png (memory
saved against step-time overhead, and the frontier) to --out, and prints a summary last.

Configurations: PyTorch's allocator without offload (the reference; on the simulated device
Spillway's allocator is the device, without offload), full activation checkpointing,
torch.autograd.graph.save_on_cpu(pin_memory=True), torchtune's OffloadActivations, TRL's activation
offloading, PyTorch's compile-time offload (torch._functorch.config.enable_activation_offloading
with every saved tensor of at least 1 MiB marked), Spillway eager, Spillway auto at three budgets
(its default, and half and a quarter of the reference's activation memory above the step's
resident state), and Spillway eager around a checkpointed forward. Rows whose dependency is absent
say so (the CUDA-only ones are "n/a" on the simulated device, whose memory is host memory).

On CUDA the run first measures the link (pinned D2H and H2D copies, timed with CUDA events) and
gives each row that moved bytes its physical bound, max(compute time, bytes to the host /
D2H bandwidth, bytes back / H2D bandwidth), the compute time being that of the configuration's
no-offload counterpart (the reference, or checkpointing for Spillway with checkpointing) at the
same length: measured, or scaled by training FLOPs from the longest length it trained. Spillway
exposes no way to time the simulated device's copies, so on sim the link and bounds are n/a.

`--one SPEC_JSON` runs one child in this process (for debugging) and prints its rows.
"""

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import select
import signal
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30
MIB = 1 << 20

# (name, label), in the order the time budget serves them: what a cut budget loses comes last.
CONFIGS = [
    ("pytorch", "PyTorch allocator, no offload (reference)"),
    ("spillway_eager", "Spillway eager"),
    ("spillway_auto", "Spillway auto, default budget"),
    ("checkpoint", "full activation checkpointing"),
    ("save_on_cpu", "save_on_cpu(pin_memory=True)"),
    ("spillway_ckpt", "Spillway eager + checkpointing"),
    ("spillway_auto_half", "Spillway auto, 1/2 of the activations"),
    ("torchtune", "torchtune OffloadActivations"),
    ("trl", "TRL activation offloading"),
    ("spillway_auto_quarter", "Spillway auto, 1/4 of the activations"),
    ("compile_offload", "torch.compile activation offloading"),
]
LABELS = dict(CONFIGS)
SPILLWAY = ("spillway_eager", "spillway_auto", "spillway_auto_half", "spillway_auto_quarter",
            "spillway_ckpt")
AUTO_FRACTION = {"spillway_auto_half": 0.5, "spillway_auto_quarter": 0.25}
HOST_OFFLOAD = ("save_on_cpu", "torchtune", "trl", "compile_offload")  # copy to host memory
CHECKPOINTED = ("checkpoint", "spillway_ckpt")
# Shares of the time budget: the reference runs every length until it runs out of memory, and
# compiling costs minutes.
WEIGHT = {"pytorch": 2.0, "spillway_eager": 1.5, "spillway_auto": 1.5, "compile_offload": 1.5}

# The real models (CUDA, bf16) and their simulated-device analogues (fp32, tiny). "layers": "fill"
# stacks decoder layers until weights, gradients and AdamW's two states take --fill of the GPU.
MODELS = {
    "cuda": {
        "llama-w4096": dict(
            label="Llama-3-8B shape (width 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256), "
                  "as many layers as fit",
            hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, layers="fill", tie_word_embeddings=False,
            batch=1, seqs=[1024, 2048, 4096, 8192]),
        "llama-1b": dict(
            label="Llama-3.2-1B shape (width 2048, 16 layers, MLP 8192, vocab 128256, tied)",
            hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, layers=16, tie_word_embeddings=True,
            batch=1, seqs=[8192, 16384, 32768, 65536]),
    },
    "sim": {
        "llama-w4096": dict(
            label="simulated-device analogue: width 128, 4 layers, MLP 448, vocab 512",
            hidden_size=128, intermediate_size=448, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, layers=4, tie_word_embeddings=False,
            batch=2, seqs=[64, 128, 256, 512, 1024], capacity_mb=32),
        "llama-1b": dict(
            label="simulated-device analogue: width 64, 2 layers, MLP 256, vocab 4096, tied",
            hidden_size=64, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, layers=2, tie_word_embeddings=True,
            batch=2, seqs=[64, 128, 256, 512], capacity_mb=34),
    },
}


# The smallest saved tensor the compile-time offload row marks (Spillway's default minimum too).
COMPILE_MIN_BYTES = MIB


class Unavailable(Exception):
    """A configuration that cannot run here: its package is missing, or it has no meaning."""


# --------------------------------------------------------------------------------------------
# The child: one configuration, one model, each sequence length in turn.
# --------------------------------------------------------------------------------------------

def llama_config(model, seq_max):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=model["hidden_size"], intermediate_size=model["intermediate_size"],
        num_hidden_layers=model["layers"], num_attention_heads=model["num_attention_heads"],
        num_key_value_heads=model["num_key_value_heads"], vocab_size=model["vocab_size"],
        tie_word_embeddings=model["tie_word_embeddings"], max_position_embeddings=seq_max,
        attn_implementation="sdpa", use_cache=False)


def init_weights(model, seed, torch):
    """Seeded, in place, in parameter order: the same weights in every process and every length
    (matrices N(0, 0.02), norm weights 1)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def is_oom(error):
    import torch

    if isinstance(error, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text
                                                or "CUBLAS_STATUS_ALLOC_FAILED" in text)


class CountingHooks:
    """Counts the bytes a hook-based peer (save_on_cpu, torchtune, TRL) copies to the host and
    back, by wrapping its pack and unpack hooks: those peers keep no such counter."""

    def __init__(self, ctx, kind):
        self.ctx, self.kind = ctx, kind
        self.to_host = self.to_device = 0
        pack, unpack = ctx.pack_hook, ctx.unpack_hook
        ctx.pack_hook = self._pack(pack)
        ctx.unpack_hook = self._unpack(unpack)

    def _moved(self, packed):
        """Bytes held on the host for this packed value (0: kept on the device)."""
        if self.kind == "save_on_cpu":
            device, tensor = packed
            return tensor.nbytes if device.type == "cuda" else 0
        entry = self.ctx.tracker.get(packed)  # torchtune and TRL: id -> (tensor, offloaded, ...)
        return entry[0].nbytes if entry is not None and entry[1] else 0

    def _pack(self, pack):
        def wrapped(tensor):
            packed = pack(tensor)
            self.to_host += self._moved(packed)
            return packed
        return wrapped

    def _unpack(self, unpack):
        def wrapped(packed):
            moved = self._moved(packed)
            # torchtune and TRL hand back a tensor still in their forward stash without a copy.
            stash = getattr(self.ctx, "fwd_stash", None)
            if self.kind != "save_on_cpu" and stash is not None and packed in stash:
                moved = 0
            self.to_device += moved
            return unpack(packed)
        return wrapped


def peer_context(config, model, torch):
    """The context factory (called once per sequence length) of a hook-based peer, and the
    object that counts its copies."""
    if config == "save_on_cpu":
        def make():
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
            return ctx, CountingHooks(ctx, config)
        return make
    if config == "torchtune":
        try:
            from torchtune.training import NoOpManager, OffloadActivations
        except Exception as error:  # noqa: BLE001 - any import failure makes the row n/a
            raise Unavailable(f"torchtune does not import: {type(error).__name__}: {error}")

        # As torchtune's get_act_offloading_ctx_manager does for its own models' output layer:
        # the LM head's input is reloaded at once in backward, so it stays.
        noop = NoOpManager()
        model.lm_head.register_forward_pre_hook(lambda *args: noop.__enter__())
        model.lm_head.register_forward_hook(lambda *args: noop.__exit__(), always_call=True)

        def make():
            ctx = OffloadActivations(use_pin_memory=True)
            return ctx, CountingHooks(ctx, config)
        return make
    if config == "trl":
        try:
            from trl.models.activation_offloading import get_act_offloading_ctx_manager
        except Exception as error:  # noqa: BLE001
            raise Unavailable(f"trl does not import: {type(error).__name__}: {error}")
        state = {}

        def make():
            # It hooks the LM head (kept on the device, as torchtune's helper does): one context
            # per model, its counters zeroed for each length.
            if "pair" not in state:
                ctx = get_act_offloading_ctx_manager(model, use_pin_memory=True)
                state["pair"] = (ctx, CountingHooks(ctx, config))
            counting = state["pair"][1]
            counting.to_host = counting.to_device = 0
            return state["pair"]
        return make
    raise ValueError(config)


def setup_compile_offload(model, link_gbps, torch):
    """PyTorch's compile-time offload: every decoder layer compiled, every saved tensor of at least
    1 MiB marked for offloading (the partitioner keeps the eligible ones: saved, not views, not
    model outputs, contiguous), separate stream, sunk waits and reload prefetch where this torch
    has them."""
    import torch._functorch.config as fc

    for key in ("enable_activation_offloading", "joint_custom_pass"):
        if not hasattr(fc, key):
            raise Unavailable(f"this torch ({torch.__version__}) has no "
                              f"torch._functorch.config.{key}")

    def mark(gm, joint_inputs):
        for node in gm.graph.nodes:
            val = node.meta.get("val") if node.op == "call_function" else None
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                nbytes = val.numel() * val.element_size()
                # Symbolic (a dynamic length): a long sequence's.
                if not isinstance(nbytes, int) or nbytes >= COMPILE_MIN_BYTES:
                    node.meta["should_offload"] = True
        return gm

    settings = {"enable_activation_offloading": True, "joint_custom_pass": mark}
    for key in ("activation_offload_separate_stream", "activation_offload_sink_wait",
                "activation_reload_prefetch"):
        if hasattr(fc, key):
            settings[key] = True
    if hasattr(fc, "activation_offload_cpu_gpu_bw") and link_gbps:
        settings["activation_offload_cpu_gpu_bw"] = float(link_gbps)
    for key, value in settings.items():
        setattr(fc, key, value)
    import torch._dynamo

    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(64, getattr(torch._dynamo.config, key)))
    for layer in model.model.layers:
        layer.compile()
    return sorted(k for k in settings if k != "joint_custom_pass")


def run_job(spec, emit):
    """One configuration on one model: emits one row per sequence length (ok, oom, no_time, or
    error), stopping at the first length that runs out of memory."""
    device, config = spec["device"], spec["config"]
    model_spec = spec["model"]
    seqs = spec["seqs"]
    common = {"model": spec["model_name"], "config": config}
    if device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    uses_spillway = device == "sim" or config in SPILLWAY
    spillway = None
    if uses_spillway:
        import spillway

        if device == "sim":
            spillway.install("sim", capacity_bytes=model_spec["capacity_mb"] * MIB)
        else:
            # Spilled bytes are capped like the peers' lengths: host RAM is smaller than the GPU.
            spillway.install("cuda", conf=f"host_limit_mb:{spec['host_limit_mb']}")
    import torch
    from transformers import LlamaForCausalLM

    dev = "cuda" if device == "cuda" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "sim":
        # One intra-op thread: OpenMP's spinning barriers make two threads on a loaded 2-core
        # machine several times slower and erratic (every configuration runs the same way).
        torch.set_num_threads(1)
    determinism = "n/a (CPU)"
    if device == "cuda" and spec.get("deterministic", "strict") != "off":
        # The flash-attention backward is deterministic only in strict mode (warn_only leaves it
        # atomic): without it two runs of the same configuration differ in the last bits.
        strict = spec.get("deterministic", "strict") == "strict"
        torch.use_deterministic_algorithms(True, warn_only=not strict)
        determinism = "strict" if strict else "warn_only"
    elif device == "cuda":
        determinism = "off"

    def stats():
        if uses_spillway:
            return spillway.memory_stats()
        return torch.cuda.memory_stats()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
        elif spillway is not None:
            spillway.synchronize()

    def empty_and_reset():
        gc.collect()
        if uses_spillway:
            spillway.synchronize()
            spillway.empty_cache()
            spillway.reset_peak_stats()
        else:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def host_peak():
        if uses_spillway:
            return stats().get("spillway.host_bytes.peak")
        fn = getattr(torch.cuda, "host_memory_stats", None)
        if fn is None:
            return None
        try:
            s = fn()
        except Exception:  # noqa: BLE001 - an older torch's host stats: leave the field empty
            return None
        for key in ("reserved_bytes.peak", "reserved_bytes.all.peak", "allocated_bytes.peak",
                    "allocated_bytes.all.peak"):
            if key in s:
                return s[key]
        return None

    start_build = time.perf_counter()
    cfg = llama_config(model_spec, max(seqs))
    try:
        with torch.device(dev):
            model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - the model alone does not fit: every length
        traceback.print_exc()
        for seq in seqs:
            emit(dict(common, seq=seq, status="oom" if is_oom(error) else "error",
                      reason=f"building the model: {type(error).__name__}: "
                             f"{str(error).strip()[:300]}"))
            if is_oom(error):
                break
        return
    model.train()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if config in CHECKPOINTED:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    notes = []
    make_peer = None
    try:
        if config in ("save_on_cpu", "torchtune", "trl"):
            make_peer = peer_context(config, model, torch)
        elif config == "compile_offload":
            flags = setup_compile_offload(model, spec.get("link_d2h_gbps"), torch)
            notes.append("compile flags: " + ", ".join(flags))
    except Unavailable as why:
        emit(dict(common, seq=None, status="unavailable", reason=str(why)))
        return
    build_s = time.perf_counter() - start_build

    min_bytes = 0 if device == "sim" else None  # the tiny models' saves are below 1 MiB
    last = None  # (seq, seconds) of the previous length, for the next one's estimate
    for i, seq in enumerate(seqs):
        row = dict(common, seq=seq, batch=model_spec["batch"], param_bytes=param_bytes,
                   determinism=determinism, build_s=round(build_s, 3), notes=list(notes))
        if str(seq) in spec.get("budget_basis", {}):
            row["budget_basis"] = spec["budget_basis"][str(seq)]
        skip = spec.get("skip", {}).get(str(seq))
        if skip:
            emit(dict(row, status="skipped", reason=skip))
            continue
        if last is not None:
            # Time grows between linearly and quadratically with the length.
            guess = last[1] * (seq / last[0]) ** 1.5
            if time.time() + guess > spec["deadline"]:
                for s in seqs[i:]:
                    emit(dict(common, seq=s, status="no_time",
                              reason=f"the job's time share ends in "
                                     f"{max(0, spec['deadline'] - time.time()):.0f} s; this "
                                     f"length needs about {guess:.0f} s"))
                return
        started = time.time()
        budget = spec.get("budgets", {}).get(str(seq))
        try:
            try:
                result = train_length(torch, model, spec, seq, dev, config, make_peer, budget,
                                      min_bytes, stats, sync, spillway)
            except RuntimeError as error:
                if determinism != "strict" or "deterministic" not in str(error):
                    raise
                # An operation without a deterministic kernel: the rest of this job runs with
                # warnings instead, and says so (its losses may then differ in the last bits).
                traceback.print_exc()
                torch.use_deterministic_algorithms(True, warn_only=True)
                determinism = "warn_only (strict raised: " + str(error).splitlines()[0][:200] + ")"
                row["determinism"] = determinism
                model.zero_grad(set_to_none=True)
                empty_and_reset()
                result = train_length(torch, model, spec, seq, dev, config, make_peer, budget,
                                      min_bytes, stats, sync, spillway)
            row.update(result, status="ok")
            row["host_peak"] = host_peak()
        except Exception as error:  # noqa: BLE001 - reported per length, the matrix goes on
            oom = is_oom(error)
            row.update(status="oom" if oom else "error",
                       reason=f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
                       if str(error).strip() else type(error).__name__)
            if not oom:
                traceback.print_exc()
            if budget is not None:
                row["budget"] = budget
            emit(row)
            return  # the longer lengths are past this configuration's frontier (or broken)
        finally:
            try:
                model.zero_grad(set_to_none=True)
                empty_and_reset()
            except Exception:  # noqa: BLE001 - after an error the row says what happened
                traceback.print_exc()
        last = (seq, time.time() - started)
        emit(row)


def train_length(torch, model, spec, seq, dev, config, make_peer, budget, min_bytes, stats, sync,
                 spillway):
    steps = spec["steps"]
    batch = spec["model"]["batch"]
    vocab = spec["model"]["vocab_size"]
    init_weights(model, spec["seed"], torch)
    fused = {"fused": True} if dev == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    gen = torch.Generator().manual_seed(spec["seed"] + seq)
    tokens = [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps)]

    if config in SPILLWAY:
        policy = "auto" if config.startswith("spillway_auto") else "eager"
        block = spillway.offload(policy, budget_bytes=budget, min_bytes=min_bytes)

        def forward_context():
            return block
    elif make_peer is not None:
        holder = {}

        def forward_context():
            ctx, counting = holder.get("pair") or make_peer()
            holder["pair"] = (ctx, counting)
            return ctx
    else:
        def forward_context():
            return contextlib.nullcontext()

    def counters():
        if config in SPILLWAY:
            s = stats()
            return (s["spillway.bytes_to_host"], s["spillway.bytes_to_device"],
                    s["spillway.stall_us"] / 1e6, s["spillway.num_spills"])
        if make_peer is not None and "pair" in holder:
            c = holder["pair"][1]
            return (c.to_host, c.to_device, None, None)
        return (None, None, None, None)

    losses, times, bases = [], [], []
    before = None
    for step in range(steps):
        if step == 1:  # the first step is warm-up: lazy initialisation, AdamW's states, caches
            sync()
            if spillway is not None:
                spillway.reset_peak_stats()
            else:
                torch.cuda.reset_peak_memory_stats()
            before = counters()
        ids = tokens[step].to(dev)
        sync()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        bases.append(stats()["allocated_bytes.all.current"])
        with forward_context():
            out = model(input_ids=ids, labels=ids)
            loss = out.loss
            del out
        loss.backward()
        optimizer.step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        del loss, ids
    after = counters()
    s = stats()
    timed = times[1:] if len(times) > 1 else times
    n = len(timed)
    median = statistics.median(timed)
    result = dict(
        losses=losses, step_times=[round(t, 6) for t in times], median_step_s=median,
        tokens_per_s=batch * seq / median, peak_allocated=s["allocated_bytes.all.peak"],
        peak_reserved=s["reserved_bytes.all.peak"], base_allocated=bases[-1])
    if steps == 1:
        before = (0, 0, 0.0, 0) if after[0] is not None else (None,) * 4
    if after[0] is not None and before[0] is not None:
        result["to_host_per_step"] = (after[0] - before[0]) / n
        result["to_device_per_step"] = (after[1] - before[1]) / n
    if after[2] is not None and before[2] is not None:
        result["stall_per_step_s"] = (after[2] - before[2]) / n
        result["spills_per_step"] = (after[3] - before[3]) / n
    if config in SPILLWAY:
        result["budget"] = budget if budget is not None else (
            spillway.budget_bytes() if config.startswith("spillway_auto") else None)
    del optimizer, tokens
    return result


def run_plan(spec, emit):
    """In a child, as everything that may touch CUDA: on CUDA the link, then the models' layer
    counts and parameters (counted on the meta device). Emits {"link": ..., "models": ...}."""
    link = measure_link(spec) if spec["device"] == "cuda" else None
    models = plan_models(spec["device"], spec["names"], link and link["device_total"],
                         spec["fill"], spec["seqs_override"])
    emit({"link": link, "models": models})


def measure_link(spec):
    """Pinned D2H and H2D bandwidth with torch, timed with CUDA events (PyTorch's allocator)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    size = spec.get("link_bytes", GIB)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    host.fill_(1)
    dev.fill_(2)
    result = {"device_name": torch.cuda.get_device_name(), "device_total": total,
              "device_free": free, "link_bytes": size}
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

def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def run_forked(fn, spec, timeout_s, log_path, host_guard=0):
    """Runs fn(spec, emit) in a forked child (stdout and stderr to log_path); returns (rows, how it
    ended). The parent never initialises CUDA, so the child may. The child is killed when the
    host's available memory falls below host_guard bytes (pinned memory cannot be swapped out)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("llm_step: CUDA is initialised in the parent; a forked child could "
                           "not use it")
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(r)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            out = os.fdopen(w, "w", buffering=1)

            def emit(row):
                out.write(json.dumps(row) + "\n")
                out.flush()
            fn(spec, emit)
            code = 0
        except BaseException:  # noqa: BLE001 - reported in the log, the exit code says it
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    rows, buf, ended = [], b"", None
    deadline = time.time() + timeout_s
    while True:
        left = deadline - time.time()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            ended = f"killed after {timeout_s:.0f} s (time budget)"
            break
        ready, _, _ = select.select([r], [], [], min(left, 0.25))
        available = mem_available() if host_guard else None
        if available is not None and available < host_guard:
            os.kill(pid, signal.SIGKILL)
            ended = (f"killed: the host's available memory fell to {available / GIB:.1f} GiB "
                     f"(guard {host_guard / GIB:.1f} GiB)")
            break
        if not ready:
            continue
        chunk = os.read(r, 65536)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            rows.append(json.loads(line))
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if ended is None:
        if os.WIFSIGNALED(status):
            ended = f"died of signal {os.WTERMSIG(status)}"
        elif os.WEXITSTATUS(status) != 0:
            ended = f"exited with status {os.WEXITSTATUS(status)}"
    return rows, ended


def host_ram_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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


def ok_rows(rows, model, config):
    return {r["seq"]: r for r in rows
            if r["model"] == model and r["config"] == config and r["status"] == "ok"}


def activation_estimate(rows, model, seq):
    """The reference's activation memory (peak allocated above the step's resident state) at
    `seq`: measured, or proportional to the length from the longest length it trained, or from
    Spillway eager's bytes to the host when the reference trained none. (estimate, basis)."""
    ref = ok_rows(rows, model, "pytorch")
    if seq in ref:
        r = ref[seq]
        return r["peak_allocated"] - r["base_allocated"], "measured"
    if ref:
        s = max(ref)
        r = ref[s]
        return (r["peak_allocated"] - r["base_allocated"]) * seq / s, f"scaled from {s}"
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


def job_spec(args, models, model_name, config, rows, link, host_ram, deadline):
    m = models[model_name]
    spec = dict(device=args.device, config=config, model_name=model_name, model=m,
                seqs=m["seqs"], steps=args.steps, seed=args.seed, deadline=deadline,
                deterministic=args.deterministic, skip={}, budgets={},
                link_d2h_gbps=(link or {}).get("d2h_gbps"),
                host_limit_mb=int(args.host_fraction * host_ram) // MIB)
    if config in AUTO_FRACTION:
        base = resident_estimate(rows, model_name, models)
        for seq in m["seqs"]:
            act, basis = activation_estimate(rows, model_name, seq)
            if act is None:
                capacity = (m["capacity_mb"] * MIB if args.device == "sim"
                            else link["device_total"])
                act, basis = capacity - base, "device memory (no reference)"
            spec["budgets"][str(seq)] = int(base + AUTO_FRACTION[config] * max(act, 0))
            spec.setdefault("budget_basis", {})[str(seq)] = basis
    if config in HOST_OFFLOAD and args.device == "cuda":
        cap = args.host_fraction * host_ram
        for seq in m["seqs"]:
            act, basis = activation_estimate(rows, model_name, seq)
            if act is None:
                spec["skip"][str(seq)] = ("no estimate of its activation bytes (the reference "
                                          "and Spillway eager trained no length), so nothing "
                                          "bounds the pinned host memory it would take")
            elif act > cap:
                spec["skip"][str(seq)] = (
                    f"host-memory cap: about {act / GIB:.1f} GiB of activations ({basis}) would "
                    f"be pinned, over {args.host_fraction:.2f} of the host's "
                    f"{host_ram / GIB:.0f} GiB")
    return spec


def flops_per_step(m, seq):
    """Training FLOPs of one step: 6 per weight per token (the embedding lookup is free, the head
    is not), plus causal attention's 6 * layers * width * length per token."""
    weights = m["params"] - m["vocab_size"] * m["hidden_size"] * (
        0 if m["tie_word_embeddings"] else 1)
    tokens = m["batch"] * seq
    return tokens * (6 * weights + 6 * m["layers"] * m["hidden_size"] * seq)


def annotate(rows, models, link):
    """Adds to each row what is read against the reference: memory saved, step-time overhead,
    the losses' comparison, and the physical bound."""
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
            r["saved_fraction"] = 1 - r["peak_allocated"] / ref["peak_allocated"]
            r["overhead_fraction"] = r["median_step_s"] / ref["median_step_s"] - 1
        if not link or not r.get("to_host_per_step"):
            continue
        base_config = "checkpoint" if r["config"] in CHECKPOINTED else "pytorch"
        base = ok_rows(rows, r["model"], base_config)
        m = models[r["model"]]
        if r["seq"] in base:
            compute, basis = base[r["seq"]]["median_step_s"], "measured"
        elif base:
            s = max(base)
            compute = base[s]["median_step_s"] * flops_per_step(m, r["seq"]) / flops_per_step(m, s)
            basis = f"FLOPs-scaled from {s}"
        else:
            continue
        d2h = r["to_host_per_step"] / (link["d2h_gbps"] * 1e9)
        h2d = r["to_device_per_step"] / (link["h2d_gbps"] * 1e9)
        r["bound"] = {"compute_s": compute, "compute_basis": f"{base_config}, {basis}",
                      "d2h_s": d2h, "h2d_s": h2d, "bound_s": max(compute, d2h, h2d)}
        r["step_over_bound"] = r["median_step_s"] / r["bound"]["bound_s"]


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
                 f"{meta['python']}; {meta['steps']} steps per length (the first is warm-up); "
                 f"determinism {meta['determinism']}; {meta['elapsed_s']:.0f} s of a "
                 f"{meta['budget_s']:.0f} s budget.")
    link = meta.get("link") or {}
    if "d2h_gbps" in link:
        lines.append(f"Link (pinned, {link['link_bytes'] / GIB:.0f} GiB copies, best of 5): "
                     f"D2H {link['d2h_gbps']:.1f} GB/s, H2D {link['h2d_gbps']:.1f} GB/s.")
    else:
        lines.append(f"Link: {link.get('reason', 'not measured')}.")
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
                  f" peak alloc ({unit}) | vs ref | peak reserved ({unit}) | to host / step "
                  f"({unit}) | back / step ({unit}) | stall / step (ms) | bound (s) | step / "
                  f"bound | losses |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for config, label in CONFIGS:
            mine = [r for r in rows if r["model"] == name and r["config"] == config]
            for r in mine:
                if r["status"] == "skipped" and "beyond" in r.get("reason", ""):
                    continue
                if r["status"] != "ok":
                    seq = r["seq"] if r["seq"] is not None else ""
                    reason = r.get("reason", "").replace("|", "/")
                    lines.append(f"| {label} | {seq} | {r['status']}: {reason} |" + " |" * 12)
                    continue
                bound = r.get("bound") or {}
                step_ratio = r["overhead_fraction"] + 1 if "overhead_fraction" in r else None
                peak_ratio = 1 - r["saved_fraction"] if "saved_fraction" in r else None
                cells = [label, r["seq"], "ok", f"{r['tokens_per_s']:.0f}",
                         f"{r['median_step_s']:.3f}", fmt(step_ratio, 1, 2),
                         fmt(r["peak_allocated"], scale, 2), fmt(peak_ratio, 1, 2),
                         fmt(r["peak_reserved"], scale, 2),
                         fmt(r.get("to_host_per_step"), scale, 2),
                         fmt(r.get("to_device_per_step"), scale, 2),
                         fmt(r.get("stall_per_step_s"), 1e-3, 1),
                         fmt(bound.get("bound_s"), 1, 3), fmt(r.get("step_over_bound"), 1, 2),
                         r["losses_vs_reference"]]
                lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "## Out-of-memory frontier: the longest length each configuration trained", "",
              "| configuration | " + " | ".join(models) + " |",
              "|---|" + "---|" * len(models)]
    for config, label in CONFIGS:
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
    for ci, (config, label) in enumerate(CONFIGS):
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
    ax.set_xlabel("memory saved: 1 - peak allocated / reference's (%)")
    ax.set_ylabel("step-time overhead over the reference (%)")
    ax.set_title("Memory saved against step time (labels: sequence length)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)

    names = list(models)
    height = 0.8 / max(1, len(names))
    low = math.log2(min(min(m["seqs"]) for m in models.values())) - 1
    for mi, name in enumerate(names):
        for ci, (config, _) in enumerate(CONFIGS):
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
    bx.set_yticks([c + 0.4 - height / 2 for c in range(len(CONFIGS))])
    bx.set_yticklabels([label for _, label in CONFIGS], fontsize=7)
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
    out = [f"llm_step summary: {meta['device_name']}, {meta['elapsed_s']:.0f} s"]
    link = meta.get("link") or {}
    out.append(f"link: D2H {link['d2h_gbps']:.1f} GB/s, H2D {link['h2d_gbps']:.1f} GB/s"
               if "d2h_gbps" in link else f"link: {link.get('reason', 'n/a')}")
    for name in models:
        ref = ok_rows(rows, name, "pytorch")
        if not ref:
            out.append(f"{name}: the reference trained no length")
            continue
        seq = max(ref)
        out += ["", f"{name} at length {seq} (the longest the reference trained):",
                f"| configuration | tokens/s | vs ref step | peak alloc ({unit}) | vs ref | "
                f"to host/step ({unit}) | step/bound | losses |", "|---|---:|---:|---:|---:|---:|"
                "---:|---|"]
        for config, label in CONFIGS:
            r = ok_rows(rows, name, config).get(seq)
            if r is None:
                continue
            out.append(f"| {label} | {r['tokens_per_s']:.0f} | "
                       f"{r['median_step_s'] / ref[seq]['median_step_s']:.2f} | "
                       f"{r['peak_allocated'] / scale:.2f} | {1 - r['saved_fraction']:.2f} | "
                       f"{fmt(r.get('to_host_per_step'), scale, 2)} | "
                       f"{fmt(r.get('step_over_bound'), 1, 2)} | {r['losses_vs_reference']} |")
    out += ["", "OOM frontier (longest length trained; what stopped it):",
            "| configuration | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for config, label in CONFIGS:
        cells = []
        for name in models:
            e = next(f for f in front if f["model"] == name and f["config"] == config)
            stopped = e["stopped"] or ""
            if e["longest"] is None and ":" in stopped:  # not run here: the reason's head
                stopped = stopped.split(":")[0]
            cells.append(f"{e['longest'] or 'none'} ({stopped})".replace("|", "/"))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def parent(args):
    t0 = time.time()
    deadline = t0 + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # torch.cuda.is_available() (transformers calls it) then asks NVML instead of initialising
    # the CUDA driver, which a forked child could not use afterwards.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
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
    got, ended = run_forked(run_plan, plan_spec, 180, os.path.join(logs, "plan.log"))
    if not got:
        sys.exit(f"llm_step: measuring the link and planning the models failed ({ended}); see "
                 f"{logs}/plan.log")
    link, models = got[0]["link"], got[0]["models"]
    if link is not None:
        meta["link"] = link
        meta["device_name"] = link["device_name"]
        print(f"[{time.time() - t0:.0f} s] {link['device_name']}, "
              f"{link['device_total'] / GIB:.1f} GiB; pinned D2H {link['d2h_gbps']:.1f} GB/s, "
              f"H2D {link['h2d_gbps']:.1f} GB/s", flush=True)
    else:
        meta["link"] = {"reason": "n/a on the simulated device: Spillway exposes no API that "
                                  "times its simulated copies, so no bound is given"}
        meta["device_name"] = "simulated device (host CPU)"
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
        job_deadline = time.time() + share
        spec = job_spec(args, models, name, config, rows, link, host_ram, job_deadline)
        got, ended = run_forked(run_job, spec, share + args.grace_s,
                                os.path.join(logs, f"{name}.{config}.log"), host_guard)
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
                killed = ended is not None and ended.startswith("killed after")
                got.append({"model": name, "config": config, "seq": seq,
                            "status": "no_time" if killed else "error",
                            "reason": ended or "the job ended without a row for this length"})
        got.sort(key=lambda r: (r["seq"] is not None, r["seq"] or 0))
        rows += got
        brief = ", ".join(f"{r['seq']}:{r['status']}" for r in got)
        print(f"[{time.time() - t0:.0f} s] {config} / {name}: {brief}"
              + (f" ({ended})" if ended else ""), flush=True)

    annotate(rows, models, link)
    front = frontier(rows, models, configs)
    meta["elapsed_s"] = time.time() - t0
    meta["configs"] = [{"name": c, "label": LABELS[c]} for c in configs]
    with open(os.path.join(args.out, "llm_step.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "frontier": front}, f, indent=1)
    with open(os.path.join(args.out, "llm_step.md"), "w") as f:
        f.write(markdown(meta, rows, models, front))
    png = plot(meta, rows, models, front, os.path.join(args.out, "llm_step.png"))
    print()
    print(summary(meta, rows, models, front))
    print(f"\nwritten: {args.out}/llm_step.json, llm_step.md, {os.path.basename(png)}; logs in "
          f"{logs}/")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("sim", "cuda"), required=True)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "out", "llm_step"))
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of the whole matrix (default: 60 on sim, 420 on "
                        "cuda)")
    parser.add_argument("--steps", type=int, default=3,
                        help="steps per length, the first one warm-up (default 3)")
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
