"""
Decoding (section 6.1): sources batched by length, greedy decoding and batched beam search with
the model's KV cache, the length penalty and the output length limit. train.py's validation BLEU,
translate.py, bench.py, plot.py and export_ct2.py's CTranslate2 model all decode by these rules.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
from sacrebleu.metrics import BLEU

import cluster
import dataset
import model as M


def length_batches(srcs, max_tokens):
    """The keys of srcs ({key: source ids}) in batches of at most max_tokens padded source tokens,
    longest first: padding stays small, and a batch too large for memory fails at once, not last."""
    ids = list(srcs)
    sizes = np.array([len(srcs[i]) for i in ids], dtype=np.int64)
    order = np.argsort(-sizes, kind='stable')
    return [[ids[j] for j in batch] for batch in dataset.token_batches(sizes, order, max_tokens)]


def padded(srcs, batch, pad_id, device):
    longest = len(srcs[batch[0]])  # the batch's first source: batches are sorted longest first
    rows = [srcs[i] + [pad_id] * (longest - len(srcs[i])) for i in batch]
    return torch.tensor(rows, device=device)


def length_penalty(length, alpha):  # Wu et al. (2016), as the paper: lp(Y) = ((5 + |Y|) / 6)^alpha
    return ((5.0 + length) / 6.0) ** alpha


def max_lengths(model, src, max_len_a, max_len_b):
    # int(a * |src| + b) as Python computes it, in float64; at least 1 and within the positional
    # table (translate.py warns where this lowers a limit)
    src_len = (src != model.cfg.pad_id).sum(1)
    limit = float(max_len_a) * src_len.double() + float(max_len_b)
    return limit.clamp(1, model.cfg.max_len - 1).long()


def next_log_probs(model, tokens, memory, src_mask, cache):
    """The log-probabilities (rows, V) of the token after tokens, earlier ones in the cache."""
    cfg = model.cfg
    x = model.decode(tokens, memory, src_mask, cache)[:, -1]
    logits = model.output(x).float()
    # In place: a new (rows x V) tensor costs page faults.
    logp = torch.log_softmax(logits, dim=-1, out=logits)
    # Never generated, masked after normalising: PAD, BOS, the ids past the tokenizer's (no text).
    logp[:, [cfg.pad_id, cfg.bos_id]] = -math.inf
    first_unused = cfg.tokenizer_size or cfg.vocab_size  # 0: every id has text
    logp[:, first_unused:] = -math.inf
    return logp


@torch.no_grad()
def greedy_decode(model, src, max_len_a=1.0, max_len_b=50):
    """-> for each sentence [(tokens without BOS/EOS, summed log-probability)].
    Sentences leave the batch as they end."""
    cfg, B = model.cfg, src.size(0)
    limit = max_lengths(model, src, max_len_a, max_len_b)
    memory, src_mask = model.encode(src)
    cache = model.new_cache()
    tokens = src.new_full((B, 1), cfg.bos_id)
    score = torch.zeros(B, device=src.device)
    active = torch.arange(B, device=src.device)  # each row's sentence
    out = [None] * B
    for t in range(int(limit.max())):
        logp = next_log_probs(model, tokens[:, -1:], memory, src_mask, cache)
        best, nxt = logp.max(-1)
        at_limit = t + 1 >= limit  # the longest output allowed must end here
        nxt = torch.where(at_limit, cfg.eos_id, nxt)
        score += torch.where(at_limit, logp[:, cfg.eos_id], best)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        done = nxt == cfg.eos_id
        if done.any():
            ended = zip(active[done].tolist(), tokens[done, 1:-1].tolist(), score[done].tolist())
            for i, row, s in ended:
                out[i] = [(row, s)]
            keep = (~done).nonzero().squeeze(1)
            if len(keep) == 0:
                break
            active, tokens, score, limit = active[keep], tokens[keep], score[keep], limit[keep]
            memory, src_mask = memory[keep], src_mask[keep]
            M.reorder_cache(cache, keep, keep)
    return out


# Beam search in four parts (fairseq's rules; B sentences x k beams): score the 2k best candidates,
# finish the EOS ones among the k best, keep the k best others alive, stop.


def top_tokens(logp, n):
    """logp.topk(n, dim=1), faster: a row's n best lie in the n best of its V/8 column groups
    (j, j + V/8, ..., 8 columns each), ranked by their maxima."""
    R, V = logp.shape
    if V % 8 or V // 8 < n:
        return logp.topk(n, dim=1)
    width = V // 8
    groups = logp.view(R, 8, width).amax(1).topk(n, dim=1).indices  # columns j + width * 0..7
    cols = groups[:, :, None] + torch.arange(0, V, width, device=logp.device)
    cols = cols.view(R, -1)
    lp, j = logp.gather(1, cols).topk(n, dim=1)
    return lp, cols.gather(1, j)


def candidates(alive, logp, at_limit, k, eos_id):
    """The 2k best continuations of each sentence (k are left if k end in EOS).
    -> scores, beams, tokens."""
    B = alive.size(0)
    n = min(2 * k, logp.size(-1))
    lp, tok = top_tokens(logp, n)  # a beam's n best hold all it can add to its sentence's 2k best
    if at_limit.any():  # a sentence at its length limit can only end
        ended = at_limit.repeat_interleave(k)
        lp[ended] = -math.inf
        tok[ended] = eos_id
        lp[ended, 0] = logp[ended, eos_id]
    scores = alive[:, :, None] + lp.view(B, k, n)
    top, idx = scores.view(B, -1).topk(2 * k, dim=1)
    return top, idx // n, tok.view(B, -1).gather(1, idx)


def finish(fin_scores, fin_tokens, top, src_beam, tok, tokens, t, alpha, eos_id):
    """EOS candidates among the k best (fairseq: beam 1 = greedy) join the k best finished,
    scored log P / lp."""
    B, k = fin_scores.shape
    L = fin_tokens.size(2) - 1
    finishes = (tok == eos_id) & (torch.arange(2 * k, device=tok.device) < k)
    eos_scores = torch.where(finishes, top / length_penalty(t + 1, alpha), -math.inf)
    # each candidate's tokens: its beam's history without BOS, its own token, EOS up to L + 1
    hist = tokens.view(B, k, -1).gather(1, src_beam[:, :, None].expand(-1, -1, t + 1))
    cand_tokens = torch.cat([hist[:, :, 1:], tok[:, :, None]], 2)
    cand_tokens = F.pad(cand_tokens, (0, L - t), value=eos_id)
    fin_scores, order = torch.cat([fin_scores, eos_scores], 1).topk(k, dim=1)
    index = order[:, :, None].expand(-1, -1, L + 1)
    fin_tokens = torch.cat([fin_tokens, cand_tokens], 1).gather(1, index)
    return fin_scores, fin_tokens


def keep_alive(top, src_beam, tok, tokens, eos_id):
    """The k best candidates not ending in EOS live on.
    -> scores, histories, the rows they came from."""
    B, k = top.size(0), top.size(1) // 2
    alive, order = torch.where(tok == eos_id, -math.inf, top).topk(k, dim=1)
    beam = src_beam.gather(1, order)  # within the sentence
    beam_idx = (beam + torch.arange(B, device=top.device)[:, None] * k).view(-1)
    history = tokens[beam_idx]
    new = tok.gather(1, order).view(-1, 1)
    return alive, torch.cat([history, new], 1), beam_idx


def can_stop(fin_scores, alive, limit, t, alpha, nbest, exact=False):
    """Done at the length limit, or once k finished (fairseq); exact: once no live beam can win
    (tensor2tensor)."""
    if exact:
        best_reachable = alive[:, 0] / length_penalty(limit.float(), alpha)
        return (fin_scores[:, nbest - 1] >= best_reachable) | (t + 1 >= limit)
    return (fin_scores[:, -1] > -math.inf) | (t + 1 >= limit)


@torch.no_grad()
def beam_search(model, src, beam=4, alpha=0.6, max_len_a=1.0, max_len_b=50, nbest=1, exact=False):
    """Sentences x beams. -> for each sentence the nbest [(tokens, log P(Y|X) / lp(|Y|))],
    |Y| counting EOS."""
    cfg, dev = model.cfg, src.device
    B, k = src.size(0), beam
    memory, src_mask = model.encode(src)  # a row per sentence for its k beams (MultiHeadAttention)
    limit = max_lengths(model, src, max_len_a, max_len_b)  # (B,)
    cache = model.new_cache()
    tokens = src.new_full((B * k, 1), cfg.bos_id)
    L = int(limit.max())
    alive = torch.full((B, k), -math.inf, device=dev)  # the live beams' log P
    fin_scores = torch.full((B, k), -math.inf, device=dev)  # the finished ones' log P / lp
    alive[:, 0] = 0.0  # all beams start identical: expand only one
    fin_tokens = src.new_full((B, k, L + 1), cfg.pad_id)
    # Finished sentences leave the batch: their results move to out_*, the other state shrinks.
    active = torch.arange(B, device=dev)
    out_scores, out_tokens = fin_scores.clone(), fin_tokens.clone()
    for t in range(L):
        if t == 0:  # a sentence's k beams are one (BOS): one row each, its log-probs copied
            logp = next_log_probs(model, tokens[::k], memory, src_mask, cache)
            logp = logp.repeat_interleave(k, 0)
        else:
            logp = next_log_probs(model, tokens[:, -1:], memory, src_mask, cache)
        top, src_beam, tok = candidates(alive, logp, t + 1 >= limit, k, cfg.eos_id)
        fin_scores, fin_tokens = finish(fin_scores, fin_tokens, top, src_beam, tok, tokens, t,
                                        alpha, cfg.eos_id)
        alive, tokens, beam_idx = keep_alive(top, src_beam, tok, tokens, cfg.eos_id)
        if t == 0:  # step 0 cached one row per sentence
            M.reorder_cache(cache, beam_idx // k)
        else:  # from then on one per beam
            M.reorder_cache(cache, beam_idx)
        done = can_stop(fin_scores, alive, limit, t, alpha, nbest, exact)
        if done.any():
            out_scores[active[done]] = fin_scores[done]
            out_tokens[active[done]] = fin_tokens[done]
            keep = (~done).nonzero().squeeze(1)
            if len(keep) == 0:
                break
            rows = (keep[:, None] * k + torch.arange(k, device=dev)).view(-1)  # their beams
            active = active[keep]
            alive = alive[keep]
            limit = limit[keep]
            fin_scores = fin_scores[keep]
            fin_tokens = fin_tokens[keep]
            tokens = tokens[rows]
            memory = memory[keep]
            src_mask = src_mask[keep]
            M.reorder_cache(cache, rows, keep)
    results = []
    for toks, scores in zip(out_tokens.tolist(), out_scores.tolist()):
        hyps = []
        for row, score in zip(toks, scores):
            if score > -math.inf:  # a finished hypothesis: its tokens up to EOS
                hyps.append((row[:row.index(cfg.eos_id)], score))
        results.append(hyps[:nbest])
    return results


def corpus_bleu(model, data, refs, enc, beam, alpha, rank=0, world=1, ddp=False):
    """train.py's validation BLEU: beam search in batches of 4096 source tokens, as translate.py's,
    over every rank's share of data's sources (those over max_len: ''), against refs."""
    device = next(model.parameters()).device
    srcs = dataset.sources(data, rank, world, model.cfg.max_len, model.cfg.eos_id)
    best = {}
    for batch in length_batches(srcs, 4096):
        out = beam_search(model, padded(srcs, batch, model.cfg.pad_id, device), beam, alpha)
        for key, nbest in zip(batch, out):
            best[key] = nbest[0][0]
    for share in cluster.gather(best, ddp, world):
        best.update(share)
    hyps = [enc.decode(best.get(i, [])) for i in range(len(refs))]
    return BLEU().corpus_score(hyps, [refs]).score
