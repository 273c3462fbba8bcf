import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import decode
import model as M

PAD, BOS, EOS = 0, 1, 2


def tiny(pre_norm=False, vocab=24, **kw):
    torch.manual_seed(0)
    sizes = dict(vocab_size=vocab, n_enc_layers=2, n_dec_layers=2, d_model=32, d_ff=64, n_heads=4)
    cfg = M.Config(**{**sizes, 'dropout': 0.0, 'pre_norm': pre_norm, 'max_len': 64, **kw})
    return M.Transformer(cfg).eval()


# Table 3's variations of tiny (d_model 32, h 4, d_k = d_v = 8): row (E) learned positions;
# d_k = d_v = d_head apart from d_model / h, as row (A) (h 8 x d_k 4 = d_model) and row (B)
# (d_k 2 at h 4: h d_k < d_model).
VARIATIONS = {
    'E_learned': dict(positions='learned'),
    'A_h8_dk4': dict(n_heads=8, d_head=4),
    'B_dk2': dict(d_head=2),
}


def pad_batch(seqs):
    T = max(map(len, seqs))
    return torch.tensor([s + [PAD] * (T - len(s)) for s in seqs])


def seq_log_prob(model, src_tokens, hyp):
    """Log P(hyp + EOS | src) by one plain forward pass (teacher forcing)."""
    src = torch.tensor([src_tokens])
    tgt_in, tgt_out = torch.tensor([[BOS] + hyp]), torch.tensor([hyp + [EOS]])
    logp = F.log_softmax(model(src, tgt_in).double(), -1)
    return logp.gather(-1, tgt_out[..., None]).sum().item()


def test_output_shapes():
    m = tiny()
    logits = m(torch.randint(3, 24, (3, 7)), torch.randint(3, 24, (3, 5)))
    assert logits.shape == (3, 5, 24)


@pytest.mark.parametrize('pre_norm', [False, True])
def test_padding_never_changes_real_positions(pre_norm):
    m = tiny(pre_norm)
    src, tgt = [5, 6, 7, EOS], [BOS, 8, 9]
    alone = m(torch.tensor([src]), torch.tensor([tgt]))[0]
    srcs = pad_batch([[3, 4, 5, 6, 7, 8, 9, 10, EOS], src, [4] * 12 + [EOS]])
    tgts = pad_batch([[BOS, 3, 3, 3, 3, 3, 3], tgt, [BOS, 9]])
    batch = m(srcs, tgts)[1, :len(tgt)]
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=0)
    mem_alone = m.encode(torch.tensor([src]))[0][0]
    mem_batch = m.encode(pad_batch([[4] * 10 + [EOS], src]))[0][1, :len(src)]
    torch.testing.assert_close(mem_batch, mem_alone, atol=1e-5, rtol=0)


def test_attention_weights_times_v_are_sdpa_output():
    # Equation (1) written out (plot.py's pictures) against the SDPA call of training and
    # decoding, masked by key padding, causally (is_causal aligns top-left, here 3 queries over
    # 5 keys) and with no key left.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    padding = torch.tensor([[True] * 5, [True, True, False, False, False]])[:, None, None, :]
    causal = torch.ones(3, 5, dtype=torch.bool).tril()
    none = torch.zeros(3, 5, dtype=torch.bool)
    cases = [(None, {}), (padding, dict(attn_mask=padding)), (causal, dict(is_causal=True)),
             (none, dict(attn_mask=none))]
    for mask, sdpa in cases:
        w = M.attention_weights(q, k, mask)
        want = F.scaled_dot_product_attention(q, k, v, **sdpa)
        torch.testing.assert_close(w @ v, want, atol=1e-6, rtol=0)
    assert (w == 0).all()  # no key left: SDPA's zeros, not 0/0


def test_decoder_is_causal():
    m = tiny()
    src = torch.randint(3, 24, (2, 6))
    tgt = torch.randint(3, 24, (2, 8))
    changed = tgt.clone()
    changed[:, 5:] = torch.randint(3, 24, (2, 3))
    a, b = m(src, tgt), m(src, changed)
    torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


NORMS = [(False, {}), (True, {}), *((True, v) for v in VARIATIONS.values())]


@pytest.mark.parametrize('pre_norm,kw', NORMS, ids=['post_norm', 'pre_norm', *VARIATIONS])
def test_cache_matches_full_forward(pre_norm, kw):
    m = tiny(pre_norm, **kw)
    src = pad_batch([[5, 6, 7, 8, EOS], [9, 10, EOS]])
    tgt = torch.randint(3, 24, (2, 9))
    full = m(src, tgt)
    memory, src_mask = m.encode(src)
    cache = m.new_cache()
    for t in range(tgt.size(1)):
        step = m.output(m.decode(tgt[:, t:t + 1], memory, src_mask, cache))[:, 0]
        torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=0)


@pytest.mark.parametrize('kw', [{}, *VARIATIONS.values()], ids=['base', *VARIATIONS])
def test_beams_share_one_copy_of_the_source(kw):
    # Beam search passes one memory row per sentence for its k consecutive decoder rows.
    m, k = tiny(**kw), 3
    memory, src_mask = m.encode(pad_batch([[5, 6, 7, 8, EOS], [9, 10, EOS]]))
    tgt = torch.randint(3, 24, (2 * k, 6))
    repeated = m.decode(tgt, memory.repeat_interleave(k, 0), src_mask.repeat_interleave(k, 0))
    torch.testing.assert_close(m.decode(tgt, memory, src_mask), repeated, atol=1e-5, rtol=0)
    cache = m.new_cache()
    for t in range(tgt.size(1)):
        step = m.decode(tgt[:, t:t + 1], memory, src_mask, cache)[:, 0]
        torch.testing.assert_close(step, repeated[:, t], atol=1e-5, rtol=0)


def test_cached_decoding_compiles_as_one_graph():
    # translate.py --compile compiles decode: a graph break there would leave the step to eager
    # pieces.
    m = tiny()
    memory, src_mask = m.encode(pad_batch([[5, 6, 7, EOS], [9, 10, EOS]]))
    step = torch.compile(m.decode, backend='eager', fullgraph=True, dynamic=True)
    eager_cache, cache, order = m.new_cache(), m.new_cache(), torch.tensor([1, 0])
    with torch.no_grad():
        for t in range(3):
            tok = torch.full((2, 1), 3 + t)
            want = m.decode(tok, memory, src_mask, eager_cache)
            torch.testing.assert_close(step(tok, memory, src_mask, cache), want)
            M.reorder_cache(cache, order)
            M.reorder_cache(eager_cache, order)


def test_training_layers_compile_as_one_graph_each():
    # train.py compiles each layer with dynamic shapes: a graph break (once: a symbolic
    # is_causal) leaves pieces of every decoder layer eager, unfused, between graphs.
    m = tiny().train()
    src = pad_batch([[5, 6, 7, EOS], [9, 10, EOS]])
    tgt = torch.tensor([[BOS, 5, 6], [BOS, 8, 9]])
    for layer in [*m.encoder, *m.decoder]:
        layer.compile(backend='eager', fullgraph=True, dynamic=True)  # a graph break raises
    for n in (3, 5):
        m(src, torch.cat([tgt] * n, 1)).sum().backward()


def test_positional_encoding_matches_formula():
    pe = M.sinusoidal_positions(100, 16)
    for pos, i in [(0, 0), (1, 0), (7, 3), (50, 5), (99, 7)]:
        angle = pos / 10000 ** (2 * i / 16)
        assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_positional_encoding_matches_formula_for_odd_d_model():
    # d_model = 15 with 3 heads is a valid Config; the table has 8 sines and 7 cosines.
    pe = M.sinusoidal_positions(20, 15)
    for pos, i in [(0, 0), (3, 2), (19, 7)]:
        angle = pos / 10000 ** (2 * i / 15)
        assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        if 2 * i + 1 < 15:
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_learned_positions_are_a_trained_table_in_place_of_the_sinusoids():
    # Row (E): a parameter, saved, drawn as the embeddings are, indexed alike (a slice, or
    # packed positions).
    fixed, learned = tiny(), tiny(**VARIATIONS['E_learned'])
    assert 'pe' not in fixed.state_dict() and 'pe' in dict(learned.named_parameters())
    assert learned.pe.shape == fixed.pe.shape == (64, 32)
    assert learned.pe.std().item() == pytest.approx(32 ** -0.5, rel=0.1)
    learned(torch.tensor([[5, EOS]]), torch.tensor([[BOS, 6]])).sum().backward()
    assert (learned.pe.grad[:2] != 0).all() and (learned.pe.grad[2:] == 0).all()  # the ones used
    for m in (fixed, learned):
        with pytest.raises(ValueError, match='max_len=64'):
            m.encode(torch.full((1, 65), 5))


def test_three_embeddings_are_one_tensor():
    m = tiny()
    tensors = [p for n, p in m.named_parameters() if p.shape == m.embed.weight.shape]
    assert len(tensors) == 1
    # the pre-softmax projection really is the embedding: logits move when the embedding does
    src, tgt = torch.tensor([[5, EOS]]), torch.tensor([[BOS]])
    before = m(src, tgt)
    with torch.no_grad():
        m.embed.weight[7] += torch.randn(32)
    after = m(src, tgt)
    assert (after - before)[0, 0, 7].abs() > 1e-3


def analytic_params(V, d, ff, N, hd=None, learned_positions=0):
    hd = hd or d  # h * d_k = h * d_v
    attn = 3 * (d * hd + hd) + hd * d + d  # W^Q, W^K, W^V: d_model -> h d_k; W^O: h d_v -> d_model
    ffn = 2 * d * ff + ff + d
    encoder = N * (attn + ffn + 2 * 2 * d)
    decoder = N * (2 * attn + ffn + 3 * 2 * d)
    return V * d + encoder + decoder + learned_positions * d


@pytest.mark.parametrize('name,paper', [('base', 65e6), ('big', 213e6)])
def test_parameter_counts_match_paper(name, paper):
    cfg = M.Config(**M.PRESETS[name], vocab_size=37000)
    with torch.device('meta'):  # shapes only: no memory, no init time
        n = M.Transformer(cfg).num_params()
    expected = analytic_params(37000, cfg.d_model, cfg.d_ff, 6)
    print(f"{name}: {n / 1e6:.2f}M parameters (paper: {paper / 1e6:.0f}M)")
    assert n == expected
    assert abs(n - paper) / paper < 0.05


TABLE_3_ROWS = [
    ('A', dict(n_heads=1, d_head=512), 512),
    ('A', dict(n_heads=16, d_head=32), 512),
    ('B', dict(d_head=16), 8 * 16),
    ('B', dict(d_head=32), 8 * 32),
    ('E', dict(positions='learned'), 512),
]


@pytest.mark.parametrize('row,kw,h_dk', TABLE_3_ROWS)
def test_parameter_counts_of_table_3_variations_by_hand(row, kw, h_dk):
    # Row (B) here shrinks d_v with d_k (one d_head): 48.9M and 53.6M. The paper's 58M and 60M
    # (65M base) are what shrinking d_k alone removes: its (B) kept d_v 64.
    cfg = M.Config(**{**M.PRESETS['base'], **kw}, vocab_size=37000)
    with torch.device('meta'):
        n = M.Transformer(cfg).num_params()
    print(f"({row}) {kw}: {n / 1e6:.2f}M parameters")
    learned = cfg.max_len if row == 'E' else 0
    assert n == analytic_params(37000, 512, 2048, 6, h_dk, learned)


def test_num_params_counts_tied_tensor_once():
    m = tiny()
    assert m.num_params() == sum(p.numel() for p in set(m.parameters()))
    assert m.num_params() == analytic_params(24, 32, 64, 2)


def real_rows(tgt_out):
    rows = (tgt_out.flatten() != PAD).nonzero().squeeze(1)
    return rows, tgt_out.flatten()[rows]


def smoothed_targets(targets, V, eps, dtype=torch.float32):
    """tensor2tensor's and fairseq's target distribution: 1 - eps, each other id eps / (V - 1)."""
    q = torch.full((len(targets), V), eps / (V - 1), dtype=dtype)
    return q.scatter_(1, targets[:, None], 1 - eps)


def test_label_smoothing_gives_eps_over_the_other_classes():
    # tensor2tensor / fairseq: target 1 - eps, each of the V - 1 other ids eps / (V - 1).
    torch.manual_seed(0)
    V, eps = 11, 0.1
    x, w, target = torch.randn(8, 6), torch.randn(V, 6), torch.randint(3, V, (8,))
    loss, nll = M.label_smoothed_loss(x, w, target, eps=eps)
    logits = x @ w.t()
    q = smoothed_targets(target, V, eps)
    torch.testing.assert_close(loss, -(q * F.log_softmax(logits, -1)).sum())
    torch.testing.assert_close(nll, F.cross_entropy(logits, target, reduction='sum'))


def test_the_loss_is_exact_where_logits_span_hundreds_of_nats():
    # loss_chunk clamps logits 80 below a row's top (exp under -87 is subnormal, 9x slower on
    # CPUs): exp(-80) vanishes in the normaliser >= 1 and next to the gradient's eps / (V - 1),
    # so nothing may move.
    torch.manual_seed(0)
    V, eps = 500, 0.1
    logits, target = torch.randn(16, 500) * 100, torch.randint(3, 500, (16,))
    loss, nll, g = M.loss_chunk(logits, torch.eye(V), target, eps)  # x W^T with W = I: the logits
    ref = logits.double().requires_grad_()
    q = smoothed_targets(target, V, eps, torch.float64)
    ref_loss = -(q * F.log_softmax(ref, -1)).sum()
    ref_loss.backward()
    ref_nll = F.cross_entropy(ref, target, reduction='sum')
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(nll.double(), ref_nll, rtol=1e-6, atol=0)
    torch.testing.assert_close(g.double(), ref.grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_chunked_loss_and_every_gradient_equal_the_plain_path_over_real_tokens(dtype):
    # The plain path: full (B, T, V) logits, log_softmax, the smoothed loss over non-pad targets.
    # The chunked one projects only the rows of real tokens, 5 rows at a time (elements=5 * V),
    # gradients in forward.
    m = tiny(vocab=24).train()
    src = pad_batch([[5, 6, 7, 8, EOS], [9, 10, EOS], [4, EOS]])
    tgt_out = pad_batch([[5, 6, 7, EOS], [8, EOS], [3, 4, 5, 6, 7, 8, EOS]])
    shifted = tgt_out[:, :-1].masked_fill(tgt_out[:, :-1] == EOS, PAD)
    tgt_in = torch.cat([torch.full((3, 1), BOS), shifted], 1)
    rows, targets = real_rows(tgt_out)
    eps, V = 0.1, 24
    autocast = torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    with autocast:
        logp = F.log_softmax(m(src, tgt_in).flatten(0, 1)[rows].float(), -1)
    q = smoothed_targets(targets, V, eps)
    plain = -(q * logp).sum()
    want = torch.autograd.grad(plain, list(m.parameters()))
    with autocast:
        x = m(src, tgt_in, rows)
        loss, nll = M.label_smoothed_loss(x, m.embed.weight, targets, eps, elements=5 * V)
    got = torch.autograd.grad(loss, list(m.parameters()))
    if dtype == torch.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
    else:
        tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, plain, **tol)
    torch.testing.assert_close(nll, -logp.gather(1, targets[:, None]).sum(), **tol)
    for (name, _), a, b in zip(m.named_parameters(), got, want):
        torch.testing.assert_close(a, b, **tol, msg=name)


def test_loss_chunks_are_projected_in_the_compute_dtype_without_a_cast_per_chunk():
    # Under bf16 autocast each chunk gets x and W already in bf16 (on an H200, casting W per chunk
    # and the float32 d loss / d logits afterwards took 3 of 53 ms per step) and returns d loss /
    # d logits in bf16; on a CPU a chunk's float32 logits stay within 2**24 elements.
    seen, V = [], 40000

    def spy(x, w, target, eps):
        out = M.loss_chunk(x, w, target, eps)
        seen.append((x.dtype, w.dtype, out[2].dtype, x.size(0)))
        return out

    x = torch.randn(1000, 8, requires_grad=True)
    w = torch.randn(V, 8, requires_grad=True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        loss, _ = M.label_smoothed_loss(x, w, torch.randint(3, V, (1000,)), 0.1, spy)
    loss.backward()
    assert {s[:3] for s in seen} == {(torch.bfloat16,) * 3}
    assert x.grad.dtype == w.grad.dtype == torch.float32
    rows = 2 ** 24 // V
    assert [s[3] for s in seen] == [rows, rows, 1000 - 2 * rows]


def test_the_loss_under_no_grad_computes_no_gradients():
    # train.py validates under no_grad, where the shared embedding still requires grad: the two
    # gradient matmuls (and a float32 V x d buffer) would be work thrown away.
    from torch.utils.flop_counter import FlopCounterMode

    x, w = torch.randn(6, 8), torch.randn(40, 8, requires_grad=True)
    target = torch.randint(3, 40, (6,))
    flops = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as counter:
            M.label_smoothed_loss(x, w, target)
        flops.append(counter.get_total_flops())
    assert flops == [2 * 6 * 8 * 40, 3 * 2 * 6 * 8 * 40]  # the logits; with grad, d/dx and d/dW too


def test_a_non_finite_gradient_norm_makes_the_optimizer_step_a_no_op():
    model = tiny()
    opt = M.configure_optimizer(model, lr=1e-2, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    for norm, skipped in ((math.inf, True), (math.nan, True), (3.0, False)):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        assert M.skip_if_non_finite(opt, torch.tensor(norm)).item() == skipped
        opt.step()
        same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert same == skipped  # weights (and their decay) untouched only on a skip
        moments = [s['exp_avg'].abs().sum().item() for s in opt.state.values()]
        assert (max(moments) == 0) == skipped


@pytest.mark.parametrize('d_head', [0, 4])
def test_init_is_xavier_per_matrix_of_the_paper(d_head):
    # Q, K and V each Xavier as their own d x h d_k matrix; the FFN and output projections plain.
    torch.manual_seed(0)
    d, ff, hd = 64, 512, 4 * (d_head or 16)
    cfg = M.Config(vocab_size=24, n_enc_layers=1, n_dec_layers=1, d_model=d, d_ff=ff, n_heads=4,
                   d_head=d_head)
    layer = M.Transformer(cfg).decoder[0]
    matrices = [
        (layer.ffn.w1.weight, d + ff),
        (layer.ffn.w2.weight, d + ff),
        (layer.self_attn.out_proj.weight, d + hd),
        (layer.cross_attn.q_proj.weight, d + hd),
        *[(w, d + hd) for w in layer.self_attn.qkv_proj.weight.split(hd)],
        *[(w, d + hd) for w in layer.cross_attn.kv_proj.weight.split(hd)],
    ]
    for w, fan_sum in matrices:
        bound = (6 / fan_sum) ** 0.5
        assert 0.95 * bound < w.abs().max().item() <= bound


def test_beam_of_one_is_greedy():
    # With alpha = 0 a live beam can never beat a finished one, so beam 1 must reproduce greedy
    # exactly (with alpha > 0 beam 1 may rightly continue past greedy's EOS; see beam_search).
    m = tiny(vocab=12)
    src = pad_batch([[5, 6, 7, EOS], [3, 4, 5, 6, 7, 8, EOS], [9, EOS]])
    greedy = decode.greedy_decode(m, src, max_len_b=10)
    beam = decode.beam_search(m, src, beam=1, alpha=0.0, max_len_b=10)
    assert [g[0][0] for g in greedy] == [b[0][0] for b in beam]
    for g, b in zip(greedy, beam):
        assert g[0][1] == pytest.approx(b[0][1], abs=1e-4)


@pytest.mark.parametrize('alpha', [0.0, 0.6, 1.0])
def test_beam_scores_sorted_and_equal_forward_log_prob(alpha):
    m = tiny(vocab=12)
    srcs = [[5, 6, 7, EOS], [3, 4, 5, 6, 7, 8, EOS], [9, EOS]]
    out = decode.beam_search(m, pad_batch(srcs), beam=4, alpha=alpha, max_len_b=8, nbest=4)
    for src, hyps in zip(srcs, out):
        assert len(hyps) == 4
        scores = [s for _, s in hyps]
        assert scores == sorted(scores, reverse=True)
        for hyp, score in hyps:
            expected = seq_log_prob(m, src, hyp) / decode.length_penalty(len(hyp) + 1, alpha)
            assert score == pytest.approx(expected, abs=1e-4)


def test_top_tokens_equal_topk():
    torch.manual_seed(0)
    logp = F.log_softmax(torch.randn(50, 8 * 97) * 4, -1)
    logp[:5, :20] = -math.inf
    logp[5:10, torch.arange(8) * 97 + 3] = torch.arange(8.0)  # the 8 best all in one column group
    for n in (1, 8, 97):
        want, got = logp.topk(n, dim=1), decode.top_tokens(logp, n)
        assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)
    odd = logp[:, :99]  # V % 8 != 0
    assert torch.equal(decode.top_tokens(odd, 8)[1], odd.topk(8, dim=1).indices)


class Scripted(torch.nn.Module):
    """A 'model' whose next-token distribution is a table keyed by the prefix generated so far; it
    keeps the prefix in the self-attention cache, so beam search reorders it like real keys and
    values."""

    def __init__(self, table, default):
        super().__init__()
        self.cfg = M.Config(vocab_size=6, max_len=64)
        self.table, self.default = table, default

    def encode(self, src):
        return torch.zeros(src.size(0), src.size(1), 1), (src != PAD)[:, None, None, :]

    def new_cache(self):
        return [{'self': {}, 'cross': {}}]

    def decode(self, tokens, memory, src_mask, cache):
        c, new = cache[0]['self'], tokens[:, None, :, None].float()
        if 'k' in c:
            new = M.extend(c['k'], new, c.pop('order', None))
        c['k'] = c['v'] = new
        hist = c['k'][:, 0, :, 0].long()
        probs = [self.table.get(tuple(row[1:]), self.default) for row in hist.tolist()]
        logp = torch.full((len(probs), 6), -math.inf)
        for row, p in enumerate(probs):
            for tok, pr in p.items():
                logp[row, tok] = math.log(pr)
        return logp[:, None, :]

    def output(self, x):
        return x


def test_candidates_match_a_sort_over_every_beam_and_token():
    torch.manual_seed(1)
    B, k, V = 3, 4, 30
    alive = torch.randn(B, k)
    alive[0, 1:] = -math.inf  # a first step: one live beam
    logp = F.log_softmax(torch.randn(B * k, V), -1)
    at_limit = torch.tensor([False, True, False])
    top, beam, tok = decode.candidates(alive, logp, at_limit, k, EOS)
    full = (alive[:, :, None] + logp.view(B, k, V)).clone()
    full[1, :, [t for t in range(V) if t != EOS]] = -math.inf
    want, idx = full.view(B, -1).topk(2 * k, dim=1)
    torch.testing.assert_close(top, want)
    finite = want > -math.inf
    assert torch.equal(beam[finite], (idx // V)[finite])
    assert torch.equal(tok[finite], (idx % V)[finite])


def test_exact_stopping_never_changes_the_nbest(monkeypatch):
    # exact: can_stop ends a sentence once no live beam can enter its nbest; decoding on to the
    # length limit must return the same nbest hypotheses and scores.
    m = tiny(vocab=12)
    torch.manual_seed(2)
    lengths = (1, 3, 4, 6, 2, 5, 7, 3)
    src = pad_batch([torch.randint(3, 12, (n,)).tolist() + [EOS] for n in lengths])

    def never_early(fin, alive, limit, t, alpha, nbest, exact):
        return t + 1 >= limit

    for alpha in (0.0, 0.6, 1.0):
        early = {}
        for n in (1, 4):
            early[n] = decode.beam_search(m, src, beam=4, alpha=alpha, max_len_b=10, nbest=n,
                                          exact=True)
        with monkeypatch.context() as mp:
            mp.setattr(decode, 'can_stop', never_early)
            full = decode.beam_search(m, src, beam=4, alpha=alpha, max_len_b=10, nbest=4)
        for n in (1, 4):  # scores to float precision: the batch shrinks at other steps
            got = [[h for h, _ in hyps[:n]] for hyps in full]
            assert got == [[h for h, _ in hyps] for hyps in early[n]]
            want = [s for hyps in early[n] for _, s in hyps]
            assert [s for hyps in full for _, s in hyps[:n]] == pytest.approx(want, abs=1e-4)
    # The first hypothesis to finish ([] at 0.4) is not the best ([3] at 0.6 x 0.9): no stop
    # before it.
    table = {(): {3: 0.6, EOS: 0.4}, (3,): {EOS: 0.9, 4: 0.1}}
    scripted = Scripted(table, {EOS: 0.99, 3: 0.005, 4: 0.003, 5: 0.002})
    out = decode.beam_search(scripted, torch.tensor([[3, EOS]]), beam=2, alpha=0.0, max_len_b=6,
                        exact=True)
    assert out[0][0][0] == [3]


def test_beam_search_stops_at_k_finished_hypotheses_unless_exact():
    # fairseq's and CTranslate2's rule, the default: [] and [3] finish first and end a beam of 2,
    # though [3, 5] scores higher; the exact rule finds it.
    table = {
        (): {3: 0.9, EOS: 0.06, 4: 0.04},
        (3,): {5: 0.9, EOS: 0.1},
        (4,): {EOS: 1.0},
        (3, 5): {EOS: 0.9, 4: 0.1},
    }
    scripted = Scripted(table, {EOS: 0.99, 3: 0.005, 4: 0.003, 5: 0.002})
    src = torch.tensor([[3, EOS]])
    exact = decode.beam_search(scripted, src, beam=2, alpha=0.0, max_len_b=6, exact=True)
    assert exact[0][0][0] == [3, 5]
    early = decode.beam_search(scripted, src, beam=2, alpha=0.0, max_len_b=6, nbest=2)[0]
    assert [h for h, _ in early] == [[3], []]


def test_beam_never_keeps_an_eos_candidate_alive():
    # Step 2 ranks [3 EOS] > [3 5] > [4 EOS] > [4 5]: [4 EOS] ranks k..2k-1 for k = 2, so it must
    # be dropped, not kept alive to finish later as '[4]' with the score of a longer sequence.
    table = {
        (): {3: 0.5, 4: 0.3, EOS: 0.1, 5: 0.1},
        (3,): {EOS: 0.6, 5: 0.3, 3: 0.05, 4: 0.05},
        (4,): {EOS: 0.4, 5: 0.3, 3: 0.2, 4: 0.1},
        (3, 5): {EOS: 0.2, 3: 0.4, 4: 0.2, 5: 0.2},
    }
    default = {EOS: 0.99, 3: 0.005, 4: 0.003, 5: 0.002}
    m = Scripted(table, default)

    def score(hyp, alpha):
        p, logp = (), 0.0
        for tok in hyp + [EOS]:
            logp += math.log(table.get(p, default)[tok])
            p += (tok,)
        return logp / decode.length_penalty(len(hyp) + 1, alpha)

    for alpha in (0.0, 0.6):
        src = torch.tensor([[3, EOS]])
        hyps = decode.beam_search(m, src, beam=2, alpha=alpha, max_len_b=6, nbest=2)[0]
        for hyp, s in hyps:
            assert s == pytest.approx(score(hyp, alpha), abs=1e-6), (hyp, s)
        assert [4] not in [h for h, _ in hyps]


def test_ids_past_the_tokenizers_are_never_generated():
    # vocab_size rounds the tokenizer's 20 ids up to 24; the 4 added have no text, even where
    # favoured.
    m, favoured = tiny(), torch.zeros(24)
    m.cfg.tokenizer_size = 20
    favoured[20:] = 100.0

    def favouring_output(x):
        return F.linear(x, m.embed.weight) + favoured

    m.output = favouring_output
    src = pad_batch([[5, 6, 7, EOS], [8, EOS]])
    logp = decode.next_log_probs(m, torch.full((2, 1), BOS), *m.encode(src), m.new_cache())
    assert (logp[:, 20:] == -math.inf).all() and (logp[:, 3:20] > -math.inf).all()
    for hyps in (decode.greedy_decode(m, src), decode.beam_search(m, src, nbest=4)):
        assert all(t < 20 for h in hyps for toks, _ in h for t in toks)


def test_outputs_respect_max_length():
    m = tiny(vocab=12)
    src = pad_batch([[5, 6, 7, EOS], [9, EOS]])
    beams = decode.beam_search(m, src, beam=3, max_len_a=0, max_len_b=3, nbest=3)
    for hyps in beams + decode.greedy_decode(m, src, 0, 3):
        assert all(len(h) <= 2 for h, _ in hyps)  # 3 positions: at most 2 tokens and EOS


def test_tiny_model_learns_to_copy():
    torch.manual_seed(0)
    # Seeds 0-11: 10 copy all 200 sentences, greedy and beam (400 steps at lr 3e-3 with 50 of
    # warmup, slower: 9; 2026-12-02); on one thread, as the suite runs it, 9 (0 among them).
    V, steps = 13, 300
    cfg = M.Config(vocab_size=V, n_enc_layers=2, n_dec_layers=2, d_model=64, d_ff=128, n_heads=4,
                   dropout=0.0, max_len=32)  # post-norm, as the paper
    m = M.Transformer(cfg)
    opt = torch.optim.Adam(m.parameters(), lr=5e-3, betas=(0.9, 0.98), eps=1e-9)

    def lr_factor(s):  # 30 steps of warmup, then a linear decay to 0.05
        return min(1, (s + 1) / 30) * max(0.05, 1 - s / steps)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

    def batch(n, g=None):
        seqs = []
        for _ in range(n):
            length = int(torch.randint(2, 9, (1,), generator=g))
            seqs.append(torch.randint(3, V, (length,), generator=g).tolist())
        return seqs, pad_batch([s + [EOS] for s in seqs])

    for step in range(steps):
        seqs, src = batch(64)
        tgt_in = pad_batch([[BOS] + s for s in seqs])
        tgt_out = pad_batch([s + [EOS] for s in seqs])
        rows, targets = real_rows(tgt_out)
        loss, _ = M.label_smoothed_loss(m(src, tgt_in, rows), m.embed.weight, targets, eps=0.0)
        opt.zero_grad()
        (loss / len(rows)).backward()
        opt.step()
        sched.step()
    m.eval()
    seqs, src = batch(200, torch.Generator().manual_seed(123))
    assert [h[0][0] for h in decode.greedy_decode(m, src)] == seqs
    assert [h[0][0] for h in decode.beam_search(m, src, beam=4)] == seqs


def test_import_changes_no_global_setting():
    settings = ('[torch.backends.cuda.cudnn_sdp_enabled(), '
                'torch.backends.cuda.flash_sdp_enabled(), torch.get_default_dtype()]')
    code = f'import torch; before = {settings}; import model; print(before == {settings})'
    here = M.__file__.rsplit('/', 1)[0]
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=here)
    assert out.stdout == 'True\n' and out.stderr == ''


def test_cache_takes_several_new_positions_at_once():
    # decode's cache holds earlier positions and tgt the new ones: a prefix of 4, then 3 more in
    # one call.
    m = tiny(pre_norm=True)
    src = pad_batch([[5, 6, 7, 8, EOS], [9, 10, EOS]])
    tgt = torch.randint(3, 24, (2, 9))
    full = m.decode(tgt, *m.encode(src))
    memory, src_mask = m.encode(src)
    cache = m.new_cache()
    for a, b in ((0, 4), (4, 7), (7, 9)):
        step = m.decode(tgt[:, a:b], memory, src_mask, cache)
        torch.testing.assert_close(step, full[:, a:b], atol=1e-5, rtol=0)


def test_length_cap_is_int_of_a_times_source_plus_b():
    cfg = M.Config(vocab_size=8, n_enc_layers=0, n_dec_layers=0, d_model=8, d_ff=8, n_heads=1,
                   max_len=4096)
    m = M.Transformer(cfg)
    lengths = torch.arange(1, 1001)
    src = (torch.arange(1000)[None, :] < lengths[:, None]).long() * EOS  # row i: i + 1 tokens, PAD
    for a, b in [(0.7, 0), (1.3, 0), (1.3, 50), (1.0, 50), (2.6, 7)]:
        want = [max(1, int(a * n + b)) for n in lengths.tolist()]
        assert decode.max_lengths(m, src, a, b).tolist() == want
    assert decode.max_lengths(m, src[:1], 1e30, 0).item() == 4095
