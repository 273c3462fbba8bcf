"""
Speed paths that change how fast a step runs, not what it computes: the CPU's policy (bf16 where native,
malloc, dropout masks) and the GPU's (packed rows, CUDA graphs).
"""
import contextlib
import ctypes
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from model import attention_weights


def fast_dtype(device_type):
    """'bfloat16' where bf16 matrix multiply is native (GPUs since Ampere, AVX512-BF16 or AMX), else
    'float32': an AVX2-only CPU emulates bf16 at many times the cost (docs/performance.md)."""
    if device_type == 'cuda':
        return 'bfloat16' if torch.cuda.is_bf16_supported() else 'float32'
    isas = [getattr(torch.cpu, f'_is_{isa}_supported', lambda: False) for isa in ('avx512_bf16', 'amx_tile')]
    return 'bfloat16' if device_type == 'cpu' and any(f() for f in isas) else 'float32'


def keep_freed_memory(keep=True):
    """Keep freed memory (a batch's logits) in the process, not faulted in again page by page (glibc gives
    blocks over 32 MB back to the OS; docs/performance.md); keep=False gives back each freed block of 8 MB or
    more at once: a lower peak, paid in page faults (checkpoint_activations). -> False without glibc."""
    with contextlib.suppress(OSError):  # glibc's M_MMAP_MAX, M_TRIM_THRESHOLD; M_MMAP_THRESHOLD
        opts = [(-4, 0), (-1, 2 ** 30)] if keep else [(-3, 2 ** 23)]
        return all(ctypes.CDLL('libc.so.6').mallopt(*o) for o in opts)
    return False


def cpu_dropout(model):  # nn.Dropout's CPU mask (bernoulli_) takes twice rand_like's time: performance.md
    def forward(self, x):  # the draws in float32: bf16 would round p
        keep = torch.rand_like(x, dtype=torch.float32) >= self.p if self.training and self.p > 0 else None
        return x if keep is None else x * keep.to(x.dtype).mul_(1.0 / (1.0 - self.p))
    for m in [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]:
        m.forward = forward.__get__(m)


# --- packed rows (cuda_graphs) ------------------------------------------------------------


def attend(q, k, v, rows_q, rows_k, causal, dropout_p):
    """Attention within each sentence of packed rows; q, k, v (1, h, N, d_k) as MultiHeadAttention.heads."""
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # (N, h, d_k) views: each head's d_k contiguous
    if q.is_cuda:  # flash attention over variable lengths (the kernel of torch.nn.attention.varlen)
        y = torch.ops.aten._flash_attention_forward(q, k, v, rows_q.cu, rows_k.cu, rows_q.max_len,
                                                    rows_k.max_len, dropout_p, causal, False)[0]
        return y.transpose(0, 1)[None]
    # Elsewhere equation (1) with a block-diagonal mask over all N x N pairs: for tests, not speed.
    seg_q = torch.searchsorted(rows_q.cu, torch.arange(len(q)), right=True)  # each token's sentence
    seg_k = torch.searchsorted(rows_k.cu, torch.arange(len(k)), right=True)
    mask = (seg_q[:, None] == seg_k) & (rows_q.pos[:, None] >= rows_k.pos if causal else True)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    return (F.dropout(attention_weights(q, k, mask), dropout_p) @ v)[None]


class Packed(NamedTuple):
    """One side's sentences end to end in one row: what attention needs to know of them."""
    cu: torch.Tensor   # (sentences + 1,) int32: sentence i is the tokens cu[i]:cu[i + 1]
    pos: torch.Tensor  # each token's position in its sentence (section 3.5)
    max_len: int       # the longest sentence, or a bound on it
    attend = staticmethod(attend)  # model.py calls it with (this side, the other side)

    def to(self, device):
        return self._replace(cu=self.cu.to(device), pos=self.pos.to(device))


def pack(src, tgt_in, pad_id, size=None, max_len=None):
    """Padded src (B, S), tgt_in (B, T) on the host -> each side's tokens end to end in one row (1, N), the
    rows of the real targets (the first ones) and (source, target) Packed. size: both rows filled up to it by
    sentences of PAD (max_len at most), sentence counts to a power of two: few shapes, for CUDA graphs."""
    real, out = [int((x != pad_id).sum()) for x in (src, tgt_in)], []
    if size is not None:  # as many offsets on both sides, a power of two: the last sentences are empty
        slots = 2 ** math.ceil(math.log2(len(src) + 1 - min((r - size) // max_len for r in real)))
    for x, r in zip((src, tgt_in), real):
        keep = x != pad_id
        tokens, pos, lens = x[keep], torch.arange(x.size(1)).expand_as(x)[keep], keep.sum(1).tolist()
        if size is not None:
            n = size - r
            tokens, pos = F.pad(tokens, (0, n), value=pad_id), torch.cat([pos, torch.arange(n) % max_len])
            lens += [max_len] * (n // max_len) + [n % max_len] * (n % max_len > 0)
            lens += [0] * (slots - 1 - len(lens))
        cu = F.pad(torch.tensor(lens).cumsum(0), (1, 0)).int()
        out += [tokens[None], Packed(cu, pos, max_len or max(lens))]
    return out[0], out[2], slice(0, real[1]), (out[1], out[3])


def forward(model, src, tgt, rows, sides):
    """model(src, tgt, rows) on packed rows: attention within each sentence, target to source across."""
    (s, t), f = sides, sides[0].attend
    x = model.decode(tgt, model.encode(src, (f, s, s))[0], (f, t, s), tgt_mask=(f, t, t))
    return x.flatten(0, 1)[rows]


class Body(torch.nn.Module):  # the model on packed rows of one shape: tensors in, every decoder state out
    def __init__(self, model, max_len):
        super().__init__()
        self.model, self.max_len = model, max_len

    def forward(self, src, tgt, cu_s, pos_s, cu_t, pos_t):
        sides = Packed(cu_s, pos_s, self.max_len), Packed(cu_t, pos_t, self.max_len)
        return forward(self.model, src, tgt, slice(None), sides)


class Graphed:
    """A model's forward and backward on rows that pack filled to a fixed size, replayed as CUDA graphs, one
    per shape, each captured at its first batch (make_graphed_callables; its warm-up runs compile first)."""

    def __init__(self, model):
        self.model, self.graphs = model, {}

    def __call__(self, src, tgt, rows, sides):  # -> the decoder states at rows, as model(...) gives them
        s, t = sides
        inputs = (src, tgt, s.cu, s.pos, t.cu, t.pos)
        key = (src.size(1), len(s.cu), s.max_len)
        if key not in self.graphs:
            self.graphs[key] = torch.cuda.make_graphed_callables(Body(self.model, s.max_len), inputs)
        return self.graphs[key](*inputs)[rows]


def all_reduce_grads(model):
    """DDP's average of the gradients where its hooks see no backward (graph replays): one all-reduce."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    torch.distributed.all_reduce(flat)
    for g, f in zip(grads, flat.div_(torch.distributed.get_world_size()).split([g.numel() for g in grads])):
        g.copy_(f.view_as(g))
