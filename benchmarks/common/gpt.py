"""A GPT-style byte-level language model and its data, the text of Python's own standard library.

The model (nanoGPT-style, written for this benchmark): token and position embeddings, ``n_layer`` pre-LayerNorm
blocks (``x + attn(ln(x))``, ``x + mlp(ln(x))``) with causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, a final LayerNorm, and an output projection that *is* the
token embedding (tied weights: one ``Parameter``, listed once by ``parameters()``). Tokens are bytes (vocab 256).

The data is present on every machine with Python, nothing is downloaded: the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded), in sorted order; a file goes to validation when
the CRC-32 of its relative path is 0 mod ``VAL_MODULUS`` (about 10 %), otherwise to training. Reading stops
at a byte cap per split, so start-up is fast. Files are joined by a blank line.

Example:
    >>> model = GPT(GPTConfig.tiny())
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 256])
"""

from __future__ import annotations

import math
import os
import sysconfig
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "lm_loss", "stdlib_files", "split_files", "load_text", "TextBatches",
           "validation_windows", "VAL_MODULUS"]

#: a file is in the validation split when crc32(relative path) % VAL_MODULUS == 0
VAL_MODULUS = 10


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model; the defaults give 10.8 M parameters (6 layers, width 384, context 128)."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")

    @classmethod
    def tiny(cls) -> "GPTConfig":
        """2 layers, width 32, context 16: for tests (about 34 K parameters)."""
        return cls(block_size=16, n_layer=2, n_head=2, n_embd=32)


class CausalSelfAttention(torch.nn.Module):
    """Multi-head self-attention where position t sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = torch.nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = torch.nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(torch.nn.Module):
    """A pre-LayerNorm transformer block: attention then a 4x-wide GELU MLP, each around a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = torch.nn.LayerNorm(cfg.n_embd)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(cfg.n_embd, 4 * cfg.n_embd), torch.nn.GELU(),
                                       torch.nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """The language model: ``forward(idx)`` maps (B, T) byte tokens to (B, T, vocab) logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = torch.nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = torch.nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = torch.nn.LayerNorm(cfg.n_embd)
        self.head = torch.nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: one Parameter, registered under both names
        self.apply(self._init)
        # GPT-2's scaling of the projections into the residual stream, so its variance does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: torch.nn.Module) -> None:
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
        elif isinstance(m, torch.nn.Embedding):
            torch.nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size={self.cfg.block_size}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of (B, T, V) logits against (B, T) targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -- data ----------------------------------------------------------------------------------------------------


def stdlib_files(root: Optional[str] = None) -> tuple[str, list[str]]:
    """The standard library's directory and its ``.py`` files (relative paths, sorted), ``site-packages`` and
    ``dist-packages`` excluded."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    if not files:
        raise RuntimeError(f"no .py files under {root}: the language-model benchmark reads the standard library's "
                           "sources; is this Python installed without them?")
    return root, sorted(files)


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
    """Split relative paths into (train, validation) by the CRC-32 of the path: the same on every run."""
    val = [f for f in files if zlib.crc32(f.encode()) % VAL_MODULUS == 0]
    train = [f for f in files if zlib.crc32(f.encode()) % VAL_MODULUS != 0]
    return train, val


def _read(root: str, files: list[str], cap: int) -> torch.Tensor:
    chunks, size = [], 0
    for f in files:
        if size >= cap:
            break
        with open(os.path.join(root, f), "rb") as fh:
            data = fh.read(cap - size) + b"\n\n"
        chunks.append(data)
        size += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def load_text(train_bytes: int = 8 << 20, val_bytes: int = 1 << 20,
              root: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (train, validation) byte streams as uint8 tensors, each capped at the given number of bytes."""
    root, files = stdlib_files(root)
    train, val = split_files(files)
    return _read(root, train, train_bytes), _read(root, val, val_bytes)


class TextBatches:
    """Training batches of one rank: ``batch_size`` random windows of ``block_size + 1`` bytes per step, drawn
    from a generator seeded by (seed, rank), so every rank sees different data and a run is reproducible.
    ``batch(i)`` is the i-th batch; batches are drawn in order and kept, so asking again is free."""

    def __init__(self, data: torch.Tensor, batch_size: int, block_size: int, seed: int, rank: int) -> None:
        self.data, self.batch_size, self.block_size = data, batch_size, block_size
        self._gen = torch.Generator().manual_seed(10_000 * (seed + 1) + rank)
        self._drawn: list[torch.Tensor] = []

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self._drawn) <= i:
            self._drawn.append(torch.randint(len(self.data) - self.block_size - 1, (self.batch_size,),
                                             generator=self._gen))
        return _windows(self.data, self._drawn[i], self.block_size)


def _windows(data: torch.Tensor, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = starts[:, None] + torch.arange(block_size + 1)
    chunk = data[offsets].long()
    return chunk[:, :-1], chunk[:, 1:]


def validation_windows(data: torch.Tensor, n: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed validation subset: ``n`` windows evenly spaced through the validation stream."""
    span = len(data) - block_size - 1
    if span <= 0:
        raise ValueError(f"validation text of {len(data)} bytes is shorter than one window of {block_size + 1}")
    starts = torch.linspace(0, span, n).long()
    return _windows(data, starts, block_size)
