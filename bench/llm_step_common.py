"""What bench/llm_step.py's parts share: the configurations in the order the time budget serves
them, their groups, and the models (CUDA and their simulated-device analogues)."""

import os

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

# The simulated device's link to the host, MiB/s each way (sim_link_mb_per_s): slow enough next
# to one CPU thread's compute that the link binds, as PCIe does next to an H100's, so that the
# bounds and stalls of the sim run mean something. Set from measurements: see docs/benchmarks.md.
SIM_LINK_MB_PER_S = 256
# Steps of each length before the timed ones (llm_step_job.train_length).
WARMUP_STEPS = 2


def warmup_steps(steps):
    """The warm-up steps of a run of `steps` per length: at least one step is timed."""
    return min(WARMUP_STEPS, steps - 1)


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
