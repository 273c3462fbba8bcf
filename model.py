"""
The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in the order of the paper's section 3:
configuration (Table 3), positions (3.5), multi-head attention (3.2), feed-forward network (3.3), encoder and
decoder (3.1) with shared embeddings (3.4); then the loss (5.4) and decoding (6.1) with a KV cache.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab_size: int = 37000      # joint source+target BPE vocabulary (section 5.1)
    tokenizer_size: int = 0      # ids with text (0: all); the rest only round vocab_size up, never generated
    n_enc_layers: int = 6        # N in Table 3
    n_dec_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8             # h
    d_head: int = 0              # d_k = d_v, each head's width (0: d_model / h); Table 3 rows (A), (B)
    dropout: float = 0.1         # P_drop: sub-layer outputs and embedding sums (5.4)
    attn_dropout: float = 0.0    # on attention weights; not in the paper, tensor2tensor used 0.1
    pre_norm: bool = False       # False = the paper's post-norm LayerNorm(x + Sublayer(x))
    max_len: int = 1024          # longest sequence the positional table covers
    positions: str = 'sinusoidal'  # section 3.5, or 'learned': Table 3 row (E)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2


PRESETS = {'base': dict(d_model=512, d_ff=2048, n_heads=8, dropout=0.1),  # Table 3: Config(**PRESETS['big'])
           'big': dict(d_model=1024, d_ff=4096, n_heads=16, dropout=0.3)}


def sinusoidal_positions(max_len, d_model):
    # Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same angle).
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.stack([torch.sin(pos * inv_freq), torch.cos(pos * inv_freq)], dim=-1).flatten(1)  # interleaved
    return pe[:, :d_model].float()  # an odd d_model ends on a sine


def attention_weights(q, k, mask=None):  # equation (1) written out: SDPA(Q, K, V) = these weights times V
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # Q K^T / sqrt(d_k); mask: True = attend, as SDPA's
    return (s if mask is None else s.masked_fill(~mask, -math.inf)).softmax(-1).nan_to_num(0.0)  # none: 0s


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K,
    V W_i^V), Attention = softmax(Q K^T / sqrt(d_k)) V (3.2.1); Q, K, V fused in one matmul where they can."""

    def __init__(self, cfg, cross=False):
        super().__init__()
        self.n_heads, self.cross, self.attn_dropout, d = cfg.n_heads, cross, cfg.attn_dropout, cfg.d_model
        hd = cfg.n_heads * (cfg.d_head or d // cfg.n_heads)  # h * d_k: d_model unless d_head says otherwise
        if cross:
            self.q_proj, self.kv_proj = nn.Linear(d, hd), nn.Linear(d, 2 * hd)
        else:
            self.qkv_proj = nn.Linear(d, 3 * hd)
        self.out_proj = nn.Linear(hd, d)  # W^O: h d_v -> d_model

    def heads(self, x):  # (B, T, h*d_k) -> (B, h, T, d_k)
        return x.view(*x.shape[:2], self.n_heads, -1).transpose(1, 2)

    def forward(self, x, memory=None, mask=None, causal=False, cache=None):
        if self.cross:
            if cache is not None and 'k' in cache:  # the source does not change while decoding
                k, v = cache['k'], cache['v']
            else:
                k, v = map(self.heads, self.kv_proj(memory).chunk(2, dim=-1))
                if cache is not None:  # contiguous once, not strided views read every step
                    cache['k'], cache['v'] = k, v = k.contiguous(), v.contiguous()
            # A source's k beams, consecutive rows of x, fold into the query axis: K, V are never repeated.
            q = self.heads(self.q_proj(x).view(k.size(0), -1, self.q_proj.out_features))
        else:
            q, k, v = map(self.heads, self.qkv_proj(x).chunk(3, dim=-1))
            if cache is not None:  # the KV cache: earlier positions' keys and values, in the beams' order
                if 'k' in cache:
                    order = cache.pop('order', None)  # reorder_cache's, applied in the same copy
                    k, v = extend(cache['k'], k, order), extend(cache['v'], v, order)
                cache['k'], cache['v'] = k, v
                T, S = q.size(2), k.size(2)
                if causal and T < S:  # is_causal aligns top-left: after a cached prefix, align bottom-right
                    mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T) if T > 1 else None
                    causal = False  # T == 1 sees all keys; training passes a bool (a SymBool: graph break)
        p = self.attn_dropout if self.training else 0.0
        y = (mask[0](q, k, v, *mask[1:], causal, p) if isinstance(mask, tuple)  # speed.py's (fn, q, k rows)
             else F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=p))
        return self.out_proj(y.transpose(1, 2).reshape(*x.shape[:-1], -1))


class FeedForward(nn.Module):
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2."""

    def __init__(self, cfg):
        super().__init__()
        self.w1, self.w2 = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)))


def residual(x, sublayer, norm, dropout, pre_norm):
    # Section 5.4: dropout on a sub-layer's output; post-norm (the paper), or pre-norm (needs less warmup).
    return x + dropout(sublayer(norm(x))) if pre_norm else norm(x + dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn, self.ffn = MultiHeadAttention(cfg), FeedForward(cfg)
        self.norm1, self.norm2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.dropout, self.pre_norm = nn.Dropout(cfg.dropout), cfg.pre_norm

    def forward(self, x, src_mask):
        x = residual(x, lambda h: self.self_attn(h, mask=src_mask), self.norm1, self.dropout, self.pre_norm)
        return residual(x, self.ffn, self.norm2, self.dropout, self.pre_norm)


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn, self.cross_attn = MultiHeadAttention(cfg), MultiHeadAttention(cfg, cross=True)
        self.ffn = FeedForward(cfg)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.dropout, self.pre_norm = nn.Dropout(cfg.dropout), cfg.pre_norm

    def forward(self, x, memory, src_mask, cache=None, tgt_mask=None):  # tgt_mask: packed rows' alone
        self_cache, cross_cache = (None, None) if cache is None else (cache['self'], cache['cross'])
        x = residual(x, lambda h: self.self_attn(h, mask=tgt_mask, causal=True, cache=self_cache),
                     self.norm1, self.dropout, self.pre_norm)
        x = residual(x, lambda h: self.cross_attn(h, memory, mask=src_mask, cache=cross_cache),
                     self.norm2, self.dropout, self.pre_norm)
        return residual(x, self.ffn, self.norm3, self.dropout, self.pre_norm)


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        # Section 3.4: one matrix for both embeddings and the pre-softmax projection (a joint vocabulary).
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.register_buffer('pe', sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        if cfg.positions == 'learned':  # Table 3 row (E): a learned table in its place, indexed alike
            self.pe = nn.Parameter(torch.randn_like(self.pe) * cfg.d_model ** -0.5)  # drawn as the embeddings
        self.dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_dec_layers))
        # Pre-norm leaves the last residual sum un-normalised, so each stack needs a final LayerNorm.
        self.enc_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self):
        # As tensor2tensor: Xavier-uniform per matrix of the paper (a bound per block of the fused W^Q, W^K,
        # W^V), biases zero, embeddings N(0, d_model^-0.5): unit variance after the sqrt(d_model) of 3.4.
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                for w in m.weight.chunk(1 + name.endswith('kv_proj') + name.endswith('qkv_proj')):
                    nn.init.xavier_uniform_(w)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.embed.weight, mean=0.0, std=self.cfg.d_model ** -0.5)

    def num_params(self):  # the shared embedding counted once; the sinusoids are a buffer, learned ones count
        return sum(p.numel() for p in self.parameters())

    def embed_tokens(self, tokens, start=0):  # start: the first position, or each token's (packed rows)
        pe = self.pe[start] if torch.is_tensor(start) else self.pe[start:start + tokens.size(1)]
        if pe.size(-2) < tokens.size(1):  # the slice ran past the end of the table
            raise ValueError(f"positions up to {start + tokens.size(1)} exceed max_len={self.cfg.max_len}")
        return self.dropout(self.embed(tokens) * math.sqrt(self.cfg.d_model) + pe)

    def encode(self, src, src_mask=None):  # src_mask given: packed rows' (speed.py)
        """src (B, S) -> memory (B, S, d_model) and the key-padding mask (B, 1, 1, S), True = attend."""
        src_mask = (src != self.cfg.pad_id)[:, None, None, :] if src_mask is None else src_mask
        x = self.embed_tokens(src, src_mask[1].pos if isinstance(src_mask, tuple) else 0)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.enc_norm(x), src_mask

    def decode(self, tgt, memory, src_mask, cache=None, tgt_mask=None):  # tgt_mask: packed rows' alone
        """tgt (B, T) -> states (B, T, d_model); memory: a row per k beams; cached: only new positions."""
        start = 0 if cache is None or 'k' not in cache[0]['self'] else cache[0]['self']['k'].size(2)
        x = self.embed_tokens(tgt, start if tgt_mask is None else tgt_mask[1].pos)
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory, src_mask, None if cache is None else cache[i], tgt_mask)
        return self.dec_norm(x)

    def output(self, x):  # section 3.4: the pre-softmax linear transformation is the embedding matrix
        return F.linear(x, self.embed.weight)

    def forward(self, src, tgt, rows=None):
        """-> logits (B, T, V); with rows (of the B*T target positions), the decoder states there alone."""
        x = self.decode(tgt, *self.encode(src))
        return self.output(x) if rows is None else x.flatten(0, 1)[rows]

    def new_cache(self):
        return [{'self': {}, 'cross': {}} for _ in self.decoder]


def extend(past, new, order=None):
    """Cached keys or values (rows, h, T, d_k) in the rows' order, then the new step's, in one copy."""
    out = new.new_empty(new.size(0), new.size(1), (T := past.size(2)) + new.size(2), new.size(3))
    if order is not None and not torch.compiler.is_compiling():
        torch.index_select(past, 0, order, out=out[:, :, :T])
    else:  # dynamo cannot trace a strided out=; compiled, the gather fuses into this copy
        out[:, :, :T] = past if order is None else past[order]
    out[:, :, T:] = new
    return out


def reorder_cache(cache, index, cross_index=None):
    # Self-attention histories follow their beams (moved by the next extend); cross K/V, when sentences leave.
    for layer in cache:
        own, cross = layer['self'], layer['cross']
        own['order'] = own['order'][index] if 'order' in own else index
        if cross_index is not None:
            cross['k'], cross['v'] = (cross[n].index_select(0, cross_index) for n in ('k', 'v'))


def loss_chunk(x, weight, target, eps):
    """Section 5.4 on rows x: logits x W^T, their label-smoothed loss and NLL, and d loss / d logits. As in
    tensor2tensor and fairseq the target gets 1 - eps, other ids eps / (V - 1): a NLL + b sum_v -log p_v."""
    V = weight.size(0)
    a, b = 1.0 - eps - eps / (V - 1), eps / (V - 1)
    logits = F.linear(x, weight).float()  # x and weight in the compute dtype: no cast per chunk
    top, picked, total = logits.amax(-1, keepdim=True), logits.gather(1, target[:, None]), logits.sum(-1)
    p = logits.sub_(top).clamp_(min=-80.0).exp_()  # in place (no other rows x V); exp < -87: 9x slower on CPU
    lse = top + (norm := p.sum(-1, keepdim=True)).log()  # log sum exp
    nll = (lse - picked).squeeze(1)
    loss = (a * nll + b * (V * lse.squeeze(1) - total)).sum()
    g = p.mul_((a + b * V) / norm).sub_(b)  # d loss / d logits = softmax (a + b V) - b, and - a at the target
    return loss, nll.sum(), g.scatter_add_(1, target[:, None], torch.full_like(norm, -a)).to(x.dtype)


class SmoothedCrossEntropy(torch.autograd.Function):
    """Projection and loss by chunks, in grad mode gradients at once (Liger Kernel; Wijmans et al. 2024)."""

    @staticmethod
    def forward(ctx, x, weight, target, eps, chunk_fn, rows, grad_mode):
        grad, dev, ctx.x_dtype = grad_mode and any(ctx.needs_input_grad[:2]), x.device.type, x.dtype
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype  # as F.linear's
        grad_x = x.new_empty(x.shape, dtype=torch.float32) if grad else None
        grad_w = weight.new_zeros(weight.shape, dtype=torch.float32) if grad else None
        loss, nll, w, x = 0.0, 0.0, weight.to(dtype), x.to(dtype)  # cast once, not per chunk
        for i in range(0, x.size(0), rows):
            loss_i, nll_i, g = chunk_fn(x[i:i + rows], w, target[i:i + rows], eps)
            loss, nll = loss + loss_i, nll + nll_i
            if grad:
                grad_x[i:i + rows] = g @ w
                grad_w += g.t() @ x[i:i + rows]
        ctx.save_for_backward(grad_x, grad_w)
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        grad_x, grad_w = ctx.saved_tensors
        return (grad_x * grad_loss).to(ctx.x_dtype), grad_w * grad_loss, None, None, None, None, None


def label_smoothed_loss(x, weight, target, eps=0.1, chunk_fn=loss_chunk, elements=None):
    """Section 5.4 over real target tokens' decoder states x (N, d_model) -> summed smoothed loss, NLL."""
    # A chunk's float32 logits: 64 MB on a CPU (memory), 1 GB on a GPU (each chunk is a pass over grad W)
    rows = max(1, (elements or 2 ** (24 if x.device.type == 'cpu' else 28)) // weight.size(0))
    return SmoothedCrossEntropy.apply(x, weight, target, eps, chunk_fn, rows, torch.is_grad_enabled())


# ------------------------------------------------------------------------------------------------
# Decoding (section 6.1: beam size 4, length penalty alpha 0.6, max output length input + 50)

def configure_optimizer(model, lr, betas, eps, weight_decay):
    """Section 5.3's Adam with decoupled weight decay (AdamW, Loshchilov & Hutter 2019) on the matrices
    alone, as nanoGPT's: gains and biases are not decayed. Fused (CPU and GPU): the update reads a
    found_inf flag on the device, so skipping a non-finite step needs no host sync."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{'params': matrices}, {'params': vectors, 'weight_decay': 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)


def length_penalty(length, alpha):  # Wu et al. (2016), as used by the paper: lp(Y) = ((5 + |Y|) / 6)^alpha
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(model, src, max_len_a, max_len_b):  # int(a * |src| + b) as Python computes it, in float64
    src_len = (src != model.cfg.pad_id).sum(1)
    return (float(max_len_a) * src_len.double() + float(max_len_b)).clamp(1, model.cfg.max_len - 1).long()


def next_log_probs(model, tokens, memory, src_mask, cache):
    cfg, logits = model.cfg, model.output(model.decode(tokens, memory, src_mask, cache)[:, -1]).float()
    logp = torch.log_softmax(logits, dim=-1, out=logits)  # in place: a new (rows x V) one costs page faults
    # Never generated, masked after normalising: PAD, BOS and the ids past the tokenizer's (no text).
    logp[:, [cfg.pad_id, cfg.bos_id]] = logp[:, cfg.tokenizer_size or cfg.vocab_size:] = -math.inf
    return logp


@torch.no_grad()
def greedy_decode(model, src, max_len_a=1.0, max_len_b=50):
    """-> for each sentence [(tokens without BOS/EOS, summed log-probability)]; ended sentences leave."""
    cfg, B, limit = model.cfg, src.size(0), max_lengths(model, src, max_len_a, max_len_b)
    memory, src_mask = model.encode(src)
    cache, tokens = model.new_cache(), src.new_full((B, 1), cfg.bos_id)
    score, active, out = torch.zeros(B, device=src.device), torch.arange(B, device=src.device), [None] * B
    for t in range(int(limit.max())):
        logp = next_log_probs(model, tokens[:, -1:], memory, src_mask, cache)
        best, nxt = logp.max(-1)
        at_limit = t + 1 >= limit  # the longest output allowed must end here
        nxt = torch.where(at_limit, cfg.eos_id, nxt)
        score += torch.where(at_limit, logp[:, cfg.eos_id], best)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        done = nxt == cfg.eos_id
        if done.any():
            for i, row, s in zip(active[done].tolist(), tokens[done, 1:-1].tolist(), score[done].tolist()):
                out[i] = [(row, s)]
            keep = (~done).nonzero().squeeze(1)
            if len(keep) == 0:
                break
            active, tokens, score, limit = active[keep], tokens[keep], score[keep], limit[keep]
            memory, src_mask = memory[keep], src_mask[keep]
            reorder_cache(cache, keep, keep)
    return out


def top_tokens(logp, n):  # logp.topk(n, dim=1) faster: a row's n best lie in the n best of 8 column groups
    R, V = logp.shape
    if V % 8 or V // 8 < n:
        return logp.topk(n, dim=1)
    groups = logp.view(R, 8, V // 8).amax(1).topk(n, dim=1).indices
    cols = (groups[:, :, None] + torch.arange(0, V, V // 8, device=logp.device)).view(R, -1)
    lp, j = logp.gather(1, cols).topk(n, dim=1)
    return lp, cols.gather(1, j)


# Beam search in four parts (fairseq's rules; B sentences x k beams): score the 2k best candidates, finish
# the EOS ones among the k best, keep the k best others alive, stop.
def candidates(alive, logp, at_limit, k, eos_id):
    """The 2k best continuations of each sentence (k left if k end in EOS) -> scores, beams, tokens."""
    B, n = alive.size(0), min(2 * k, logp.size(-1))
    lp, tok = top_tokens(logp, n)  # a beam's own n best hold all it can add to its sentence's 2k best
    if at_limit.any():
        ended = at_limit.repeat_interleave(k)
        lp[ended], tok[ended] = -math.inf, eos_id
        lp[ended, 0] = logp[ended, eos_id]
    top, idx = (alive[:, :, None] + lp.view(B, k, n)).view(B, -1).topk(2 * k, dim=1)
    return top, idx // n, tok.view(B, -1).gather(1, idx)

def finish(fin_scores, fin_tokens, top, src_beam, tok, tokens, t, alpha, eos_id):
    """EOS candidates among the k best (fairseq: beam 1 = greedy) join the k best finished, log P / lp."""
    (B, k), L = fin_scores.shape, fin_tokens.size(2) - 1
    finishes = (tok == eos_id) & (torch.arange(2 * k, device=tok.device) < k)
    eos_scores = torch.where(finishes, top / length_penalty(t + 1, alpha), -math.inf)
    hist = tokens.view(B, k, -1).gather(1, src_beam[:, :, None].expand(-1, -1, t + 1))
    cand_tokens = F.pad(torch.cat([hist[:, :, 1:], tok[:, :, None]], 2), (0, L - t), value=eos_id)
    fin_scores, order = torch.cat([fin_scores, eos_scores], 1).topk(k, dim=1)
    fin_tokens = torch.cat([fin_tokens, cand_tokens], 1).gather(1, order[:, :, None].expand(-1, -1, L + 1))
    return fin_scores, fin_tokens

def keep_alive(top, src_beam, tok, tokens, eos_id):
    """The k best candidates not ending in EOS live on. -> scores, histories, the rows they came from."""
    B, k = top.size(0), top.size(1) // 2
    alive, order = torch.where(tok == eos_id, -math.inf, top).topk(k, dim=1)
    beam_idx = (src_beam.gather(1, order) + torch.arange(B, device=top.device)[:, None] * k).view(-1)
    return alive, torch.cat([tokens[beam_idx], tok.gather(1, order).view(-1, 1)], 1), beam_idx

def can_stop(fin_scores, alive, limit, t, alpha, nbest, exact=False):
    """Done at the length limit, or once k finished (fairseq); exact: once no live beam can win (t2t)."""
    if exact:
        best_reachable = alive[:, 0] / length_penalty(limit.float(), alpha)
        return (fin_scores[:, nbest - 1] >= best_reachable) | (t + 1 >= limit)
    return (fin_scores[:, -1] > -math.inf) | (t + 1 >= limit)


@torch.no_grad()
def beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=50, nbest=1, exact=False):
    """Sentences x beams. -> for each sentence the nbest [(tokens, log P(Y|X) / lp(|Y|))], |Y| with EOS."""
    cfg, B, k, dev = model.cfg, src.size(0), beam, src.device
    memory, src_mask = model.encode(src)  # one copy per sentence for its k beams (MultiHeadAttention)
    limit = max_lengths(model, src, max_len_a, max_len_b)  # (B,)
    cache, tokens, L = model.new_cache(), src.new_full((B * k, 1), cfg.bos_id), int(limit.max())
    alive, fin_scores = (torch.full((B, k), -math.inf, device=dev) for _ in range(2))
    alive[:, 0] = 0.0  # all beams start identical: expand only one
    fin_tokens = src.new_full((B, k, L + 1), cfg.pad_id)
    # Finished sentences leave the batch: their results move to out_*, the rest of the state shrinks.
    active, out_scores, out_tokens = torch.arange(B, device=dev), fin_scores.clone(), fin_tokens.clone()
    for t in range(L):
        logp = next_log_probs(model, tokens[::k] if t == 0 else tokens[:, -1:], memory, src_mask, cache)
        logp = logp.repeat_interleave(k, 0) if t == 0 else logp  # step 0: a sentence's k beams are one (BOS)
        top, src_beam, tok = candidates(alive, logp, t + 1 >= limit, k, cfg.eos_id)
        fin_scores, fin_tokens = finish(fin_scores, fin_tokens, top, src_beam, tok, tokens, t, alpha,
                                        cfg.eos_id)
        alive, tokens, beam_idx = keep_alive(top, src_beam, tok, tokens, cfg.eos_id)
        reorder_cache(cache, beam_idx // k if t == 0 else beam_idx)  # after step 0: one row per sentence
        done = can_stop(fin_scores, alive, limit, t, alpha, nbest, exact)
        if done.any():
            out_scores[active[done]], out_tokens[active[done]] = fin_scores[done], fin_tokens[done]
            keep = (~done).nonzero().squeeze(1)
            if len(keep) == 0:
                break
            rows = (keep[:, None] * k + torch.arange(k, device=dev)).view(-1)
            active, alive, limit = active[keep], alive[keep], limit[keep]
            fin_scores, fin_tokens = fin_scores[keep], fin_tokens[keep]
            tokens, memory, src_mask = tokens[rows], memory[keep], src_mask[keep]
            reorder_cache(cache, rows, keep)
    return [[(row[:row.index(cfg.eos_id)], s) for row, s in zip(toks, scores) if s > -math.inf][:nbest]
            for toks, scores in zip(out_tokens.tolist(), out_scores.tolist())]
