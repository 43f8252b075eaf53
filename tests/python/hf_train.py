"""Small random-init transformers models and their training loop, for test_transformers.py. Runs
in a child process (an allocator is installed once per process): main() trains one model without
offload, then with each offload configuration asked for, in that one process, and torch.saves each
run's losses, gradients and statistics for the test to compare."""

import contextlib
import gc
import os

import torch

VOCAB = 1000
BATCH = 4
SEQ = 256
STEPS = 2
SEED = 0
COMMON = dict(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
              max_position_embeddings=SEQ)
# Eager attention saves the attention probabilities (the largest activations); "sdpa", what
# transformers picks by default, saves its inputs and output instead: both kinds are covered.
ATTENTION = {"llama": "eager", "qwen2": "sdpa", "gpt2": "eager", "mixtral": "sdpa"}
MODELS = tuple(ATTENTION)


def config(name):
    """One of the suite's models: 4 layers, hidden 256, 4 heads, a vocabulary of 1000."""
    import transformers

    if name == "llama":
        return transformers.LlamaConfig(intermediate_size=688, num_key_value_heads=4, **COMMON)
    if name == "qwen2":  # grouped-query attention
        return transformers.Qwen2Config(intermediate_size=688, num_key_value_heads=2, **COMMON)
    if name == "gpt2":
        # GPT-2's own names. Its dropouts (0.1) stay on: their masks are saved for backward too.
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=256, n_layer=4, n_head=4,
                                       n_positions=SEQ, bos_token_id=VOCAB - 1,
                                       eos_token_id=VOCAB - 1)
    if name == "mixtral":  # mixture of experts: 4 experts, top 2
        return transformers.MixtralConfig(intermediate_size=344, num_key_value_heads=2,
                                          num_local_experts=4, num_experts_per_tok=2, **COMMON)
    raise ValueError(f"unknown model {name!r}")


def build(name):
    import transformers

    torch.manual_seed(SEED)  # the initial weights, then GPT-2's dropout masks
    return transformers.AutoModelForCausalLM.from_config(config(name),
                                                         attn_implementation=ATTENTION[name])


def batches():
    g = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def train(name, offload=None):
    """Trains a fresh model STEPS steps with AdamW, the block `offload()` returns around each
    forward; returns {"losses", "grads" (parameter name -> the last step's gradient), "peak"
    (allocated bytes, whole run), "start" (allocated bytes before it), "bytes_to_host"}."""
    import spillway

    gc.collect()
    spillway.synchronize()
    before = spillway.memory_stats()
    spillway.reset_peak_stats()
    model = build(name)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens in batches():
        optimizer.zero_grad(set_to_none=True)
        with offload() if offload else contextlib.nullcontext():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    spillway.synchronize()
    after = spillway.memory_stats()
    return {"losses": losses,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "peak": after["allocated_bytes.all.peak"],
            "start": before["allocated_bytes.all.current"],
            "bytes_to_host": after["spillway.bytes_to_host"] - before["spillway.bytes_to_host"]}


def main(name, out_dir, auto_fraction=None):
    """The child: trains `name` without offload, with spillway.offload("eager"), and when
    `auto_fraction` is given with spillway.offload("auto", budget_bytes=auto_fraction x the
    no-offload peak); writes none.pt, eager.pt (and auto.pt, with its "budget") to out_dir. Each
    run's results go to disk and are freed before the next run starts, so that they take none of
    its device memory."""
    import spillway

    # Bitwise reproducible from run to run: deterministic algorithms, and one intra-op thread (the
    # tests that run this set OMP_NUM_THREADS=1: tests/python/conftest.py).
    torch.use_deterministic_algorithms(True)
    spillway.install("sim", capacity_bytes=2 << 30)

    def run(label, offload, **extra):
        result = train(name, offload)
        result.update(extra)
        torch.save(result, os.path.join(out_dir, label + ".pt"))
        return result["peak"]

    base_peak = run("none", None)
    run("eager", lambda: spillway.offload("eager"))
    if auto_fraction is not None:
        budget = int(base_peak * auto_fraction)
        run("auto", lambda: spillway.offload("auto", budget_bytes=budget), budget=budget)
