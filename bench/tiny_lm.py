"""A small GPT-style language model and a training loop, shared by the tests, the demo and the
training-step benchmark. Deterministic for a given seed, so runs with and without Spillway can be
compared bitwise."""

import contextlib
import time

import torch
import torch.utils.checkpoint


class TinyLM(torch.nn.Module):
    """Embedding, a stack of TransformerEncoderLayers (causal mask), and an LM head."""

    def __init__(self, vocab=256, d_model=64, nhead=4, layers=4, ff=256, seq=128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d_model, nhead, ff, dropout=0.0, batch_first=True)
            for _ in range(layers))
        self.head = torch.nn.Linear(d_model, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), 1))

    checkpoint_layers = False  # activation checkpointing per layer (a baseline to compare with)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        n = tokens.shape[1]
        mask = self.mask[:n, :n]
        for block in self.blocks:
            if self.checkpoint_layers:
                h = torch.utils.checkpoint.checkpoint(block, h, mask, use_reentrant=False)
            else:
                h = block(h, src_mask=mask)
        return self.head(h)


def batches(steps, batch, seq, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(steps)]


def train(steps=3, batch=16, seq=128, d_model=64, layers=4, nhead=4, ff=256, vocab=256,
          offload=None, on_step=None, seed=0, device="cpu", checkpoint_layers=False,
          amp_dtype=None):
    """Trains a fresh TinyLM; returns (losses, step_seconds): CPU time on "cpu" (the simulated
    device), wall time on CUDA. `offload` is a context-manager factory (e.g.
    lambda: spillway.offload("eager")) wrapped around each forward pass; `amp_dtype` (e.g.
    torch.bfloat16) runs the forward pass under autocast."""
    torch.manual_seed(seed)
    model = TinyLM(vocab, d_model, nhead, layers, ff, seq).to(device)
    model.checkpoint_layers = checkpoint_layers
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, times = [], []
    for tokens in batches(steps, batch, seq, vocab, seed):
        tokens = tokens.to(device)
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter() if device != "cpu" else time.process_time()
        optimizer.zero_grad(set_to_none=True)
        amp = (torch.autocast("cpu" if device == "cpu" else "cuda", dtype=amp_dtype)
               if amp_dtype is not None else contextlib.nullcontext())
        with amp, (offload() if offload else contextlib.nullcontext()):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                     tokens[:, 1:].reshape(-1))
            del logits
        loss.backward()
        optimizer.step()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append((time.perf_counter() if device != "cpu" else time.process_time()) - start)
        losses.append(loss.item())
        if on_step:
            on_step()
    return losses, times
