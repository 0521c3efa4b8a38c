"""Sequence-chunked feed-forward blocks: a long prefill's MLPs run a slice of tokens at a time.

A decoder layer's MLP acts on each token alone, so running it over slices of the sequence gives the
same values (bitwise on CPU in float32: ``tests/engine/test_feed_forward.py``) while its intermediate
activations shrink from the whole sequence's to one slice's. For a gated MLP (Llama, Qwen, Mistral,
Gemma: ``down(act(gate(x)) * up(x))``) three (B, T, intermediate) tensors are alive at once: 72 MiB
for SmolLM2 at 4,096 tokens (intermediate 1,536, float32), the largest transient of a prefill and of
the same order as the whole compressed cache at 0.4 (``docs/BENCHMARKS.md``, "MLP slices in long forwards").
vLLM and SGLang bound the same activations with chunked prefill; this does it inside one forward, so
a prefill that is not chunked (every scorer, KVzip's passes) profits too.

The MLP modules of the loaded model are wrapped (the model instance the engine owns; the classes and
the weights are untouched). Decode steps (a few tokens per row) pass straight through.
"""

from __future__ import annotations

import torch


class SequenceChunkedMLP(torch.nn.Module):
    """``inner`` (a per-token MLP: (B, T, hidden) -> (B, T, hidden)) applied ``tokens`` positions at a
    time along T when T is longer; the output is written into one preallocated (B, T, hidden) tensor."""

    def __init__(self, inner: torch.nn.Module, tokens: int) -> None:
        super().__init__()
        if tokens < 1:
            raise ValueError(f"tokens per slice must be positive, got {tokens}")
        self.inner = inner
        self.tokens = tokens

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        length = hidden_states.shape[-2]
        if length <= self.tokens:
            return self.inner(hidden_states)
        out = None
        for start in range(0, length, self.tokens):
            piece = self.inner(hidden_states[..., start : start + self.tokens, :])
            if out is None:
                out = piece.new_empty(*hidden_states.shape[:-1], piece.shape[-1])
            out[..., start : start + self.tokens, :] = piece
        return out


def chunk_feed_forward(model: torch.nn.Module, tokens: int) -> int:
    """Wrap every dense MLP of ``model`` (a child named ``mlp`` whose class name ends in ``MLP``; mixture-
    of-experts blocks are left alone) in :class:`SequenceChunkedMLP` of ``tokens`` positions; 0 wraps
    nothing. Idempotent (an existing wrapper takes the new slice). Returns how many MLPs are chunked."""
    count = 0
    for module in list(model.modules()):
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, SequenceChunkedMLP):
            if tokens:
                mlp.tokens = tokens
            else:
                module.mlp = mlp.inner
            count += bool(tokens)
        elif tokens and isinstance(mlp, torch.nn.Module) and type(mlp).__name__.endswith("MLP"):
            module.mlp = SequenceChunkedMLP(mlp, tokens)
            count += 1
    return count
