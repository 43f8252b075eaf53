"""A PyTorch transformer language model built from `torch.nn.TransformerEncoderLayer` (the model of
issue #36's defaults measurements), and one training run of it with or without Spillway's
offload, for the defaults test and the prefetch-window benchmark.

    python3 bench/encoder_lm.py [--offload eager|auto|none] [--budget-fraction F]
        [--prefetch-mb N] [--steps N]

Runs in a fresh process (Spillway's allocator is installed once per process) on the simulated
device and prints one JSON line: losses, a digest of every gradient of the last step, peak
allocated bytes, bytes to the host, stall time. --budget-fraction is a fraction of the no-offload
peak, which the caller passes as --reference-peak.
"""

import argparse
import hashlib
import json

import torch


class EncoderLM(torch.nn.Module):
    def __init__(self, vocab=1000, width=256, heads=4, layers=4, ff=1024):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        seq = tokens.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(seq)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


def train(steps, batch, seq, offload=None, vocab=1000):
    """Losses and a digest of the last step's gradients (bitwise comparisons across runs)."""
    torch.manual_seed(0)
    model = EncoderLM(vocab=vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses, digest = [], None
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        optimizer.zero_grad(set_to_none=True)
        if offload is not None:
            with offload():
                logits = model(tokens[:, :-1])
        else:
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                 tokens[:, 1:].reshape(-1))
        del logits
        loss.backward()
        digest = hashlib.sha256()
        for p in model.parameters():
            digest.update(p.grad.numpy().tobytes())
        optimizer.step()
        losses.append(loss.item())
    return losses, digest.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offload", choices=("none", "eager", "auto"), default="none")
    parser.add_argument("--budget-fraction", type=float, default=None)
    parser.add_argument("--reference-peak", type=int, default=None)
    parser.add_argument("--prefetch-mb", type=float, default=None,
                        help="a fixed window (default: Spillway's default, adaptive)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)  # CPU kernels that reduce the same way in every run
    import spillway

    spillway.install("sim", capacity_bytes=4 << 30)
    kwargs = {}
    if args.prefetch_mb is not None:
        kwargs["prefetch_bytes"] = int(args.prefetch_mb * (1 << 20))
    if args.budget_fraction is not None:
        kwargs["budget_bytes"] = int(args.budget_fraction * args.reference_peak)
    block = None if args.offload == "none" else (lambda: spillway.offload(args.offload, **kwargs))
    losses, digest = train(args.steps, args.batch, args.seq, block)
    stats = spillway.memory_stats()
    print(json.dumps({"losses": losses, "grads": digest,
                      "peak_allocated": stats["allocated_bytes.all.peak"],
                      # A spill's block counts until its copy has read it (active bytes).
                      "peak_held": stats["active_bytes.all.peak"],
                      "bytes_to_host": stats["spillway.bytes_to_host"],
                      "bytes_to_device": stats["spillway.bytes_to_device"],
                      "stall_us": stats["spillway.stall_us"],
                      "num_stalls": stats["spillway.num_stalls"]}))


if __name__ == "__main__":
    main()
