"""
How fast a step runs, never what it computes. In the order train.py meets them:
- resolve_device, fast_dtype, check_settings and check_heads: a GPU where there is one, bf16 only
  where it is native, and what each speed path needs, said before any work;
- configure_backends: the CPU's malloc policy, flash attention's switch, on a GPU TF32 and no
  cuDNN attention; cpu_dropout, a faster dropout mask; packed_weights, oneDNN-prepacked weights
  for decoding on a CPU;
- the training model's paths: master weights (a bf16 copy, Adam on float32), activation
  checkpointing, torch.compile per layer, the broadcast of rank 0's weights;
- packed rows for CUDA graphs: a batch's sentences end to end, flash attention within each, the
  graphs themselves, and their gradients' all-reduce.
docs/performance.md has the measurements behind each.
"""
import copy
import ctypes
import math
import sys
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import model as M
from model import attention_weights


def fast_dtype(device_type):
    """'bfloat16' where bf16 matrix multiply is native (GPUs since Ampere, AVX512-BF16 or AMX), else
    'float32': an AVX2-only CPU emulates bf16 at many times the cost (docs/performance.md)."""
    if device_type == 'cuda':
        if torch.cuda.is_bf16_supported():
            return 'bfloat16'
        return 'float32'
    if device_type != 'cpu':
        return 'float32'
    for isa in ('avx512_bf16', 'amx_tile'):
        is_supported = getattr(torch.cpu, f'_is_{isa}_supported', None)
        if is_supported is not None and is_supported():
            return 'bfloat16'
    return 'float32'


def resolve_device(device, dtype, log):
    """-> device and dtype with 'auto' resolved: a GPU where torch sees one, bf16 where it is
    native. A GPU asked for and absent: one line; bf16 asked for where it is emulated: a warning."""
    if device == 'auto':
        device = 'cpu'
        if torch.cuda.is_available():
            device = 'cuda'
    device_type = device.split(':')[0]
    if device_type == 'cuda' and not torch.cuda.is_available():
        sys.exit(f"device={device!r} but torch sees no GPU (device='auto' picks one when there is)")
    if dtype == 'auto':
        dtype = fast_dtype(device_type)
    elif dtype == 'bfloat16' and fast_dtype(device_type) != 'bfloat16':
        log(f"warning: this {device_type} has no native bfloat16 matrix multiply: "
            f"far slower than float32")
    return device, dtype


def check_settings(device_type, dtype, cuda_graphs, master_weights, update_freq,
                   checkpoint_activations):
    """Stops with one line on speed settings that cannot work (dtype resolved from 'auto')."""
    if dtype == 'float16' and device_type == 'cpu':
        sys.exit("dtype='float16' needs a GPU; use 'bfloat16' or 'float32' on a CPU")
    if master_weights and dtype == 'float32':
        sys.exit("master_weights must be False with dtype float32 "
                 "(dtype='auto' gives float32 here)")
    if not cuda_graphs:
        return
    if device_type != 'cuda' or dtype == 'float32' or update_freq > 1 or checkpoint_activations:
        sys.exit("cuda_graphs needs a GPU, dtype bfloat16 or float16, update_freq=1, "
                 "no checkpoint_activations")


def check_heads(cfg, cuda_graphs):
    """Stops with one line if the model's heads cannot run cuda_graphs. The model's: a fine-tuned
    one has its checkpoint's, known only once it is read."""
    head_size = cfg.d_head or cfg.d_model // cfg.n_heads
    if cuda_graphs and (head_size % 8 != 0 or head_size > 256):  # flash attention's varlen kernel
        sys.exit(f"cuda_graphs needs a head size (d_head, or d_model / n_heads) that is a multiple "
                 f"of 8 and at most 256, got {head_size}")


def graph_length(longest_pair, max_len):
    """The longest sentence a packed row holds: the longest pair's size rounded up to a power of 2
    (few shapes, few graphs), at most max_len."""
    return min(2 ** math.ceil(math.log2(longest_pair)), max_len)


def configure_backends(device_type, dtype, checkpoint_activations):
    if device_type == 'cpu':
        keep_freed_memory(not checkpoint_activations)
    # On a CPU in bf16 the flash kernel is slower than the math one (docs/performance.md).
    use_flash = device_type != 'cpu' or dtype != 'bfloat16'
    torch.backends.cuda.enable_flash_sdp(use_flash)
    if device_type == 'cuda':
        # cuDNN attention plans anew for each batch shape: bf16 ran 5-10x slower on an H100.
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def keep_freed_memory(keep=True):
    """Keep freed memory (a batch's logits) in the process, not faulted in again page by page (glibc
    gives blocks over 32 MB back to the OS; docs/performance.md). keep=False gives back each freed
    block of 8 MB or more at once: a lower peak, paid in page faults (checkpoint_activations).
    -> False without glibc."""
    if keep:
        options = [(-4, 0), (-1, 2 ** 30)]  # M_MMAP_MAX, M_TRIM_THRESHOLD
    else:
        options = [(-3, 2 ** 23)]  # M_MMAP_THRESHOLD
    try:
        libc = ctypes.CDLL('libc.so.6')
    except OSError:
        return False
    return all(libc.mallopt(option, value) for option, value in options)


def cpu_dropout(model):
    """nn.Dropout's CPU mask (bernoulli_) takes twice rand_like's time (docs/performance.md)."""
    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        # The draws in float32: bf16 would round p.
        keep = torch.rand_like(x, dtype=torch.float32) >= self.p
        return x * keep.to(x.dtype).mul_(1.0 / (1.0 - self.p))

    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.forward = forward.__get__(m)


def training_model(model, ddp, device_type, dtype, master_weights, checkpoint_activations,
                   compile):
    """-> the model the steps run on, and the loss's chunk function. Under DDP every rank first
    takes rank 0's weights (each drew its own), so a master-weights copy is the same everywhere."""
    if ddp:
        broadcast_weights(model)
    train_model = training_copy(model, master_weights, dtype)
    if device_type == 'cpu':
        cpu_dropout(train_model)
    if checkpoint_activations:
        recompute_layers(train_model)
    chunk_fn = M.loss_chunk
    if compile:
        chunk_fn = compile_layers(train_model)
    return train_model, chunk_fn


def can_pack(model):
    """Whether packed_weights applies: a float32 torch model on the CPU, run without autograd or
    autocast, on a PyTorch build that has the private oneDNN ops (where absent: F.linear)."""
    if not isinstance(model, torch.nn.Module):
        return False
    weight = model.embed.weight
    if weight.device.type != 'cpu' or weight.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() or torch.is_autocast_enabled('cpu'):
        return False
    return hasattr(torch.ops.mkldnn, '_reorder_linear_weight')


@contextmanager
def packed_weights(model, reuse=None):
    """Within it, a float32 CPU model multiplies with weights prepacked for oneDNN, where eager
    PyTorch uses MKL: 1.1-2x faster decoding on some CPUs (docs/serving.md). `reuse`, a dict the
    caller keeps across calls, keeps the copies for the next entry, repacking a weight changed in
    between."""
    if not can_pack(model):
        yield
        return
    if reuse is None:
        reuse = {}

    def packed(weight, bias=None, op='none'):
        # Keyed on the storage and its version, which every in-place change bumps.
        key = (weight.data_ptr(), weight._version)
        kept = reuse.get(id(weight))
        if kept is None or kept[0] != key:
            reuse[id(weight)] = key, torch.ops.mkldnn._reorder_linear_weight(weight)
        pack = reuse[id(weight)][1]
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, pack, bias, op, [], '')

    def fused_ffn(ffn):
        # oneDNN applies the ReLU as it writes W1's product, not in another pass.
        w1 = packed(ffn.w1.weight, ffn.w1.bias, 'relu')
        return lambda x: ffn.w2(w1(x))

    def agrees(owner, module, fast, code):
        # A reader may have edited model.py (another activation, a new parameter): fast stands in
        # for module only where the two give the same outputs, on a few random rows; checked once
        # per code and weights, as the copies are kept.
        weights = tuple((p.data_ptr(), p._version) for p in owner.parameters())
        key = ('agrees', id(owner), code, weights)
        if key not in reuse:
            x = torch.randn(1, 4, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
            reuse[key] = torch.allclose(fast(x), module(x), rtol=1e-4, atol=1e-4)
        return reuse[key]

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ffns = [m for m in model.modules() if isinstance(m, M.FeedForward)]
    try:
        for m in linears:
            m.forward = packed(m.weight, m.bias)
        for f in ffns:
            fused = fused_ffn(f)
            if agrees(f, f, fused, type(f).forward):
                f.forward = fused
        output = packed(model.embed.weight)
        if agrees(model, model.output, output, type(model).output):
            model.output = output
        yield
    finally:
        # The instance attributes go, and the classes' forward and output are seen again.
        for m in linears + ffns:
            m.__dict__.pop('forward', None)
        model.__dict__.pop('output', None)


def training_copy(model, master_weights, dtype):
    """The model the steps run on: model itself, or with master_weights a copy in dtype. The copy's
    gradients go to model's float32 weights, which Adam updates (fairseq's --bf16)."""
    if not master_weights:
        return model
    return copy.deepcopy(model).to(getattr(torch, dtype))


def gradients_to_master(model, train_model):
    for p, q in zip(model.parameters(), train_model.parameters()):
        p.grad = q.grad.float()
        q.grad = None


def weights_to_copy(model, train_model):
    # In place: CUDA graphs captured on the copy keep reading the same memory.
    copies = [q.detach() for q in train_model.parameters()]
    torch._foreach_copy_(copies, list(model.parameters()))


def broadcast_weights(model):
    """Rank 0's weights on every rank: each rank drew its own initialisation (seed + rank)."""
    for p in model.parameters():
        dist.broadcast(p.detach(), 0)


def recompute_layers(model):
    """Backward recomputes each layer from its input instead of keeping its activations
    (fairseq's --checkpoint-activations): less memory, more compute."""
    for layer in [*model.encoder, *model.decoder]:
        layer.forward = recomputed(layer.forward)


def recomputed(forward):
    def run(*args):
        if not torch.is_grad_enabled():  # evaluation: nothing to keep for a backward
            return forward(*args)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False)
    return run


def compile_layers(model):
    """Each layer compiled on its own, as bench.py measures it: identical layers share one graph, so
    compile time does not grow with depth; batch shapes are symbolic (dynamic)."""
    for layer in [*model.encoder, *model.decoder]:
        layer.compile(dynamic=True)
    return torch.compile(M.loss_chunk, dynamic=True)  # the loss's chunks, for label_smoothed_loss


# --- packed rows (cuda_graphs) ------------------------------------------------------------


def attend(q, k, v, rows_q, rows_k, causal, dropout_p):
    """Attention within each sentence of packed rows: the hook model.MultiHeadAttention calls when
    given packed=(rows_q, rows_k). q, k, v (1, h, N, d_k) as MultiHeadAttention.heads gives them."""
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # (N, h, d_k): each head's d_k contiguous
    if q.is_cuda:  # flash attention over variable lengths (the kernel of torch.nn.attention.varlen)
        y = torch.ops.aten._flash_attention_forward(q, k, v, rows_q.cu, rows_k.cu, rows_q.max_len,
                                                    rows_k.max_len, dropout_p, causal, False)[0]
        return y.transpose(0, 1)[None]
    # Elsewhere equation (1) with a block-diagonal mask over all N x N pairs: for tests, not speed.
    seg_q = torch.searchsorted(rows_q.cu, torch.arange(len(q)), right=True)  # each token's sentence
    seg_k = torch.searchsorted(rows_k.cu, torch.arange(len(k)), right=True)
    mask = seg_q[:, None] == seg_k
    if causal:
        mask = mask & (rows_q.pos[:, None] >= rows_k.pos)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    weights = F.dropout(attention_weights(q, k, mask), dropout_p)
    return (weights @ v)[None]


class Packed(NamedTuple):
    """One side's sentences end to end in one row: what attention needs to know of them."""
    cu: torch.Tensor   # (sentences + 1,) int32: sentence i is the tokens cu[i]:cu[i + 1]
    pos: torch.Tensor  # each token's position in its sentence (section 3.5)
    max_len: int       # the longest sentence, or a bound on it

    def attend(self, q, k, v, keys, causal, dropout_p):
        """model.py's hook: these queries' sentences attend to their keys' (speed.attend)."""
        return attend(q, k, v, self, keys, causal, dropout_p)

    def to(self, device):
        return self._replace(cu=self.cu.to(device), pos=self.pos.to(device))


def pack(src, tgt_in, pad_id, size=None, max_len=None):
    """Padded src (B, S), tgt_in (B, T) on the host -> each side's tokens end to end in one row
    (1, N), the rows of the real targets (the first ones) and the (source, target) Packed.
    size: both rows filled up to it by sentences of PAD (max_len at most), and the sentence
    counts rounded to a power of two: few shapes, for CUDA graphs."""
    real = [int((x != pad_id).sum()) for x in (src, tgt_in)]
    if size is not None:  # as many offsets on both sides, a power of two: the last sentences empty
        fillers = max(-((r - size) // max_len) for r in real)  # the PAD sentences a side needs
        slots = 2 ** math.ceil(math.log2(len(src) + 1 + fillers))
    rows, sides = [], []
    for x, r in zip((src, tgt_in), real):
        keep = x != pad_id
        tokens = x[keep]
        pos = torch.arange(x.size(1)).expand_as(x)[keep]
        lens = keep.sum(1).tolist()
        if size is not None:
            n = size - r
            tokens = F.pad(tokens, (0, n), value=pad_id)
            pos = torch.cat([pos, torch.arange(n) % max_len])
            lens += [max_len] * (n // max_len)
            if n % max_len:
                lens.append(n % max_len)
            lens += [0] * (slots - 1 - len(lens))
        cu = F.pad(torch.tensor(lens).cumsum(0), (1, 0)).int()
        rows.append(tokens[None])
        sides.append(Packed(cu, pos, max_len or max(lens)))
    return rows[0], rows[1], slice(0, real[1]), tuple(sides)


def pack_batch(batch, pad_id, size, max_len):
    """A padded batch (src, tgt_in, rows, targets) -> pack's rows of the given size, the targets,
    and the (source, target) Packed."""
    src, tgt_in, rows, sides = pack(batch[0], batch[1], pad_id, size, max_len)
    return [src, tgt_in, rows, batch[3], *sides]


def forward(model, src, tgt, rows, sides):
    """model(src, tgt, rows) on packed rows: attention within each sentence, the target's
    to its source."""
    return model(src, tgt, rows, packed=sides)


class Body(torch.nn.Module):
    """The model on packed rows of one shape: tensors in, every decoder state out."""

    def __init__(self, model, max_len):
        super().__init__()
        self.model = model
        self.max_len = max_len

    def forward(self, src, tgt, cu_s, pos_s, cu_t, pos_t):
        sides = Packed(cu_s, pos_s, self.max_len), Packed(cu_t, pos_t, self.max_len)
        return self.model(src, tgt, slice(None), packed=sides)


class Graphed:
    """A model's forward and backward on rows that pack filled to a fixed size, replayed as CUDA
    graphs, one per shape, each captured at its first batch (make_graphed_callables; its warm-up
    runs compile first)."""

    def __init__(self, model):
        self.model = model
        self.graphs = {}

    def __call__(self, src, tgt, rows, *sides):  # the decoder states at rows, as model(...)
        # pack leaves a batch on the host: copied here, as no other thread may use the GPU
        # during a capture.
        s, t = sides
        device = next(self.model.parameters()).device
        inputs = tuple(x.to(device) for x in (src, tgt, s.cu, s.pos, t.cu, t.pos))
        key = (src.size(1), len(s.cu), s.max_len)
        if key not in self.graphs:
            body = Body(self.model, s.max_len)
            self.graphs[key] = torch.cuda.make_graphed_callables(body, inputs)
        return self.graphs[key](*inputs)[rows]


def all_reduce_grads(model):
    """DDP's average of the gradients where its hooks see no backward (graph replays):
    one all-reduce."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    torch.distributed.all_reduce(flat)
    flat.div_(torch.distributed.get_world_size())
    for g, f in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(f.view_as(g))

# --- end of packed rows ---------------------------------------------------------------------------
