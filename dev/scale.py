"""
The WMT-scale rehearsal (docs/performance.md, "WMT-size data and checkpoints"): WMT's size
without WMT's data, from Multi30k.

    python dev/scale.py corpus --pairs 4500000 --out data/fake_wmt_4.5M   # .en/.de.gz files
    python data_prep.py custom --train data/fake_wmt_4.5M/train --valid data/fake_wmt_4.5M/valid \\
        --test data/fake_wmt_4.5M/test --src en --tgt de --vocab-size 37000 \\
        --out data/fake_wmt_4.5M_bpe
    python dev/scale.py loader --data data/fake_wmt_4.5M_bpe   # batch plan and batches, as train.py
    python dev/scale.py checkpoints                             # write / average time and size

`corpus` recombines Multi30k sentences into WMT-like pairs: 1 to 3 consecutive-in-the-shuffle
sentence pairs joined (mean about 25 words, as news and Europarl), and 1% of pairs joining 4 to 24
(a tail of a few hundred words). Multi30k has about 20k word types where WMT has millions, so 4% of
the words are replaced, on both sides alike (as a name is copied), by pseudo-words drawn from a
Zipf-distributed pool of 2M: BPE then learns from, and the encoder reads, a realistic number of
types. Not for training a translator. `checkpoints` times base and big models' checkpoints.
"""
import argparse
import dataclasses
import gzip
import os
import resource
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint  # noqa: E402
import data_prep  # noqa: E402
import dataset  # noqa: E402

MULTI30K = data_prep.LOCAL_MULTI30K


def pseudo_words(n, rng):
    """n distinct lowercase pseudo-words of 4 to 12 letters."""
    letters = np.frombuffer(b'abcdefghijklmnopqrstuvwxyz', dtype=np.uint8)
    words = set()
    while len(words) < n:
        m = n - len(words)
        lens = rng.integers(4, 13, m)
        chars = letters[rng.integers(0, 26, int(lens.sum()))].tobytes().decode('ascii')
        ends = np.cumsum(lens)
        words.update(chars[e - l:e] for e, l in zip(ends.tolist(), lens.tolist()))
    words = sorted(words)  # sets iterate in a per-process hash order: sort, then shuffle by rng
    return [words[i] for i in rng.permutation(len(words))]


def make_pairs(src_lines, tgt_lines, n, rng, words=(), rare=0.04, zipf=1.1):
    """Yield n (src, tgt) lines built from the given parallel sentences as the module docstring
    says, with the share `rare` of words drawn from the pseudo-words `words` (one pool for all
    splits, as one language)."""
    pairs = [(s.split(), t.split()) for s, t in zip(src_lines, tgt_lines)]
    # A word replaced needs one on each side.
    src_words, tgt_words = zip(*[(s, t) for s, t in pairs if s and t])
    order = rng.permutation(len(src_words))
    pos, chunk = 0, 100_000
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        joined = rng.choice([1, 2, 3], m, p=[0.3, 0.4, 0.3])
        long = rng.random(m) < 0.01
        joined[long] = rng.integers(4, 25, int(long.sum()))
        for k in joined.tolist():
            if pos + k > len(order):
                order, pos = rng.permutation(len(src_words)), 0
            ids = order[pos:pos + k].tolist()
            pos += k
            s = [w for i in ids for w in src_words[i]]
            t = [w for i in ids for w in tgt_words[i]]
            n_rare = rng.binomial(len(s), rare) if words else 0
            for _ in range(n_rare):
                w = words[min(int(rng.zipf(zipf)) - 1, len(words) - 1)]
                s[int(rng.integers(len(s)))] = w
                t[int(rng.integers(len(t)))] = w
            yield ' '.join(s), ' '.join(t)


def write_corpus(out, pairs, split, langs, n, rng, **kw):
    """split.{lang}.gz for both sides, under temporary names renamed when complete."""
    paths = [os.path.join(out, f'{split}.{lang}.gz') for lang in langs]
    files = []
    for p in paths:
        files.append(gzip.open(p + '.tmp', 'wt', encoding='utf-8', compresslevel=1))
    t0 = time.time()
    for i, (s, t) in enumerate(make_pairs(*pairs, n, rng, **kw), 1):
        files[0].write(s + '\n')
        files[1].write(t + '\n')
        if i % 500_000 == 0:
            print(f'{split}: {i:,} / {n:,} pairs, {time.time() - t0:.0f}s', flush=True)
    for f, p in zip(files, paths):
        f.close()
        os.replace(p + '.tmp', p)


def corpus(args):
    langs = (args.src, args.tgt)

    def read(name, lang):
        return list(data_prep.read_lines(os.path.join(args.multi30k, f'{name}.{lang}.gz')))
    train = [read('train', lang) for lang in langs]
    held_out = [read('val', lang) for lang in langs]
    for name, (src, tgt) in (('train', train), ('val', held_out)):
        some_pair = any(s.split() and t.split() for s, t in zip(src, tgt))
        if len(src) != len(tgt) or not some_pair:
            src_path = os.path.join(args.multi30k, f'{name}.{args.src}.gz')
            sys.exit(f"error: {src_path} has {len(src)} lines and {name}.{args.tgt}.gz {len(tgt)}: "
                     f"a parallel corpus needs as many, not all empty")
    checkpoint.make_writable(args.out, '--out')
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    words = pseudo_words(args.pool, rng) if args.rare > 0 else []
    write_corpus(args.out, train, 'train', langs, args.pairs, rng, words=words, rare=args.rare)
    # newstest-sized held-out sets (3000 pairs) from Multi30k's validation sentences
    for split in ('valid', 'test'):
        write_corpus(args.out, held_out, split, langs, args.held_out, rng, words=words,
                     rare=args.rare)
    print(f'wrote {args.out}: {args.pairs:,} training pairs in {time.time() - t0:.0f}s')


def peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # Linux: kilobytes


def loader(args):
    """train.py's batch plan and batch building on a prepared directory, timed per max_tokens."""
    t0 = time.time()
    data = dataset.load_split(args.data, 'train')
    meta = dataset.load_meta(args.data)
    pairs = len(data[1]) - 1
    tokens = len(data[0]) + len(data[2])
    print(f'{args.data}: {pairs:,} pairs, {tokens:,} tokens, opened in {time.time() - t0:.2f}s; '
          f'peak RSS {peak_rss_gb():.2f} GB')
    for max_tokens in args.max_tokens:
        t0 = time.time()
        plan = dataset.batch_plan(data, max_tokens, seed=1, epoch=0)
        t_plan = time.time() - t0
        over = int((dataset.pair_sizes(data) > max_tokens).sum())
        if not plan:
            sys.exit(f'error: max_tokens {max_tokens} is below every pair of {args.data}: '
                     f'no batch to build')
        if over:
            print(f'max_tokens {max_tokens}: {over:,} pairs over max_tokens {max_tokens} left out, '
                  f'as train.py leaves them')
        n = min(len(plan), args.batches)
        t0 = time.time()
        for ids in plan[:n]:
            dataset.collate(data, ids, meta['pad_id'], meta['bos_id'], meta['eos_id'])
        dt = time.time() - t0
        print(f'max_tokens {max_tokens}: batch_plan {t_plan:.1f}s for {len(plan):,} batches; '
              f'collate {n / dt:,.0f} batches/s ({1e3 * dt / n:.2f} ms each, first {n} of the '
              f'plan); peak RSS {peak_rss_gb():.2f} GB', flush=True)


def checkpoints(args):
    """Random-weight base and big models saved as train.py saves them (weights only, and the full
    state with Adam's moments), then averaged as at the end of training (section 6.1: 5 for base,
    20 for big)."""
    import torch

    import model as M
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name, n_avg in (('base', 5), ('big', 20)):
            cfg = M.Config(**M.PRESETS[name], vocab_size=37000)
            m = M.Transformer(cfg)
            opt = torch.optim.Adam(m.parameters(), fused=True)
            for p in m.parameters():  # Adam's state exists after its first step
                p.grad = torch.zeros_like(p)
            opt.step()
            weights = {'model': m.state_dict(), 'model_cfg': dataclasses.asdict(cfg)}
            t0 = time.time()
            paths = []
            for i in range(n_avg):
                paths.append(os.path.join(tmp, f'ckpt_{i:07d}.pt'))
                checkpoint.save_atomic(weights, paths[-1])
            t_write = (time.time() - t0) / n_avg
            t0 = time.time()
            state = os.path.join(tmp, 'state.pt')
            checkpoint.save_atomic({**weights, 'optimizer': opt.state_dict()}, state)
            t_state = time.time() - t0
            t0 = time.time()
            checkpoint.average_checkpoints(paths)
            t_avg = time.time() - t0
            ckpt_gb = os.path.getsize(paths[0]) / 1e9
            state_gb = os.path.getsize(state) / 1e9
            print(f'{name}: {m.num_params() / 1e6:.0f}M parameters; ckpt_STEP.pt {ckpt_gb:.2f} GB '
                  f'written in {t_write:.1f}s; state_STEP.pt {state_gb:.2f} GB in {t_state:.1f}s; '
                  f'averaging {n_avg} in {t_avg:.1f}s; peak RSS {peak_rss_gb():.2f} GB', flush=True)
            for p in os.listdir(tmp):
                os.remove(os.path.join(tmp, p))
            del m, opt, weights


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='cmd', required=True)
    c = sub.add_parser('corpus', help='write a WMT-sized parallel corpus made from Multi30k')
    c.add_argument('--pairs', type=int, required=True)
    c.add_argument('--out', required=True)
    c.add_argument('--src', default='en')
    c.add_argument('--tgt', default='de')
    c.add_argument('--multi30k', default=MULTI30K, help='folder with train/val.{src,tgt}.gz')
    c.add_argument('--held-out', type=int, default=3000,
                   help='pairs in valid and in test (newstest: ~3000)')
    c.add_argument('--pool', type=int, default=2_000_000,
                   help='pseudo-words to draw rare words from')
    c.add_argument('--rare', type=float, default=0.04,
                   help='share of words replaced by pseudo-words')
    c.add_argument('--seed', type=int, default=0)
    c.add_argument('--force', action='store_true', help='replace corpus files already in --out')
    l = sub.add_parser('loader', help="time train.py's batch plan and batch building")
    l.add_argument('--data', required=True, help='a directory prepared by data_prep.py')
    l.add_argument('--max-tokens', type=int, nargs='+', default=[4096, 25000])
    l.add_argument('--batches', type=int, default=2000, help='batches built per max_tokens')
    k = sub.add_parser('checkpoints', help='time writing and averaging base and big checkpoints')
    k.add_argument('--dir', default='.', help='where the temporary checkpoints go')
    args = p.parse_args(argv)
    if args.cmd == 'corpus':
        check_corpus_args(p, args)
    if args.cmd == 'loader' and (args.batches < 1 or min(args.max_tokens) < 1):
        p.error('need --batches >= 1 and --max-tokens >= 1')
    if args.cmd == 'checkpoints' and not os.path.isdir(args.dir):
        p.error(f'--dir {args.dir}: no such folder')
    {'corpus': corpus, 'loader': loader, 'checkpoints': checkpoints}[args.cmd](args)


def check_corpus_args(p, args):
    counts_ok = args.pairs >= 1 and args.held_out >= 1 and args.pool >= 1 and args.seed >= 0
    if not counts_ok or not 0 <= args.rare < 1:
        p.error('need --pairs >= 1, --held-out >= 1, --pool >= 1, --seed >= 0 and 0 <= --rare < 1')
    if args.src == args.tgt:  # both sides would be written to one file
        p.error(f'--src and --tgt are both {args.src}')
    if args.force:
        return
    # a real corpus of these names is not replaced by a fake
    there = []
    for split in ('train', 'valid', 'test'):
        for lang in (args.src, args.tgt):
            name = f'{split}.{lang}.gz'
            if os.path.exists(os.path.join(args.out, name)):
                there.append(name)
    if there:
        p.error(f"--out {args.out} already holds {', '.join(there)}: --force replaces them")


if __name__ == '__main__':
    main()
