"""
The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), whole, in one file, in the order of
the paper's section 3: configuration (Table 3), positional encoding (3.5), multi-head attention (3.2), the
feed-forward network (3.3), encoder and decoder stacks (3.1) with shared embeddings (3.4), then the training
loss (5.4) and decoding (6.1): greedy and beam search with a KV cache.
"""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab_size: int = 37000      # joint source+target BPE vocabulary (section 5.1)
    n_enc_layers: int = 6        # N in Table 3
    n_dec_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    n_heads: int = 8             # h; d_k = d_v = d_model / h
    dropout: float = 0.1         # P_drop: sub-layer outputs and embedding sums (5.4)
    attn_dropout: float = 0.0    # on attention weights; not in the paper, tensor2tensor used 0.1
    pre_norm: bool = False       # False = the paper's post-norm LayerNorm(x + Sublayer(x))
    max_len: int = 1024          # longest sequence the positional table covers
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2


# Table 3 of the paper; any field can be overridden: preset('big', vocab_size=32000).
PRESETS = {
    'base': dict(d_model=512, d_ff=2048, n_heads=8, dropout=0.1),
    'big': dict(d_model=1024, d_ff=4096, n_heads=16, dropout=0.3),
}


def preset(name, **overrides):
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    unknown = set(overrides) - {f.name for f in fields(Config)}
    if unknown:
        raise ValueError(f"unknown Config field(s) {sorted(unknown)}")
    return Config(**{**PRESETS[name], **overrides})


def sinusoidal_positions(max_len, d_model):
    # Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(same angle).
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq[:d_model // 2])  # an odd d_model ends on a sine
    return pe.float()


class MultiHeadAttention(nn.Module):
    """Section 3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K,
    V W_i^V), Attention = softmax(Q K^T / sqrt(d_k)) V (3.2.1). Self-attention projects Q, K, V with one
    fused matmul; cross-attention projects Q from the decoder and K, V (fused) from the encoder output."""

    def __init__(self, cfg, cross=False):
        super().__init__()
        self.n_heads, self.cross, self.attn_dropout = cfg.n_heads, cross, cfg.attn_dropout
        d = cfg.d_model
        if cross:
            self.q_proj, self.kv_proj = nn.Linear(d, d), nn.Linear(d, 2 * d)
        else:
            self.qkv_proj = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)

    def heads(self, x):  # (B, T, h*d_k) -> (B, h, T, d_k)
        B, T, C = x.shape
        return x.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)

    def forward(self, x, memory=None, mask=None, causal=False, cache=None):
        if self.cross:
            if cache is not None and 'k' in cache:  # the source does not change while decoding
                k, v = cache['k'], cache['v']
            else:
                k, v = map(self.heads, self.kv_proj(memory).chunk(2, dim=-1))
                if cache is not None:  # contiguous once, not strided views read every step
                    cache['k'], cache['v'] = k, v = k.contiguous(), v.contiguous()
            # Beam search keeps a source once and its k beams in consecutive rows of x: they fold into the
            # query axis (no query masks another), so K and V are never repeated per beam.
            q = self.heads(self.q_proj(x).view(k.size(0), -1, x.size(-1)))
        else:
            q, k, v = map(self.heads, self.qkv_proj(x).chunk(3, dim=-1))
            if cache is not None:  # the KV cache: earlier positions' keys and values, in the beams' order
                if 'k' in cache:
                    order = cache.pop('order', None)
                    k, v = extend(cache['k'], k, order), extend(cache['v'], v, order)
                cache['k'], cache['v'] = k, v
            T, S = q.size(2), k.size(2)
            if causal and 1 < T < S:  # is_causal aligns top-left: after a cached prefix, align bottom-right
                mask, causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T), False
            causal = causal and T > 1  # one new query may see every key
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           dropout_p=self.attn_dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).reshape(x.shape))


class FeedForward(nn.Module):
    """Section 3.3: FFN(x) = max(0, x W1 + b1) W2 + b2."""

    def __init__(self, cfg):
        super().__init__()
        self.w1, self.w2 = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)))


def residual(x, sublayer, norm, dropout, pre_norm):
    # Section 5.4: dropout on each sub-layer's output before it is added to its input. Post-norm (the paper)
    # normalises the sum; pre-norm normalises the input, an identity path that trains without careful warmup.
    if pre_norm:
        return x + dropout(sublayer(norm(x)))
    return norm(x + dropout(sublayer(x)))


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

    def forward(self, x, memory, src_mask, cache=None):
        self_cache, cross_cache = (None, None) if cache is None else (cache['self'], cache['cross'])
        x = residual(x, lambda h: self.self_attn(h, causal=True, cache=self_cache),
                     self.norm1, self.dropout, self.pre_norm)
        x = residual(x, lambda h: self.cross_attn(h, memory, mask=src_mask, cache=cross_cache),
                     self.norm2, self.dropout, self.pre_norm)
        return residual(x, self.ffn, self.norm3, self.dropout, self.pre_norm)


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        # Section 3.4: one weight matrix for source embedding, target embedding and the pre-softmax
        # projection (a joint BPE vocabulary makes the source/target sharing possible).
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.register_buffer('pe', sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_enc_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_dec_layers))
        # Pre-norm leaves the last residual sum un-normalised, so each stack needs a final LayerNorm.
        self.enc_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self):
        # As tensor2tensor: Xavier-uniform weights for each matrix as the paper writes it, so the fused
        # projections (W^Q, W^K, W^V of 3.2.2) get one bound per d_model x d_model block; biases zero;
        # embeddings N(0, d_model^-0.5), unit variance after the sqrt(d_model) of section 3.4.
        d = self.cfg.d_model
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                fused = name.endswith(('qkv_proj', 'kv_proj'))
                for w in m.weight.split(d, dim=0) if fused else [m.weight]:
                    nn.init.xavier_uniform_(w)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.embed.weight, mean=0.0, std=d ** -0.5)

    def num_params(self):  # the shared embedding counted once; the positional table is a buffer
        return sum(p.numel() for p in self.parameters())

    def embed_tokens(self, tokens, start=0):
        T = tokens.size(1)
        if start + T > self.cfg.max_len:
            raise ValueError(f"sequence of length {start + T} exceeds max_len={self.cfg.max_len}")
        x = self.embed(tokens) * math.sqrt(self.cfg.d_model) + self.pe[start:start + T]
        return self.dropout(x)

    def encode(self, src):
        """src (B, S) -> memory (B, S, d_model) and the key-padding mask (B, 1, 1, S), True = attend."""
        src_mask = (src != self.cfg.pad_id)[:, None, None, :]
        x = self.embed_tokens(src)
        for layer in self.encoder:
            x = layer(x, src_mask)
        return self.enc_norm(x), src_mask

    def decode(self, tgt, memory, src_mask, cache=None):
        """tgt (B, T) -> the last layer's states (B, T, d_model). memory may hold B / k rows, one per k
        consecutive rows of tgt (beams). With a cache (new_cache), tgt holds only the new positions."""
        start = 0 if cache is None or 'k' not in cache[0]['self'] else cache[0]['self']['k'].size(2)
        x = self.embed_tokens(tgt, start)
        for i, layer in enumerate(self.decoder):
            x = layer(x, memory, src_mask, None if cache is None else cache[i])
        return self.dec_norm(x)

    def output(self, x):
        # Section 3.4: the pre-softmax linear transformation is the embedding matrix.
        return F.linear(x, self.embed.weight)

    def forward(self, src, tgt):
        memory, src_mask = self.encode(src)
        return self.output(self.decode(tgt, memory, src_mask))

    def new_cache(self):
        return [{'self': {}, 'cross': {}} for _ in self.decoder]


def extend(past, new, order=None):
    """Cached keys or values (rows, h, T, d_k), reordered by `order` (reorder_cache), then the new step's,
    in one copy of the history per step (index_select, then torch.cat, would make two)."""
    T = past.size(2)
    out = new.new_empty(new.size(0), new.size(1), T + new.size(2), new.size(3))
    if order is not None and not torch.compiler.is_compiling():
        torch.index_select(past, 0, order, out=out[:, :, :T])
    else:  # dynamo cannot trace a strided out=; compiled, the gather fuses into this copy
        out[:, :, :T] = past if order is None else past[order]
    out[:, :, T:] = new
    return out


def reorder_cache(cache, index, cross_index=None):
    # Self-attention histories follow their rows (beams) through index, moved by the next extend; the
    # cross-attention K/V, one per sentence, move only when finished sentences leave (cross_index).
    for layer in cache:
        own = layer['self']
        own['order'] = own['order'][index] if 'order' in own else index
        if cross_index is not None:
            cross = layer['cross']
            cross['k'], cross['v'] = (cross[n].index_select(0, cross_index) for n in ('k', 'v'))


def label_smoothed_loss(logits, target, eps=0.1, pad_id=0):
    """Section 5.4. -> (summed smoothed loss, summed NLL, number of target tokens) over non-pad targets,
    for the caller to normalise by tokens across accumulation steps and GPUs. As tensor2tensor and fairseq
    (not torch's cross_entropy, which spreads eps over all V ids): the target gets 1 - eps, the others
    eps / (V - 1)."""
    V = logits.size(-1)
    logp = F.log_softmax(logits.reshape(-1, V).float(), dim=-1)
    target = target.reshape(-1)
    keep = target != pad_id
    # where, not a product: a non-finite logit at a pad target stays out, as nll_loss keeps it out.
    nll = F.nll_loss(logp, target, ignore_index=pad_id, reduction='sum')
    smooth = -torch.where(keep, logp.sum(dim=-1), 0.0).sum()  # over all V ids, the target's included ...
    eps_i = eps / (V - 1)
    return (1.0 - eps - eps_i) * nll + eps_i * smooth, nll.detach(), keep.sum()  # ... taken back out here


# ------------------------------------------------------------------------------------------------
# Decoding (section 6.1: beam size 4, length penalty alpha 0.6, max output length input + 50)

def length_penalty(length, alpha):
    # Wu et al. (2016), as used by the paper: lp(Y) = ((5 + |Y|) / 6)^alpha.
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(model, src, max_len_a, max_len_b):
    # int(a * |src| + b) as Python (and fairseq) compute it, in float64; clamped to the positional table.
    src_len = (src != model.cfg.pad_id).sum(1)
    return (float(max_len_a) * src_len.double() + float(max_len_b)).clamp(1, model.cfg.max_len - 1).long()


def next_log_probs(model, tokens, memory, src_mask, cache):
    logits = model.output(model.decode(tokens, memory, src_mask, cache)[:, -1]).float()
    logp = torch.log_softmax(logits, dim=-1, out=logits)  # in place: a new (rows x V) one costs page faults
    # Never generated; masked after normalising so scores stay the model's own log-probabilities.
    logp[:, [model.cfg.pad_id, model.cfg.bos_id]] = -math.inf
    return logp


@torch.no_grad()
def greedy_decode(model, src, max_len_a=1.0, max_len_b=50):
    """-> for each sentence [(tokens without BOS/EOS, summed log-probability)]. A sentence leaves the batch
    when it ends, so later steps compute only for those still going."""
    cfg, B = model.cfg, src.size(0)
    memory, src_mask = model.encode(src)
    limit = max_lengths(model, src, max_len_a, max_len_b)
    cache, tokens = model.new_cache(), src.new_full((B, 1), cfg.bos_id)
    score = torch.zeros(B, device=src.device)
    active, out = torch.arange(B, device=src.device), [None] * B
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


def top_tokens(logp, n):
    """logp.topk(n, dim=1), twice as fast for a large vocabulary: a row's n best lie in the n groups of
    columns (j mod V/8) with the largest maxima, since any other element has n group maxima above it."""
    R, V = logp.shape
    if V % 8 or V // 8 < n:
        return logp.topk(n, dim=1)
    groups = logp.view(R, 8, V // 8).amax(1).topk(n, dim=1).indices
    cols = (groups[:, :, None] + torch.arange(0, V, V // 8, device=logp.device)).view(R, -1)
    lp, j = logp.gather(1, cols).topk(n, dim=1)
    return lp, cols.gather(1, j)


# Beam search, one step at a time, in four parts (fairseq's rules; B sentences x k beams, V ids):
# score the 2k best candidates, finish the EOS ones among the k best, keep the k best others alive, stop.

def candidates(alive, logp, at_limit, k, eos_id):
    """The 2k best (beam, token) continuations of each sentence: 2k so that k are left when up to k end in
    EOS. At the length limit only EOS may follow. -> scores, the beam each extends, the token."""
    B, n = alive.size(0), min(2 * k, logp.size(-1))
    lp, tok = top_tokens(logp, n)  # a beam's own n best hold all it can add to its sentence's 2k best
    if at_limit.any():
        ended = at_limit.repeat_interleave(k)
        lp[ended], tok[ended] = -math.inf, eos_id
        lp[ended, 0] = logp[ended, eos_id]
    top, idx = (alive[:, :, None] + lp.view(B, k, n)).view(B, -1).topk(2 * k, dim=1)
    return top, idx // n, tok.view(B, -1).gather(1, idx)


def finish(fin_scores, fin_tokens, top, src_beam, tok, tokens, t, alpha, eos_id):
    """EOS candidates among the k best join the k best finished hypotheses of their sentence, scored
    log P / lp(t + 1). Only the k best count, as in fairseq, so that beam 1 is greedy at alpha 0."""
    (B, k), L = fin_scores.shape, fin_tokens.size(2) - 1
    finishes = (tok == eos_id) & (torch.arange(2 * k, device=tok.device) < k)
    eos_scores = torch.where(finishes, top / length_penalty(t + 1, alpha), -math.inf)
    hist = tokens.view(B, k, -1).gather(1, src_beam[:, :, None].expand(-1, -1, t + 1))
    cand_tokens = F.pad(torch.cat([hist[:, :, 1:], tok[:, :, None]], 2), (0, L - t), value=eos_id)
    fin_scores, order = torch.cat([fin_scores, eos_scores], 1).topk(k, dim=1)
    fin_tokens = torch.cat([fin_tokens, cand_tokens], 1).gather(1, order[:, :, None].expand(-1, -1, L + 1))
    return fin_scores, fin_tokens


def keep_alive(top, src_beam, tok, tokens, eos_id):
    """The k best candidates not ending in EOS become the live beams. -> their scores, their token
    histories, and the rows each came from (to reorder the cache)."""
    B, k = top.size(0), top.size(1) // 2
    alive, order = torch.where(tok == eos_id, -math.inf, top).topk(k, dim=1)
    beam_idx = (src_beam.gather(1, order) + torch.arange(B, device=top.device)[:, None] * k).view(-1)
    return alive, torch.cat([tokens[beam_idx], tok.gather(1, order).view(-1, 1)], 1), beam_idx


def can_stop(fin_scores, alive, limit, t, alpha, nbest, exact=False):
    """A sentence is done at its length limit, or, as in fairseq and CTranslate2, once k hypotheses have
    finished. exact: only when its nbest-th finished score beats the best its best live beam can still
    reach (tensor2tensor's rule: its log-probability under the largest length penalty it can reach)."""
    if exact:
        best_reachable = alive[:, 0] / length_penalty(limit.float(), alpha)
        return (fin_scores[:, nbest - 1] >= best_reachable) | (t + 1 >= limit)
    return (fin_scores[:, -1] > -math.inf) | (t + 1 >= limit)


@torch.no_grad()
def beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=50, nbest=1, exact=False):
    """Batched over sentences x beams. -> for each sentence the nbest [(tokens, score)], best first,
    score = log P(Y|X) / lp(|Y|) with |Y| counting EOS. Stops as can_stop says."""
    cfg, B, k, dev = model.cfg, src.size(0), beam, src.device
    memory, src_mask = model.encode(src)  # one copy per sentence for its k beams (MultiHeadAttention)
    limit = max_lengths(model, src, max_len_a, max_len_b)  # (B,)
    L = int(limit.max())
    cache, tokens = model.new_cache(), src.new_full((B * k, 1), cfg.bos_id)
    alive = torch.full((B, k), -math.inf, device=dev)
    alive[:, 0] = 0.0  # all beams start identical: expand only one
    fin_scores = torch.full((B, k), -math.inf, device=dev)
    fin_tokens = src.new_full((B, k, L + 1), cfg.pad_id)
    # Finished sentences leave the batch: their results move to out_*, the rest of the state shrinks.
    active, out_scores, out_tokens = torch.arange(B, device=dev), fin_scores.clone(), fin_tokens.clone()
    for t in range(L):
        if t == 0:  # the k beams of a sentence start identical (BOS): decode one row per sentence
            logp = next_log_probs(model, tokens[::k], memory, src_mask, cache).repeat_interleave(k, 0)
        else:
            logp = next_log_probs(model, tokens[:, -1:], memory, src_mask, cache)
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
    out = []
    for toks, scores in zip(out_tokens.tolist(), out_scores.tolist()):
        hyps = [(row[:row.index(cfg.eos_id)], s) for row, s in zip(toks, scores) if s > -math.inf]
        out.append(hyps[:nbest])
    return out
