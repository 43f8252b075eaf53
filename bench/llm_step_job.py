"""bench/llm_step.py's child side: one configuration of one model trained at each sequence length
in turn, in a process of its own (run_job), under the peers' activation-offload contexts where the
configuration is a peer's (peer_context)."""

import contextlib
import gc
import importlib.util
import logging
import os
import statistics
import sys
import time
import traceback
import types

from llm_step_common import CHECKPOINTED, COMPILE_MIN_BYTES, GIB, MIB, SPILLWAY, warmup_steps
from llm_step_report import flops_per_step


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


def length_guess(model_spec, last_seq, last_s, seq):
    """Seconds that length `seq` should take, from `last_s` at `last_seq`: in proportion to the
    training FLOPs, which grow between linearly (the weights' share) and quadratically (causal
    attention's) with the length; where the model's parameter count is not known, as length^1.5.
    A fixed 1.5 overestimates a width-4096 stack, whose FLOPs are nearly all its weights': the
    length that shows Spillway past the reference's frontier would be cut as "no time"."""
    if "params" in model_spec:
        return last_s * flops_per_step(model_spec, seq) / flops_per_step(model_spec, last_seq)
    return last_s * (seq / last_seq) ** 1.5


def set_determinism(torch, mode):
    """torch.use_deterministic_algorithms for `mode` ("strict", "warn" or "off"); returns the rows'
    label. Uninitialised memory is left unfilled: with determinism on, torch would otherwise write
    NaN into every torch.empty first, the host-offload peers' pinned buffers included (by the CPU,
    in their pack hooks, on the forward's critical path), a cost no real run pays that falls on
    some configurations more than on others. The fill only exposes reads of uninitialised memory;
    the results of a correct program are the same without it."""
    if mode == "off":
        return "off"
    torch.use_deterministic_algorithms(True, warn_only=mode != "strict")
    try:
        import torch.utils.deterministic as deterministic  # torch >= 2.1

        deterministic.fill_uninitialized_memory = False
    except (ImportError, AttributeError):
        pass
    return "strict" if mode == "strict" else "warn_only"


def train_with_fallback(train, relax, strict):
    """train(); where strict determinism raises (an operation without a deterministic kernel),
    relax() and train() once more. The second try runs after the except block, once the failed
    attempt's traceback (whose frames hold its activations, logits and optimizer state) is gone:
    inside the block those tensors would still hold device memory. Returns (result, the first
    line of the strict error or None)."""
    try:
        return train(), None
    except RuntimeError as error:
        if not strict or "deterministic" not in str(error):
            raise
        traceback.print_exc()
        why = str(error).strip().splitlines()[0][:200]
    gc.collect()
    relax()
    return train(), why


def wait_for_device_memory(mem_get_info, expected_free, timeout_s, margin=2 << 30,
                           sleep=time.sleep):
    """Waits up to timeout_s until the device's free memory is back within `margin` of
    expected_free (what the plan's process saw before any job ran): the process of the job before
    may still be handing its memory back to the driver (a killed one especially), and a model
    built now would run out of memory for that job's sake. Returns (seconds waited, the free
    bytes last seen)."""
    start = time.monotonic()
    while True:
        free = mem_get_info()[0]
        waited = time.monotonic() - start
        if expected_free is None or free >= expected_free - margin or waited >= timeout_s:
            return waited, free
        sleep(0.5)


def load_torchtune_offloading():
    """torchtune's OffloadActivations and NoOpManager, and a note (None: the package imported).

    torchtune 0.6.1 (its last release) imports its whole tree on `import torchtune`: torchao with
    torchao.dtypes.nf4tensor (gone from torchao 0.18), sentencepiece, tiktoken, datasets,
    omegaconf. Where that fails, its torchtune/training/_activation_offloading.py, which needs
    none of them, is loaded alone: its imports of torchao's NF4Tensor (named only in an error
    path), torchtune.modules.TiedLinear (used only by get_act_offloading_ctx_manager) and
    torchtune.utils.get_logger are served by stand-ins while it loads. The class that runs is
    torchtune's own code either way. Raises Unavailable where neither works."""
    try:
        from torchtune.training import NoOpManager, OffloadActivations

        return OffloadActivations, NoOpManager, None
    except Exception as error:  # noqa: BLE001 - any import failure: try the file alone
        why = f"{type(error).__name__}: {str(error).strip()[:200]}"
    spec = importlib.util.find_spec("torchtune")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(f"torchtune does not import ({why}) and its files are not found")
    path = os.path.join(list(spec.submodule_search_locations)[0], "training",
                        "_activation_offloading.py")
    if not os.path.isfile(path):
        raise Unavailable(f"torchtune does not import ({why}) and has no {path}")

    def stub(name, **attrs):
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        return module

    nf4 = type("NF4Tensor", (), {})
    stubs = {
        "torchao": stub("torchao", __version__="0", __path__=[]),
        "torchao.dtypes": stub("torchao.dtypes", __path__=[]),
        "torchao.dtypes.nf4tensor": stub("torchao.dtypes.nf4tensor", NF4Tensor=nf4),
        "torchtune": stub("torchtune", __path__=[]),
        "torchtune.modules": stub("torchtune.modules", TiedLinear=type("TiedLinear", (), {})),
        "torchtune.utils": stub("torchtune.utils", get_logger=lambda level=None:
                                logging.getLogger("torchtune")),
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        file_spec = importlib.util.spec_from_file_location("llm_step_torchtune_offloading", path)
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001
        raise Unavailable(f"torchtune does not import ({why}), nor its "
                          f"_activation_offloading.py alone: {type(error).__name__}: {error}")
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    note = (f"torchtune's training/_activation_offloading.py loaded alone (the package does "
            f"not import here: {why})")
    return module.OffloadActivations, module.NoOpManager, note


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


def peer_context(config, model, torch, notes):
    """The context factory (called once per sequence length) of a hook-based peer, and the
    object that counts its copies; what the rows should say of how it was loaded goes to notes."""
    if config == "save_on_cpu":
        def make():
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=True)
            return ctx, CountingHooks(ctx, config)
        return make
    if config == "torchtune":
        OffloadActivations, NoOpManager, note = load_torchtune_offloading()
        if note:
            notes.append(note)

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
    import torch._inductor.config as ic

    # torch 2.11's reload prefetch reads the link's bandwidth from inductor's config.
    if hasattr(ic, "cpu_gpu_bw") and link_gbps:
        ic.cpu_gpu_bw = float(link_gbps)
    # One compiled region per layer, and a recompilation per new length: room for every layer
    # to take its own (68 on an H200).
    limit = max(64, 2 * len(model.model.layers) + 16)
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(limit, getattr(torch._dynamo.config, key)))
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
            spillway.install("sim", conf=f"sim_link_mb_per_s:{spec['sim_link_mb_per_s']}",
                             capacity_bytes=model_spec["capacity_mb"] * MIB)
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
    if device == "cuda":
        # The flash-attention backward is deterministic only in strict mode (warn_only leaves it
        # atomic): without it two runs of the same configuration differ in the last bits.
        determinism = set_determinism(torch, spec.get("deterministic", "strict"))

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
            # The host-offload peers' pinned blocks (rounded up to powers of two) stay cached
            # by torch's host allocator: without this each length would pin its own on top.
            for name in ("_host_emptyCache", "reset_peak_host_memory_stats"):
                fn = getattr(torch._C, name, None) or getattr(torch.cuda, name, None)
                if fn is not None and torch.cuda.is_initialized():
                    fn()

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

    notes = []
    if device == "cuda":
        waited, free = wait_for_device_memory(torch.cuda.mem_get_info, spec.get("device_free"),
                                              spec.get("memory_wait_s", 30))
        if waited >= 1:
            notes.append(f"waited {waited:.0f} s for the device's memory to come back "
                         f"({free / GIB:.1f} GiB free)")
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
    make_peer = None
    try:
        if config in ("save_on_cpu", "torchtune", "trl"):
            make_peer = peer_context(config, model, torch, notes)
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
            guess = length_guess(model_spec, last[0], last[1], seq)
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
            def relax():
                # An operation without a deterministic kernel: the rest of this job runs with
                # warnings instead, and says so (its losses may then differ in the last bits).
                set_determinism(torch, "warn")
                model.zero_grad(set_to_none=True)
                empty_and_reset()

            result, strict_error = train_with_fallback(
                lambda: train_length(torch, model, spec, seq, dev, config, make_peer, budget,
                                     min_bytes, stats, sync, spillway),
                relax, determinism == "strict")
            if strict_error is not None:
                determinism = f"warn_only (strict raised: {strict_error})"
                row["determinism"] = determinism
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
                    s["spillway.stall_us"] / 1e6, s["spillway.num_spills"],
                    s["spillway.bytes_taken_back"])
        if make_peer is not None and "pair" in holder:
            c = holder["pair"][1]
            return (c.to_host, c.to_device, None, None, None)
        return (None, None, None, None, None)

    losses, times, forward_times, bases = [], [], [], []
    before = None
    # The forward's own time, for the bounds (llm_step_report.annotate): on CUDA between events on
    # the compute stream, so that the host, which runs ahead, need not wait for it.
    cuda_events = dev == "cuda"
    # Warm-up: the first step makes lazy state (AdamW's, caches), and Spillway's policies learn
    # from the runs of a forward before (eager's bound on its spills needs two, auto's spills
    # ahead of its budget one): the steps after warm-up are the ones a training run repeats.
    warmup = warmup_steps(steps)
    for step in range(steps):
        if step == warmup and step > 0:
            sync()
            if spillway is not None:
                spillway.reset_peak_stats()
            else:
                torch.cuda.reset_peak_memory_stats()
            before = counters()
        ids = tokens[step].to(dev)
        sync()
        t0 = time.perf_counter()
        if cuda_events:
            marks = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            marks[0].record()
        optimizer.zero_grad(set_to_none=True)
        bases.append(stats()["allocated_bytes.all.current"])
        with forward_context():
            out = model(input_ids=ids, labels=ids)
            loss = out.loss
            del out
        if cuda_events:
            marks[1].record()
        else:
            t_forward = time.perf_counter() - t0  # the simulated device's kernels are the host's
        loss.backward()
        optimizer.step()
        sync()
        times.append(time.perf_counter() - t0)
        forward_times.append(marks[0].elapsed_time(marks[1]) / 1e3 if cuda_events else t_forward)
        losses.append(loss.item())
        del loss, ids
    after = counters()
    s = stats()
    timed = times[warmup:]
    n = len(timed)
    median = statistics.median(timed)
    # peak_active: the most memory held for tensors, blocks whose free waits for a copy still
    # reading them included (a spill's, until its bytes have crossed): what the device must have.
    # Allocated bytes leave those out, and would count a spill as memory saved before it is.
    result = dict(
        losses=losses, step_times=[round(t, 6) for t in times], median_step_s=median,
        median_forward_s=statistics.median(forward_times[warmup:]),
        tokens_per_s=batch * seq / median, peak_allocated=s["allocated_bytes.all.peak"],
        peak_active=s["active_bytes.all.peak"], peak_reserved=s["reserved_bytes.all.peak"],
        base_allocated=bases[-1])
    if steps == 1:
        before = (0, 0, 0.0, 0, 0) if after[0] is not None else (None,) * 5
    if after[0] is not None and before[0] is not None:
        result["to_host_per_step"] = (after[0] - before[0]) / n
        result["to_device_per_step"] = (after[1] - before[1]) / n
    if after[2] is not None and before[2] is not None:
        result["stall_per_step_s"] = (after[2] - before[2]) / n
        result["spills_per_step"] = (after[3] - before[3]) / n
        # Spills still copying when backward wanted them, kept on the device (no copy back).
        result["taken_back_per_step"] = (after[4] - before[4]) / n
    if config in SPILLWAY:
        result["budget"] = budget if budget is not None else (
            spillway.budget_bytes() if config.startswith("spillway_auto") else None)
    del optimizer, tokens
    return result
