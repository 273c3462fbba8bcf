"""
The A/B behind docs/performance.md, "Training on real target tokens": the plain loss over all
(B x T) target positions (as train.py computed it until d2e49a4) against model.label_smoothed_loss
over the real tokens only.
    python dev/loss_ab.py data/multi30k_en_de step   # the recipe's step, alternating in one process
    python dev/loss_ab.py - mem chunked|plain        # one 25k-token step of base, vocabulary 37000
    python dev/loss_ab.py - memtiny chunked|plain    # the same, tiny (d_model 64, 1+1 layers)
    python dev/loss_ab.py - mem checkpointed         # chunked, with checkpoint_activations=True
    PAIR=chunked,checkpointed python dev/loss_ab.py data/multi30k_en_de step   # recomputing's cost
DTYPE=float32 picks float32 (default: speed.fast_dtype). Measurements, not a test: free cores.
"""

import os
import resource
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dataset  # noqa: E402
import model as M  # noqa: E402
import speed  # noqa: E402


def plain_loss(logits, target, eps=0.1, pad_id=0):  # d2e49a4's label_smoothed_loss
    V = logits.size(-1)
    logp = F.log_softmax(logits.reshape(-1, V).float(), dim=-1)
    target = target.reshape(-1)
    keep = target != pad_id
    nll = F.nll_loss(logp, target, ignore_index=pad_id, reduction='sum')
    smooth = -torch.where(keep, logp.sum(dim=-1), 0.0).sum()
    eps_i = eps / (V - 1)
    return (1.0 - eps - eps_i) * nll + eps_i * smooth, nll.detach(), keep.sum()


def build(cfg):  # the model as train.py trains it on a CPU, and its optimizer
    torch.manual_seed(0)
    model = M.Transformer(cfg).train()
    speed.cpu_dropout(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
    return model, opt


def checkpointed(model, on):  # as train.py's checkpoint_activations: backward recomputes each layer
    for layer in (*model.encoder, *model.decoder):
        if on:
            f = type(layer).forward.__get__(layer)

            def forward(*a, f=f):
                return torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False)
            layer.forward = forward
        else:
            layer.__dict__.pop('forward', None)


def step(model, opt, batch, how, autocast, pad):
    src, tgt_in, tgt_out = batch
    checkpointed(model, how == 'checkpointed')
    with autocast:
        if how == 'plain':
            loss, _, n = plain_loss(model(src, tgt_in), tgt_out, 0.1, pad)
        else:
            flat = tgt_out.numpy().reshape(-1)
            rows = torch.from_numpy(np.flatnonzero(flat != pad))
            targets = torch.from_numpy(flat[rows.numpy()])
            x = model(src, tgt_in, rows)
            loss, _ = M.label_smoothed_loss(x, model.embed.weight, targets, 0.1)
            n = len(rows)
    (loss / n).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def multi30k_batches(data_dir):
    """The Multi30k recipe's model and its first 130 batches of 2048 tokens."""
    meta = dataset.load_meta(data_dir)
    cfg = M.Config(vocab_size=(meta['vocab_size'] + 7) // 8 * 8, n_enc_layers=3, n_dec_layers=3,
                   d_model=256, d_ff=1024, n_heads=4, dropout=0.2, pre_norm=True)
    data = dataset.load_split(data_dir, 'train')
    plan = dataset.batch_plan(data, 2048, 1337, 0)
    batches = []
    for ids in plan[:130]:
        src, tgt_in, rows, targets = dataset.collate(data, ids, 0, 1, 2)
        tgt_out = np.zeros(tgt_in.size, np.int64)
        tgt_out[rows] = targets
        tgt_out = tgt_out.reshape(tgt_in.shape)
        batches.append(tuple(map(torch.from_numpy, (src, tgt_in, tgt_out))))
    return cfg, batches


def alternate(data_dir, autocast, dtype):
    """The two paths of PAIR on the recipe's steps, in rounds of 10 steps, medians."""
    cfg, batches = multi30k_batches(data_dir)
    model, opt = build(cfg)
    a, b = os.environ.get('PAIR', 'plain,chunked').split(',')
    for batch in batches[:10]:  # warm-up, both paths
        step(model, opt, batch, a, autocast, 0)
        step(model, opt, batch, b, autocast, 0)
    times = {a: [], b: []}
    for r in range(12):  # rounds of 10 steps each, alternating which path goes first
        order = (a, b) if r % 2 == 0 else (b, a)
        for how in order:
            t = time.perf_counter()
            for batch in batches[10 + 10 * r:20 + 10 * r]:
                step(model, opt, batch, how, autocast, 0)
            times[how].append(time.perf_counter() - t)
    med = {k: float(np.median(v)) / 10 * 1e3 for k, v in times.items()}
    print(f"dtype {dtype}: ms/step, median of 12 rounds of 10: {a} {med[a]:.1f}, {b} {med[b]:.1f}, "
          f"{b}/{a} {med[b] / med[a]:.3f}")


def peak_memory(mode, how, autocast, dtype):
    """One 25k-token step of base (mode 'mem'), or of a tiny model, with a 37000 vocabulary: peak
    resident memory."""
    if mode == 'mem':
        cfg = M.Config(**M.PRESETS['base'], vocab_size=37000)
    else:
        cfg = M.Config(vocab_size=37008, n_enc_layers=1, n_dec_layers=1, d_model=64, d_ff=256,
                       n_heads=4)
    model, opt = build(cfg)
    g = torch.Generator().manual_seed(0)
    # 25000 padded tokens per side; the last 2 target positions padding (92% real)
    B, S, T = 1000, 25, 25
    src = torch.randint(3, 37000, (B, S), generator=g)
    tgt_in = torch.randint(3, 37000, (B, T), generator=g)
    tgt_out = torch.randint(3, 37000, (B, T), generator=g)
    tgt_out[:, -2:] = 0
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    t = time.perf_counter()
    step(model, opt, (src, tgt_in, tgt_out), how, autocast, 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"{mode} {how}: dtype {dtype}, peak RSS {peak:.2f} GB (before the step {base:.2f} GB), "
          f"step {time.perf_counter() - t:.1f} s")


def main():
    data_dir, mode = sys.argv[1], sys.argv[2]
    speed.keep_freed_memory(keep=sys.argv[3:] != ['checkpointed'])  # as train.py on a CPU
    dtype = os.environ.get('DTYPE') or speed.fast_dtype('cpu')
    if dtype == 'bfloat16':
        torch.backends.cuda.enable_flash_sdp(False)
    autocast = torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == 'bfloat16')
    if mode == 'step':
        alternate(data_dir, autocast, dtype)
    else:
        peak_memory(mode, sys.argv[3], autocast, dtype)


if __name__ == '__main__':
    main()
