"""
The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), in this order:
configuration (Table 3), positions (3.5), attention (3.2), the feed-forward network (3.3),
residual sub-layers and the encoder and decoder layers (3.1), the Transformer with shared
embeddings (3.1, 3.4); then training: the label-smoothed loss (5.4) and the optimizer (5.3);
then the KV cache that decoding (decode.py, section 6.1) extends step by step.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab_size: int = 37000      # joint source+target BPE vocabulary (section 5.1)
    tokenizer_size: int = 0      # ids with text (0: all); ids past it only round vocab_size up
    n_enc_layers: int = 6        # N in Table 3
    n_dec_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8             # h
    d_head: int = 0              # d_k = d_v (0: d_model / h); Table 3 rows (A), (B)
    dropout: float = 0.1         # P_drop: sub-layer outputs and embedding sums (5.4)
    attn_dropout: float = 0.0    # on attention weights; not in the paper, tensor2tensor used 0.1
    pre_norm: bool = False       # False = the paper's post-norm LayerNorm(x + Sublayer(x))
    max_len: int = 1024          # longest sequence the positional table covers
    positions: str = 'sinusoidal'  # section 3.5, or 'learned': Table 3 row (E)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2


# Table 3's two models: Config(**PRESETS['big'], vocab_size=...)
PRESETS = {
    'base': dict(d_model=512, d_ff=2048, n_heads=8, dropout=0.1),
    'big': dict(d_model=1024, d_ff=4096, n_heads=16, dropout=0.3),
}


def sinusoidal_positions(max_len, d_model):
    # Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same angle).
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    angles = pos * inv_freq
    pe = torch.stack([torch.sin(angles), torch.cos(angles)], dim=-1).flatten(1)  # interleaved
    return pe[:, :d_model].float()  # an odd d_model ends on a sine


def attention_weights(q, k, mask=None):
    """Equation (1) written out: softmax(Q K^T / sqrt(d_k)), the weights that multiply V; the
    reference form (plot.py's attention maps, the tests, packed rows off the GPU), where
    MultiHeadAttention calls SDPA. mask: True = attend; a query with no key left gets zeros."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return scores.softmax(-1).nan_to_num(0.0)


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V); projections fused where they can."""

    def __init__(self, cfg, cross=False):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.cross = cross
        self.attn_dropout = cfg.attn_dropout
        d_model = cfg.d_model
        h_d_k = cfg.n_heads * (cfg.d_head or d_model // cfg.n_heads)  # d_model unless d_head is set
        if cross:
            self.q_proj = nn.Linear(d_model, h_d_k)
            self.kv_proj = nn.Linear(d_model, 2 * h_d_k)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * h_d_k)
        self.out_proj = nn.Linear(h_d_k, d_model)  # W^O: h d_v -> d_model

    def heads(self, x):  # (B, T, h*d_k) -> (B, h, T, d_k)
        return x.view(*x.shape[:2], self.n_heads, -1).transpose(1, 2)

    def forward(self, x, memory=None, mask=None, causal=False, cache=None, packed=None):
        """x (B, T, d_model): the queries, and the keys and values unless memory (cross-attention).
        mask: True = attend; cache: a dict of keys and values kept while decoding; packed: the
        (queries', keys') speed.Packed when sentences lie end to end in one row (speed.py)."""
        if self.cross:
            q, k, v = self.cross_projections(x, memory, cache)
        else:
            q, k, v = map(self.heads, self.qkv_proj(x).chunk(3, dim=-1))
            if cache is not None:
                k, v, mask, causal = self.with_cache(q, k, v, cache, mask, causal)
        dropout_p = self.attn_dropout if self.training else 0.0
        if packed is None:
            # Equation (1): Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, for every head;
            # is_causal sets to -inf the scores of the later positions (the decoder's, 3.2.3).
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                               dropout_p=dropout_p)
        else:  # each sentence of the packed rows attends within itself (speed.attend)
            queries, keys = packed
            y = queries.attend(q, k, v, keys, causal, dropout_p)
        y = y.transpose(1, 2).reshape(*x.shape[:-1], -1)  # Concat(head_1, ..., head_h)
        return self.out_proj(y)

    def cross_projections(self, x, memory, cache):
        """Q from the decoder, K and V from the encoder's output; while decoding, K and V are
        computed once per source (cache)."""
        if cache is not None and 'k' in cache:  # the source does not change while decoding
            k, v = cache['k'], cache['v']
        else:
            k, v = map(self.heads, self.kv_proj(memory).chunk(2, dim=-1))
            if cache is not None:  # contiguous once, not strided views read every step
                k, v = k.contiguous(), v.contiguous()
                cache['k'], cache['v'] = k, v
        # A source's k beams, consecutive rows of x, fold into the query axis:
        # K and V are never repeated.
        q = self.q_proj(x).view(k.size(0), -1, self.q_proj.out_features)
        return self.heads(q), k, v

    def with_cache(self, q, k, v, cache, mask, causal):
        """The KV cache of self-attention: earlier positions' keys and values, in beam order,
        then the new ones. -> keys, values, and the mask and causal flag that fit them."""
        if 'k' in cache:
            order = cache.pop('order', None)  # reorder_cache's, applied in the same copy
            k = extend(cache['k'], k, order)
            v = extend(cache['v'], v, order)
        cache['k'], cache['v'] = k, v
        T, S = q.size(2), k.size(2)
        # is_causal aligns top-left; after a cached prefix the mask aligns bottom-right.
        # Only here: training's T < S would be a symbolic bool under compile, a graph break.
        if causal and T < S:
            causal = False
            mask = None  # one new position sees every key
            if T > 1:
                mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        return k, v, mask, causal


class FeedForward(nn.Module):
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2."""

    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)))


def residual(x, sublayer, norm, dropout, pre_norm):
    # Section 3.1 and 5.4: dropout on the sub-layer's output, then LayerNorm(x + Sublayer(x)) (the
    # paper's post-norm), or x + Sublayer(LayerNorm(x)) (pre-norm: less warmup, Xiong et al. 2020).
    if pre_norm:
        return x + dropout(sublayer(norm(x)))
    return norm(x + dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Section 3.1: self-attention, then the feed-forward network."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.ffn = FeedForward(cfg)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.pre_norm

    def forward(self, x, src_mask, packed=None):  # packed: speed.pack's (source, target) sides
        self_rows = None
        if packed is not None:
            self_rows = (packed[0], packed[0])  # the source attends to itself

        def self_attention(h):
            return self.self_attn(h, mask=src_mask, packed=self_rows)

        x = residual(x, self_attention, self.norm1, self.dropout, self.pre_norm)
        return residual(x, self.ffn, self.norm2, self.dropout, self.pre_norm)


class DecoderLayer(nn.Module):
    """Section 3.1: masked self-attention, attention over the encoder's output, the FFN."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg)
        self.cross_attn = MultiHeadAttention(cfg, cross=True)
        self.ffn = FeedForward(cfg)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.norm3 = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.pre_norm = cfg.pre_norm

    def forward(self, x, memory, src_mask, cache=None, packed=None):
        self_cache = cross_cache = None
        if cache is not None:
            self_cache, cross_cache = cache['self'], cache['cross']
        self_rows = cross_rows = None
        if packed is not None:  # speed.pack's (source, target) sides
            src_rows, tgt_rows = packed
            self_rows = (tgt_rows, tgt_rows)
            cross_rows = (tgt_rows, src_rows)

        def self_attention(h):  # position i sees positions up to i alone (3.2.3)
            return self.self_attn(h, causal=True, cache=self_cache, packed=self_rows)

        def cross_attention(h):  # queries from the decoder, keys and values from the encoder
            return self.cross_attn(h, memory, mask=src_mask, cache=cross_cache, packed=cross_rows)

        x = residual(x, self_attention, self.norm1, self.dropout, self.pre_norm)
        x = residual(x, cross_attention, self.norm2, self.dropout, self.pre_norm)
        return residual(x, self.ffn, self.norm3, self.dropout, self.pre_norm)


class Transformer(nn.Module):
    """Section 3.1: the encoder and decoder stacks, with shared embeddings (3.4)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        # Section 3.4: one matrix for both embeddings and the pre-softmax projection
        # (a joint vocabulary).
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.register_buffer('pe', sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        if cfg.positions == 'learned':
            # Table 3 row (E): a learned table in place of the sinusoids, drawn with the embeddings'
            # std (it is not scaled by sqrt(d_model) as they are)
            self.pe = nn.Parameter(torch.randn_like(self.pe) * cfg.d_model ** -0.5)
        self.dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_dec_layers))
        # Pre-norm leaves the last residual sum un-normalised: each stack needs a final LayerNorm.
        self.enc_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self):
        # As tensor2tensor: Xavier-uniform per projection of all heads (W^Q, W^K, W^V each its own
        # bound in a fused one), biases zero, embeddings N(0, d_model^-0.5): unit variance after
        # the sqrt(d_model) of section 3.4.
        fused = {'qkv_proj': 3, 'kv_proj': 2}
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                blocks = fused.get(name.rsplit('.', 1)[-1], 1)
                for w in m.weight.chunk(blocks):
                    nn.init.xavier_uniform_(w)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.embed.weight, mean=0.0, std=self.cfg.d_model ** -0.5)

    def num_params(self):
        # The shared embedding counts once; the sinusoids are a buffer, a learned table counts.
        return sum(p.numel() for p in self.parameters())

    def embed_tokens(self, tokens, start=0):
        """Section 3.4 and 3.5: embeddings times sqrt(d_model) plus positions, then dropout (5.4).
        start: the first token's position, or a tensor of each token's (packed rows)."""
        if torch.is_tensor(start):
            pe = self.pe[start]
        else:
            pe = self.pe[start:start + tokens.size(1)]
        if pe.size(-2) < tokens.size(1):  # the slice ran past the end of the table
            last = start + tokens.size(1)
            raise ValueError(f"positions up to {last} exceed max_len={self.cfg.max_len}")
        return self.dropout(self.embed(tokens) * math.sqrt(self.cfg.d_model) + pe)

    def encode(self, src, packed=None):
        """src (B, S) -> memory (B, S, d_model) and the key-padding mask (B, 1, 1, S),
        True = attend. packed: speed.pack's (source, target) sides; then each sentence attends
        within itself, no mask."""
        if packed is None:
            src_mask = (src != self.cfg.pad_id)[:, None, None, :]
            x = self.embed_tokens(src)
        else:
            src_mask = None
            x = self.embed_tokens(src, packed[0].pos)
        for layer in self.encoder:
            x = layer(x, src_mask, packed)
        return self.enc_norm(x), src_mask

    def decode(self, tgt, memory, src_mask, cache=None, packed=None):
        """tgt (B, T) -> states (B, T, d_model); memory: a row per k beams; with a cache, tgt
        holds the new positions alone. packed: speed.pack's (source, target) sides, as encode's."""
        if packed is not None:
            start = packed[1].pos
        elif cache is not None and 'k' in cache[0]['self']:  # after the cached positions
            start = cache[0]['self']['k'].size(2)
        else:
            start = 0
        x = self.embed_tokens(tgt, start)
        for i, layer in enumerate(self.decoder):
            layer_cache = None if cache is None else cache[i]
            x = layer(x, memory, src_mask, layer_cache, packed)
        return self.dec_norm(x)

    def output(self, x):  # section 3.4: the pre-softmax linear transformation is the embedding
        return F.linear(x, self.embed.weight)

    def forward(self, src, tgt, rows=None, packed=None):
        """-> logits (B, T, V); with rows (of the B*T target positions), the decoder states there
        alone. packed: speed.pack's (source, target) sides, each side's sentences in one row."""
        memory, src_mask = self.encode(src, packed)
        x = self.decode(tgt, memory, src_mask, packed=packed)
        if rows is None:
            return self.output(x)
        return x.flatten(0, 1)[rows]

    def new_cache(self):  # per decoder layer, its self- and cross-attention's keys and values
        return [{'self': {}, 'cross': {}} for _ in self.decoder]


# -----------------------------------------------------------------------------------------------
# Training: the loss (section 5.4) and the optimizer (section 5.3)

def loss_chunk(x, weight, target, eps):
    """Section 5.4 on rows x: logits x W^T, their label-smoothed loss and NLL, and d loss / d
    logits. As in tensor2tensor and fairseq the target gets 1 - eps, the other ids eps / (V - 1),
    so the loss is a NLL + b sum_v -log p_v."""
    V = weight.size(0)
    b = eps / (V - 1)
    a = 1.0 - eps - b
    logits = F.linear(x, weight).float()  # x and weight in the compute dtype: no cast per chunk
    top = logits.amax(-1, keepdim=True)
    picked = logits.gather(1, target[:, None])
    total = logits.sum(-1)
    # In place: no other (rows x V) tensor. exp below -87 is subnormal, 9x slower on CPUs.
    p = logits.sub_(top).clamp_(min=-80.0).exp_()
    norm = p.sum(-1, keepdim=True)
    lse = top + norm.log()  # log sum exp
    nll = (lse - picked).squeeze(1)
    loss = (a * nll + b * (V * lse.squeeze(1) - total)).sum()
    # d loss / d logits = softmax (a + b V) - b, and - a at the target
    g = p.mul_((a + b * V) / norm).sub_(b)
    g = g.scatter_add_(1, target[:, None], torch.full_like(norm, -a))
    return loss, nll.sum(), g.to(x.dtype)


class SmoothedCrossEntropy(torch.autograd.Function):
    """Projection and loss by chunks; in grad mode the gradients at once, in forward
    (Liger Kernel; Wijmans et al. 2024): no (N x V) logits are kept for backward."""

    @staticmethod
    def forward(ctx, x, weight, target, eps, chunk_fn, rows, grad_mode):
        grad = grad_mode and any(ctx.needs_input_grad[:2])
        dev = x.device.type
        ctx.x_dtype = x.dtype
        dtype = x.dtype
        if torch.is_autocast_enabled(dev):  # the dtype F.linear computes in
            dtype = torch.get_autocast_dtype(dev)
        grad_x = grad_w = None
        if grad:
            grad_x = x.new_empty(x.shape, dtype=torch.float32)
            grad_w = weight.new_zeros(weight.shape, dtype=torch.float32)
        w = weight.to(dtype)  # cast once, not per chunk
        x = x.to(dtype)
        loss = nll = 0.0
        for i in range(0, x.size(0), rows):
            loss_i, nll_i, g = chunk_fn(x[i:i + rows], w, target[i:i + rows], eps)
            loss = loss + loss_i
            nll = nll + nll_i
            if grad:
                grad_x[i:i + rows] = g @ w
                grad_w += g.t() @ x[i:i + rows]
        ctx.save_for_backward(grad_x, grad_w)
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        grad_x, grad_w = ctx.saved_tensors
        grad_x = (grad_x * grad_loss).to(ctx.x_dtype)
        grad_w = grad_w * grad_loss
        return grad_x, grad_w, None, None, None, None, None


def label_smoothed_loss(x, weight, target, eps=0.1, chunk_fn=loss_chunk, elements=None):
    """Section 5.4 over real target tokens' decoder states x (N, d_model) -> the summed
    smoothed loss and NLL. elements: a chunk's logits, rows x V."""
    if not elements:  # float32 logits of 64 MB on a CPU (memory), 1 GB on a GPU (a pass over W)
        elements = 2 ** 24 if x.device.type == 'cpu' else 2 ** 28
    rows = max(1, elements // weight.size(0))
    grad_mode = torch.is_grad_enabled()
    return SmoothedCrossEntropy.apply(x, weight, target, eps, chunk_fn, rows, grad_mode)


def configure_optimizer(model, lr, betas, eps, weight_decay):
    """Section 5.3's Adam. weight_decay > 0 (not the paper's) decays as AdamW (Loshchilov & Hutter
    2019) the matrices alone, as nanoGPT's: gains and biases are not decayed. Fused (CPU and GPU):
    the update reads a found_inf flag on the device, so skipping a non-finite step needs no host
    sync."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{'params': matrices}, {'params': vectors, 'weight_decay': 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=True)


def skip_if_non_finite(optimizer, grad_norm):
    """A non-finite gradient norm (the same on every rank) makes the optimizer's next step a no-op,
    as fp16's GradScaler does (with fp16 the scaler sets the flag itself, from the same gradients).
    -> the flag, a 0-d bool tensor on the device."""
    bad = ~torch.isfinite(grad_norm)
    optimizer.found_inf = bad.float()  # read by the fused update (configure_optimizer)
    return bad


# -----------------------------------------------------------------------------------------------
# The KV cache: decode.py feeds the decoder one new position at a time

def extend(past, new, order=None):
    """Cached keys or values (rows, h, T, d_k) in the rows' order, then the new ones: one copy."""
    T = past.size(2)
    out = new.new_empty(new.size(0), new.size(1), T + new.size(2), new.size(3))
    if order is None:
        out[:, :, :T] = past
    elif torch.compiler.is_compiling():  # dynamo cannot trace a strided out=; the gather fuses in
        out[:, :, :T] = past[order]
    else:
        torch.index_select(past, 0, order, out=out[:, :, :T])
    out[:, :, T:] = new
    return out


def reorder_cache(cache, index, cross_index=None):
    """Self-attention histories follow their beams (moved by the next extend); the cross-attention's
    keys and values follow cross_index, when sentences leave."""
    for layer in cache:
        own, cross = layer['self'], layer['cross']
        if 'order' in own:  # an order not applied yet: the new one picks from it
            own['order'] = own['order'][index]
        else:
            own['order'] = index
        if cross_index is not None:
            cross['k'] = cross['k'].index_select(0, cross_index)
            cross['v'] = cross['v'].index_select(0, cross_index)
