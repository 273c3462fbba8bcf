"""speed.py: sentences end to end give the padded batch's loss and gradients; the graphed step
and its all-reduce, as far as a CPU can check them (test_gpu.py runs the flash kernel)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dataset
import model as M
import speed
from test_model import BOS, EOS, PAD, VARIATIONS, pad_batch, real_rows, tiny
from test_train import load_function, toy_corpus


def packed_and_padded_grads(m, src, tgt_out, **pack_kw):
    """(loss, gradients) of one batch padded, then packed by speed.pack (pack_kw: size, max_len)."""
    shifted = tgt_out[:, :-1].masked_fill(tgt_out[:, :-1] == EOS, PAD)
    tgt_in = torch.cat([torch.full_like(src[:, :1], BOS), shifted], 1)
    rows, targets = real_rows(tgt_out)
    src_p, tgt_p, rows_p, sides = speed.pack(src.cpu(), tgt_in.cpu(), PAD, **pack_kw)  # on the host
    packed = tuple(side.to(src.device) for side in sides)
    padded_x = m(src, tgt_in, rows)
    packed_x = speed.forward(m, src_p.to(src.device), tgt_p.to(src.device), rows_p, packed)
    out = []
    for x in (padded_x, packed_x):
        loss, _ = M.label_smoothed_loss(x, m.embed.weight, targets)
        out.append((loss, torch.autograd.grad(loss, list(m.parameters()))))
    return out


MODELS = [(False, {}), (True, {}), (True, {**VARIATIONS['E_learned'], **VARIATIONS['B_dk2']})]


@pytest.mark.parametrize('pre_norm,kw', MODELS, ids=['post_norm', 'pre_norm', 'learned_dk2'])
@pytest.mark.parametrize('pack_kw', [{}, dict(size=40, max_len=8)])
def test_packed_rows_give_the_padded_loss_and_gradients(pre_norm, kw, pack_kw):
    # Sentences end to end attend within themselves alone; size pads both rows with sentences of
    # PAD.
    m = tiny(pre_norm, **kw).train()
    src = pad_batch([[5, 6, 7, 8, EOS], [9, 10, EOS], [4, EOS]])
    tgt_out = pad_batch([[5, 6, 7, EOS], [8, EOS], [3, 4, 5, 6, 7, 8, EOS]])
    (want, want_g), (got, got_g) = packed_and_padded_grads(m, src, tgt_out, **pack_kw)
    torch.testing.assert_close(got, want)
    for (name, _), a, b in zip(m.named_parameters(), got_g, want_g):
        torch.testing.assert_close(a, b, msg=name)


def test_packed_layers_compile_as_one_graph_each():
    # train.py's compile with cuda_graphs: the packed sides reach each layer's attention as an
    # argument, with no graph break.
    m = tiny().train()
    for layer in [*m.encoder, *m.decoder]:
        layer.compile(backend='eager', fullgraph=True, dynamic=True)  # a graph break raises
    for n in (2, 3):
        src = pad_batch([[5, 6, 7, EOS], [9, 10, EOS]] * n)
        s, t, rows, sides = speed.pack(src, src.roll(1, 1), PAD, size=32, max_len=8)
        speed.forward(m, s, t, rows, sides).sum().backward()


def test_pack_lays_sentences_end_to_end_in_few_shapes():
    src, tgt_in = pad_batch([[5, 6, EOS], [7, EOS]]), pad_batch([[BOS, 5, 6], [BOS, 8]])
    s, t, rows, (ps, pt) = speed.pack(src, tgt_in, PAD)
    assert s.tolist() == [[5, 6, EOS, 7, EOS]] and t.tolist() == [[BOS, 5, 6, BOS, 8]]
    assert rows == slice(0, 5)
    assert ps.cu.tolist() == [0, 3, 5] and ps.pos.tolist() == [0, 1, 2, 0, 1] and ps.max_len == 3
    # 7 PADs: sentences of 4 and 3
    s, t, rows, (ps, pt) = speed.pack(src, tgt_in, PAD, size=12, max_len=4)
    assert s.shape == t.shape == (1, 12) and rows == slice(0, 5) and ps.max_len == pt.max_len == 4
    # 8 offsets: a power of two
    assert ps.cu.tolist() == pt.cu.tolist() == [0, 3, 5, 9, 12, 12, 12, 12]
    assert ps.pos.tolist()[5:] == [0, 1, 2, 3, 0, 1, 2]


def test_graphed_captures_once_per_shape_and_gives_the_models_states(monkeypatch):
    # On a CPU the capture is the callable itself: what is checked is what goes in and out.
    captured = []

    def capture(body, inputs):
        captured.append([x.shape for x in inputs])
        return body

    monkeypatch.setattr(torch.cuda, 'make_graphed_callables', capture)
    m = tiny().train()
    graphed = speed.Graphed(m)
    batches = [[[5, 6, EOS], [7, EOS]], [[4, EOS], [8, 9, EOS]], [[k, EOS] for k in range(3, 10)]]
    for src in batches:
        src = pad_batch(src)
        s, t, rows, sides = speed.pack(src, src.roll(1, 1), PAD, size=16, max_len=4)
        want = speed.forward(m, s, t, rows, sides)
        torch.testing.assert_close(graphed(s, t, rows, *sides), want)
    assert len(captured) == 2  # the first two batches share a shape; the third has more sentences
    assert captured[0][:2] == [(1, 16), (1, 16)] and captured[0][2] != captured[1][2]


def test_train_pys_packed_batches_give_its_padded_loss(tmp_path):
    data_dir = toy_corpus(tmp_path)
    meta, data = dataset.load_meta(data_dir), dataset.load_split(data_dir, 'train')
    ids = list(range(6))
    special = {k: meta[k] for k in ('pad_id', 'bos_id', 'eos_id')}
    cfg = M.Config(vocab_size=(meta['vocab_size'] + 7) // 8 * 8, n_enc_layers=1, n_dec_layers=1,
                   d_model=32, d_ff=64, n_heads=4, dropout=0.0, **special)
    get_batch = load_function('get_batch', torch=torch, dataset=dataset, speed=speed,
                              PAD=meta['pad_id'], BOS=meta['bos_id'], EOS=meta['eos_id'],
                              device='cpu', device_type='cpu', max_tokens=256, graph_len=64)
    torch.manual_seed(0)
    m, losses = M.Transformer(cfg), []
    batches = (get_batch(data, ids), get_batch(data, ids, packed=True))
    for src, tgt_in, rows, targets, *sides in batches:
        if sides:
            x = speed.forward(m, src, tgt_in, rows, sides)
        else:
            x = m(src, tgt_in, rows)
        losses.append(M.label_smoothed_loss(x, m.embed.weight, targets)[0])
    assert src.shape == (1, 256 + 64) and len(sides) == 2
    torch.testing.assert_close(losses[1], losses[0])


def average_in_two_processes(rank, init, out):
    dist.init_process_group('gloo', init_method=init, rank=rank, world_size=2)
    m = torch.nn.Linear(3, 2)
    for p in m.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    speed.all_reduce_grads(m)
    torch.save([p.grad for p in m.parameters()], os.path.join(out, f'{rank}.pt'))
    dist.destroy_process_group()


def test_all_reduce_grads_averages_them_as_ddp_does(tmp_path):
    mp.spawn(average_in_two_processes, args=(f'file://{tmp_path}/store', str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        grads = torch.load(tmp_path / f'{rank}.pt')
        assert all(torch.equal(g, torch.full_like(g, 1.5)) for g in grads)
