"""
How fast is model.py, measured on your own machine in one command:

    python bench.py                                     # small model, under 2 minutes on a 2-core CPU
    python bench.py --config base --batch-tokens 8192   # the paper's base model
    python bench.py --data data/NAME --peak h100 --json # real batches, MFU against a table peak, JSON
    python bench.py --translate out/RUN/ckpt.pt --input SRC --ref REF   # decoding real text, vs CTranslate2

Training: forward + backward + Adam step on token-based batches (synthetic lengths, or --data), for
eager and torch.compile, float32 and bfloat16 autocast (bf16 only where native: translate.fast_dtype),
next to torch.nn.Transformer with the same dimensions, batch, masks, loss and optimizer. Achieved FLOP/s
comes from the analytic count in flops_per_step; MFU divides it by a peak (a GPU table, or a GEMM timed
here with --peak measured).
Decoding: greedy with the KV cache and with full recomputation, and beam search, in sentences/s.
--translate: only decoding, of real text by a trained checkpoint: translate.py as a user runs it, one process
per row, on the checkpoint and on its CTranslate2 exports (float32, int8), rows alternating over --rounds.
"""
import argparse
import contextlib
import json
import math
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import data_prep
import model as M
import translate as T

# Configs beyond model.preset: 'small' is Multi30k-sized (what one trains on a laptop), 'tiny' is for tests.
CONFIGS = {
    'tiny': dict(vocab_size=512, n_enc_layers=2, n_dec_layers=2, d_model=64, d_ff=128, n_heads=4),
    'small': dict(vocab_size=8000, n_enc_layers=3, n_dec_layers=3, d_model=256, d_ff=1024, n_heads=4),
}
# Dense (no 2:4 sparsity) tensor-core peaks in FLOP/s from the vendor data sheets; on these GPUs
# float32 matmuls run as TF32 (bench.py turns it on), so the float32 peak is the TF32 one.
PEAKS = {'a100': {'bfloat16': 312e12, 'float32': 156e12},
         'h100': {'bfloat16': 989e12, 'float32': 495e12},   # SXM
         'h200': {'bfloat16': 989e12, 'float32': 495e12}}
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16}


def flops_per_step(cfg, B, S, T):
    """Matmul FLOPs of one training step (forward + backward) over a padded batch: B sentences, source
    padded to S tokens (EOS included), decoder input padded to T. Padded positions are computed like
    real ones, so padded sizes give the work the hardware did. An (m x k) @ (k x n) matmul is 2*m*k*n.
    Conventions: attention counts the full S*S, T*T and T*S score matrices (a causal kernel may skip
    up to half of T*T); layer norm, softmax, dropout, biases and embedding lookups are left out (O(d)
    per token); backward = 2 x forward (gradients of inputs and of weights)."""
    d, f, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    enc_layer = (2 * B * S * (3 * d * d + d * d + 2 * d * f)  # QKV, output projection, FFN, per token
                 + 2 * B * S * S * d * 2)                     # Q K^T and attn @ V, over all heads
    dec_layer = (2 * B * T * (3 * d * d + d * d + 2 * d * f)  # self-attention projections and FFN
                 + 2 * B * T * T * d * 2                      # self-attention scores and values
                 + 2 * B * T * (d * d + d * d)                # cross-attention Q and output projection
                 + 2 * B * S * (2 * d * d)                    # cross-attention K, V from the encoder
                 + 2 * B * T * S * d * 2)                     # cross-attention scores and values
    logits = 2 * B * T * d * V                                # output projection onto the vocabulary
    return 3 * (cfg.n_enc_layers * enc_layer + cfg.n_dec_layers * dec_layer + logits)


# ------------------------------------------------------------------------------------------------
# Batches

def synthetic_pairs(n, vocab, rng, median=25, cap=250):
    # Sentence lengths in subword tokens are roughly lognormal (WMT14 en-de: median ~25, long right
    # tail); the target is about as long as the source, +-15%. Ids avoid the three specials.
    src_len = np.clip(rng.lognormal(math.log(median), 0.5, n).round(), 1, cap).astype(int)
    tgt_len = np.clip((src_len * rng.normal(1.0, 0.15, n)).round(), 1, cap).astype(int)
    return [(rng.integers(3, vocab, a), rng.integers(3, vocab, b)) for a, b in zip(src_len, tgt_len)]


def real_pairs(data_dir, n, rng, cap):
    """n training pairs drawn from a prepared folder, and its meta.json (vocabulary and special ids)."""
    src_tok, src_idx, tgt_tok, tgt_idx = data_prep.load_split(data_dir, 'train')
    pick = rng.choice(len(src_idx) - 1, size=n)
    get = lambda tok, idx, i: np.asarray(tok[idx[i]:idx[i + 1]][:cap], dtype=np.int64)
    return [(get(src_tok, src_idx, i), get(tgt_tok, tgt_idx, i)) for i in pick], data_prep.load_meta(data_dir)


def make_batches(pairs, batch_tokens, cfg, rng, n_batches, device):
    """Token-based batching as in training (data_prep.token_batches: sorted by length, filled while
    sentences x longest side with EOS/BOS stays within batch_tokens), the batches shuffled, n_batches kept."""
    sizes = np.array([max(len(s), len(t)) + 1 for s, t in pairs])
    order = np.argsort(sizes, kind='stable')
    groups = data_prep.token_batches(sizes, order[sizes[order] <= batch_tokens], batch_tokens)  # as batch_plan
    rng.shuffle(groups)
    return [collate([pairs[i] for i in g], cfg, device) for g in groups[:n_batches]]


def pad(seqs, pad_id):
    out = np.full((len(seqs), max(map(len, seqs))), pad_id, dtype=np.int64)
    for row, s in zip(out, seqs):
        row[:len(s)] = s
    return torch.from_numpy(out)


def collate(pairs, cfg, device):
    # README, Formats: src = tokens + EOS, decoder input = BOS + tokens, decoder target = tokens + EOS.
    src = pad([np.append(s, cfg.eos_id) for s, _ in pairs], cfg.pad_id)
    tgt_in = pad([np.insert(t, 0, cfg.bos_id) for _, t in pairs], cfg.pad_id)
    tgt_out = pad([np.append(t, cfg.eos_id) for _, t in pairs], cfg.pad_id)
    return dict(src=src.to(device), tgt_in=tgt_in.to(device), tgt_out=tgt_out.to(device),
                n_src=int((src != cfg.pad_id).sum()), n_tgt=int((tgt_out != cfg.pad_id).sum()))


# ------------------------------------------------------------------------------------------------
# The built-in baseline

class Builtin(nn.Module):
    """torch.nn.Transformer, the library module one would otherwise pick, completed the same way as
    ours: shared embedding and output projection scaled by sqrt(d_model), sinusoidal positions, the
    same masks. Identical parameter count and matmul FLOPs (tested)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.register_buffer('pe', M.sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        with warnings.catch_warnings():  # a notice about the nested-tensor inference fast path
            warnings.simplefilter('ignore')
            self.tf = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_enc_layers, cfg.n_dec_layers, cfg.d_ff,
                                     cfg.dropout, batch_first=True, norm_first=cfg.pre_norm)
        for mha in [m for m in self.tf.modules() if isinstance(m, nn.MultiheadAttention)]:
            mha.dropout = cfg.attn_dropout  # it would reuse `dropout` on attention weights; ours does not
        if not cfg.pre_norm:  # the post-norm paper model (and ours) has no final LayerNorm per stack
            self.tf.encoder.norm = self.tf.decoder.norm = None

    def embed_tokens(self, x):
        return self.dropout(self.embed(x) * math.sqrt(self.cfg.d_model) + self.pe[:x.size(1)])

    def forward(self, src, tgt):
        pad_mask = src == self.cfg.pad_id  # True = ignore (the opposite of model.py's convention)
        causal = torch.ones(tgt.size(1), tgt.size(1), dtype=torch.bool, device=tgt.device).triu(1)
        x = self.tf(self.embed_tokens(src), self.embed_tokens(tgt), tgt_mask=causal, tgt_is_causal=True,
                    src_key_padding_mask=pad_mask, memory_key_padding_mask=pad_mask)
        return F.linear(x, self.embed.weight)


# ------------------------------------------------------------------------------------------------
# Measurements

def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()  # kernels run asynchronously: wait before reading the clock


def measure_peak(dtype, device):
    # Best of a few large square GEMMs on random data: what the matmul units reach here (MFU's
    # denominator on a CPU, a second one beside the data sheet's on a GPU).
    n = 8192 if device.type == 'cuda' else 2048  # on 2 CPU cores 2048 already saturates, 4096 takes 1 s
    if device.type == 'cpu':
        # Emulated bf16 (AVX2) runs at 0.3 GFLOP/s: a 2048^2 GEMM would take a minute. Size it from a
        # small probe so that one GEMM takes about 0.3 s at most.
        a = torch.randn(256, 256, dtype=dtype)
        a @ a
        t = time.perf_counter()
        a @ a
        n = min(n, max(256, 256 * int((0.3 / (time.perf_counter() - t)) ** (1 / 3))))
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    a @ b  # untimed: library and clock warm-up
    best = math.inf
    for _ in range(9 if device.type == 'cuda' else 3):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def peak_memory(device):
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(), 'cuda max allocated'
    # Linux reports KiB. The process high-water mark only grows, so later rows include earlier ones.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'process max RSS'


def bench_train(cfg, impl, compiled, dtype, batches, warmup, device, profile=False):
    torch.manual_seed(0)
    model = (M.Transformer if impl == 'ours' else Builtin)(cfg).to(device).train()
    fwd = model
    if compiled:
        # Regional compilation: each encoder/decoder layer is compiled, and identical layers reuse one
        # compiled graph, so compile time does not grow with depth. dynamic=True: batch shapes vary.
        for layer in list(model.encoder) + list(model.decoder):
            layer.compile(dynamic=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=device.type == 'cuda')
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats()

    # As train.py with compile: the loss too, one pass over the (tokens x vocab) logits instead of several.
    loss_fn = torch.compile(M.label_smoothed_loss, dynamic=True) if compiled else M.label_smoothed_loss

    def step(b):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = fwd(b['src'], b['tgt_in'])
        loss, _, ntok = loss_fn(logits, b['tgt_out'], 0.1, cfg.pad_id)
        (loss / ntok).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for b in batches[:warmup]:  # first steps: compilation, allocator and thread-pool warm-up
        step(b)
    sync(device)
    t1 = time.perf_counter()
    with torch.profiler.profile() if profile else contextlib.nullcontext() as prof:
        for b in batches[warmup:]:
            step(b)
        sync(device)
    dt = time.perf_counter() - t1
    if profile:  # where the time of the timed steps went, by operator (kernels on a GPU)
        print(prof.key_averages().table(sort_by=f'self_{"device" if device.type == "cuda" else "cpu"}_time_total',
                                        row_limit=30, max_name_column_width=60), file=sys.stderr)  # --json stays one record
    timed = batches[warmup:]
    n_src, n_tgt = sum(b['n_src'] for b in timed), sum(b['n_tgt'] for b in timed)
    flops = sum(flops_per_step(cfg, b['src'].size(0), b['src'].size(1), b['tgt_in'].size(1)) for b in timed)
    mem, mem_kind = peak_memory(device)
    return dict(impl=impl, mode='compile' if compiled else 'eager', dtype=str(dtype).split('.')[-1],
                step_ms=1e3 * dt / len(timed), tokens_per_s=(n_src + n_tgt) / dt, tgt_tokens_per_s=n_tgt / dt,
                flops_per_s=flops / dt, warmup_s=t1 - t0, peak_mem_bytes=mem, mem_kind=mem_kind,
                params=sum(p.numel() for p in model.parameters()))


@torch.no_grad()
def greedy_recompute(model, src, max_len_a=1.0, max_len_b=0):
    """greedy_decode without the KV cache: every step re-runs the decoder over the whole prefix."""
    cfg = model.cfg
    memory, src_mask = model.encode(src)
    limit = M.max_lengths(model, src, max_len_a, max_len_b)
    tokens = src.new_full((src.size(0), 1), cfg.bos_id)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    for t in range(int(limit.max())):
        nxt = M.next_log_probs(model, tokens, memory, src_mask, None).argmax(-1)
        nxt = torch.where(t + 1 >= limit, cfg.eos_id, nxt)
        nxt = torch.where(done, cfg.pad_id, nxt)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        done |= nxt == cfg.eos_id
        if done.all():
            break
    return [[(row[:row.index(cfg.eos_id)] if cfg.eos_id in row else row, 0.0)] for row in tokens[:, 1:].tolist()]


def ct2_runs(model, src, beam, out_len, device):
    """The same weights exported to CTranslate2 (export_ct2.export), greedy and beam, float32 and int8
    (float16 and int8_float16 on a GPU); [] when ctranslate2 is not installed."""
    try:
        import ctranslate2
        import export_ct2
    except ImportError:
        return []
    tmp = tempfile.TemporaryDirectory()  # a Translator holds its model in memory once loaded
    cfg, runs = model.cfg, []
    rows = [[str(t) for t in row if t != cfg.pad_id][:-1] for row in src.tolist()]  # the export adds EOS
    for quantization in (('float16', 'int8_float16') if device.type == 'cuda' else ('float32', 'int8')):
        path = export_ct2.export(model, {}, os.path.join(tmp.name, quantization), quantization)
        tr = ctranslate2.Translator(path, device=device.type, compute_type=quantization,
                                    intra_threads=torch.get_num_threads() if device.type == 'cpu' else 0)
        for name, k in (('greedy', 1), (f'beam {beam}', beam)):
            def run(tr=tr, k=k):
                res = tr.translate_batch(rows, beam_size=k, length_penalty=0.6 if k > 1 else 0,
                                         max_decoding_length=out_len, max_input_length=0)
                return [[([0] * len(r.hypotheses[0]), 0.0)] for r in res]
            runs.append((name, f'CT2 {quantization}', run))
    tmp.cleanup()
    return runs


def bench_translate(args):
    """Sentences/s, BLEU and output agreement of translate.py on real text, as the README's decoding table:
    model.py (its exact stopping rule, and --early-stop, CTranslate2's) and the same weights exported to
    CTranslate2 float32 and int8 (float16 and int8_float16 on a GPU), beam and greedy (--beam 1: greedy only).
    Each row is a fresh process, as a user runs it, so each pays its own first pass (oneDNN creates kernels
    for each new shape; translate.py's clock starts once the model is loaded); rows alternate within each
    round, so a machine that slows down or speeds up does so for all of them."""
    load, here = os.getloadavg()[0], os.path.dirname(os.path.abspath(__file__))
    if os.path.isdir(args.translate):
        sys.exit(f"bench.py: --translate {args.translate} is a folder: give a checkpoint file (ckpt.pt, or one "
                 f"that translate.py --save-average wrote)")
    for flag, path in (('--input', args.input), ('--ref', args.ref)):  # before the exports, not after them
        if path and not os.path.isfile(path):
            sys.exit(f"bench.py: {flag} {path}: no such file")
    if os.path.getsize(args.input) == 0:
        sys.exit(f"bench.py: {args.input} is empty: nothing to translate")
    tmp = tempfile.TemporaryDirectory()
    own = [] if args.device.startswith('cuda') else ['--dtype', 'float32']  # else translate.py's bf16 on a GPU
    impls = [('model.py', args.translate, own, True)]
    impls += [('model.py --early-stop', args.translate, own + ['--early-stop'], False)] if args.beam > 1 else []
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        print('ctranslate2 is not installed: model.py rows only', file=sys.stderr)
    else:
        for q in ('float16', 'int8_float16') if args.device.startswith('cuda') else ('none', 'int8'):
            out = os.path.join(tmp.name, f'ct2_{q}')
            run_checked([sys.executable, os.path.join(here, 'export_ct2.py'), '--ckpt', args.translate, '--out', out,
                         '--quantization', q])
            impls.append((f'CTranslate2 {"float32" if q == "none" else q}', out, [], True))
    searches = [(f'beam {args.beam}', ['--beam', str(args.beam)])] if args.beam > 1 else []
    searches.append(('greedy', ['--greedy']))
    common = ['--input', args.input, '--device', args.device, '--max-tokens', str(args.max_tokens)]
    common += ['--lenpen', str(args.lenpen)] if args.lenpen is not None else []
    common += ['--ref', args.ref] if args.ref else []
    rows = [dict(impl=impl, search=search, cmd=[path, *flags, *how], sents_per_s=[])
            for search, how in searches for impl, path, flags, greedy_too in impls if greedy_too or search != 'greedy']
    for _ in range(args.rounds):
        for i, r in enumerate(rows):
            out = os.path.join(tmp.name, f'{i}.txt')
            err = run_checked([sys.executable, os.path.join(here, 'translate.py'), '--ckpt', *r['cmd'], *common,
                               '--output', out])
            r['sents_per_s'].append(float(re.search(r'([\d.]+) sentences/s', err)[1]))
            dtype = re.search(r'sentences/s, \d+ target tokens/s \([^,]+, ([^,]+),', err)[1]
            r['dtype'] = dtype.removeprefix('torch.').removeprefix('CTranslate2 ')
            r['bleu'] = float(re.search(r'sacreBLEU: BLEU = ([\d.]+)', err)[1]) if args.ref else None
            with open(out, encoding='utf-8') as f:
                r['lines'] = f.read().splitlines()
    for r in rows:
        ref = next(x for x in rows if x['search'] == r['search'])  # model.py's row of the same search
        r['median_sents_per_s'] = statistics.median(r['sents_per_s'])
        r['vs_model_py'] = r['median_sents_per_s'] / ref['median_sents_per_s']
        r['same_as_model_py'] = sum(a == b for a, b in zip(r['lines'], ref['lines']))
    record = dict(device=torch.cuda.get_device_name(args.device) if args.device.startswith('cuda') else cpu_name(),
                  torch=torch.__version__, threads=torch.get_num_threads(), load_avg_before=load,
                  ckpt=args.translate, input=args.input, sentences=len(rows[0]['lines']), rounds=args.rounds,
                  rows=[{k: v for k, v in r.items() if k not in ('cmd', 'lines')} for r in rows])
    tmp.cleanup()
    if args.json:
        print(json.dumps(record))
        return record
    print(f"{record['device']}, torch {record['torch']}, {record['threads']} threads; {args.translate} on "
          f"{record['sentences']} lines of {args.input}, {args.rounds} round(s), a translate.py process per row")
    if not args.device.startswith('cuda') and load > 0.5:
        print('WARNING: other processes were using the CPU; close them and rerun for trustworthy figures')
    hdr = f"{'search':<10}{'implementation':<23}{'dtype':<14}{'sent/s (each round)':<24}{'median':>8}{'vs model.py':>13}"
    hdr += f"{'BLEU':>7}{'same as model.py':>18}"
    print(hdr + '\n' + '-' * len(hdr))
    for r in rows:
        each = ' '.join(f'{x:.1f}' for x in r['sents_per_s'])
        bleu = f"{r['bleu']:.2f}" if r['bleu'] is not None else '-'
        print(f"{r['search']:<10}{r['impl']:<23}{r['dtype']:<14}{each:<24}{r['median_sents_per_s']:>8.1f}"
              f"{r['vs_model_py']:>12.2f}x{bleu:>7}{r['same_as_model_py']:>12}/{record['sentences']}")
    return record


def run_checked(cmd):
    """-> the command's stderr; a failed command ends bench.py with its own last line of error."""
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode < 0:  # its last words would be about something else
        sys.exit(f"bench.py: {' '.join(cmd[1:])} was killed by {signal.Signals(-res.returncode).name}")
    if res.returncode:
        sys.exit(f"bench.py: {' '.join(cmd[1:])} failed: {(res.stderr.strip() or 'no message').splitlines()[-1]}")
    return res.stderr


def bench_decode(cfg, src, dtype, beam, device, out_len):
    # An untrained model almost never emits EOS, so every output runs to its cap of out_len tokens and
    # EOS: each implementation does the same work, the per-step cost of decoding.
    torch.manual_seed(0)
    model = M.Transformer(cfg).to(device).eval()
    runs = [('greedy', 'model.py', lambda: M.greedy_decode(model, src, 0.0, out_len + 1)),
            ('greedy', 'recompute', lambda: greedy_recompute(model, src, 0.0, out_len + 1)),
            (f'beam {beam}', 'model.py', lambda: M.beam_search(model, src, beam, 0.6, 0.0, out_len + 1))]
    rows = []
    # Packed weights as translate_lines decodes with (they change nothing for the CT2 rows).
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16), T.packed_weights(model):
        for name, how, fn in runs + ct2_runs(model, src, beam, out_len, device):
            fn()  # warm-up: allocator, thread pools
            sync(device)
            t = time.perf_counter()
            out = fn()
            sync(device)
            dt = time.perf_counter() - t
            n_tok = sum(len(hyps[0][0]) for hyps in out)  # generated tokens, EOS not counted
            rows.append(dict(search=name, impl=how, sents_per_s=len(out) / dt, tgt_tokens_per_s=n_tok / dt))
    return rows


def cpu_name():
    for line in open('/proc/cpuinfo') if os.path.exists('/proc/cpuinfo') else []:
        if line.startswith('model name'):
            return line.split(':', 1)[1].strip()
    return 'cpu'


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--config', default='small', choices=[*CONFIGS, *M.PRESETS],
                   help='tiny, small: defined here; base, big: model.preset')
    p.add_argument('--batch-tokens', type=int, default=2048, help='max padded tokens per side per batch')
    p.add_argument('--data', help='data/NAME from data_prep.py: real training batches instead of synthetic')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--dtype', choices=DTYPES, help='of the compiled row and decoding (default: translate.fast_dtype); '
                                                   'eager rows run float32 and, where native or asked for, bfloat16')
    p.add_argument('--peak', choices=['measured', *PEAKS], help='MFU denominator (default: the table if this GPU '
                                                                'is in it, else a GEMM timed here; "of GEMM" always '
                                                                'divides by the GEMM)')
    p.add_argument('--profile', action='store_true', help='then profile the timed steps of the last training row '
                                                         'of ours and print the operators that took the time')
    p.add_argument('--compile', choices=['auto', 'on', 'off'], default='auto', help='auto: on CUDA or tiny/small')
    p.add_argument('--warmup', type=int, help='untimed steps per row: compilation, and on a GPU each new batch '
                                             "shape's one-time cost (README, GPU); default 30 on a GPU, 2 on a CPU")
    p.add_argument('--steps', type=int, default=5, help='timed training steps per row')
    p.add_argument('--decode-sents', type=int, default=64, help='decoded at once, each of 24 source tokens')
    p.add_argument('--decode-len', type=int, default=20, help='output tokens per sentence (then EOS)')
    p.add_argument('--beam', type=int, default=4)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--json', action='store_true', help='print one JSON record instead of tables')
    g = p.add_argument_group('decoding real text (--translate)')
    g.add_argument('--translate', metavar='CKPT', help='a checkpoint: decode --input with it and its CTranslate2 '
                                                       'exports instead of the training and synthetic rows')
    g.add_argument('--input', help='source text, one sentence per line')
    g.add_argument('--ref', help='references: BLEU per row')
    g.add_argument('--rounds', type=int, default=3, help='each row this many times, the rows alternating')
    g.add_argument('--lenpen', type=float, help="translate.py's (default: the checkpoint's own)")
    g.add_argument('--max-tokens', type=int, default=4096, help="translate.py's padded source tokens per batch")
    args = p.parse_args(argv)
    given = lambda *names: [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) != p.get_default(n)]
    if args.translate:
        if not args.input:
            p.error('--translate needs --input')
        others = given('config', 'batch_tokens', 'data', 'dtype', 'peak', 'profile', 'compile', 'warmup', 'steps',
                       'decode_sents', 'decode_len')
        if others:
            p.error(f"{', '.join(others)}: for the training and synthetic decoding rows, which --translate does not run")
    elif given('input', 'ref', 'rounds', 'lenpen', 'max_tokens'):
        p.error(f"{', '.join(given('input', 'ref', 'rounds', 'lenpen', 'max_tokens'))}: only with --translate")
    if args.rounds < 1 or args.beam < 1:
        p.error('--rounds and --beam must be at least 1')
    if min(args.steps, args.batch_tokens, args.decode_sents) < 1 or (args.warmup or 0) < 0:
        p.error('--steps, --batch-tokens and --decode-sents must be at least 1, --warmup at least 0')
    if args.seed < 0:
        p.error(f'--seed {args.seed}: must be at least 0')
    if not 1 <= args.decode_len <= M.Config.max_len - 2:  # BOS, the tokens and EOS within the positions
        p.error(f'--decode-len {args.decode_len}: must be between 1 and {M.Config.max_len - 2}')
    if not re.fullmatch(r'(cpu|cuda)(:\d+)?', args.device):
        p.error(f'--device {args.device}: expected cpu, cuda or cuda:N')
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        p.error(f'--device {args.device}: no GPU available')
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.translate:
        return bench_translate(args)
    t_start, load = time.perf_counter(), os.getloadavg()[0]  # other processes on the cores skew timings
    device = torch.device(args.device)
    if args.warmup is None:
        args.warmup = 30 if device.type == 'cuda' else 2
    if device.type == 'cpu':  # as train.py and translate.py do
        T.keep_freed_memory()
    native = T.fast_dtype(device.type)
    dtype_name = args.dtype or native
    dtype = DTYPES[dtype_name]
    # Emulated bf16 (AVX2-only CPUs) is hundreds of times slower than float32: its rows would take
    # minutes to measure nothing useful, so they run only where bf16 is native or asked for.
    dtypes = [d for d in DTYPES if d in ('float32', native, dtype_name)]
    if device.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    rng = np.random.default_rng(args.seed)

    cfg = M.preset(args.config) if args.config in M.PRESETS else M.Config(**CONFIGS[args.config])
    n_batches = args.warmup + args.steps
    n_pool = (n_batches + 10) * args.batch_tokens // 25  # sentences of ~25 tokens: a few batches more than needed
    if args.data:
        pairs, meta = real_pairs(args.data, n_pool, rng, cfg.max_len - 2)
        cfg = M.Config(**{**asdict(cfg), **{k: meta[k] for k in ('vocab_size', 'pad_id', 'bos_id', 'eos_id')}})
    else:
        pairs = synthetic_pairs(n_pool, cfg.vocab_size, rng)
    dec_src = torch.from_numpy(np.append(rng.integers(3, cfg.vocab_size, (args.decode_sents, 24)),
                                         np.full((args.decode_sents, 1), cfg.eos_id), 1)).to(device)
    batches = make_batches(pairs, args.batch_tokens, cfg, rng, n_batches, device)
    if len(batches) < n_batches:
        # The sentences drawn grow with --batch-tokens: a budget smaller than a few sentences makes too few.
        raise SystemExit(f'bench.py: only {len(batches)} batches of {args.batch_tokens} tokens; raise --batch-tokens')

    gpu = torch.cuda.get_device_name().lower() if device.type == 'cuda' else ''
    peak_name = args.peak or next((k for k in PEAKS if k in gpu), 'measured')
    gemm = {k: measure_peak(DTYPES[k], device) for k in dtypes}
    peaks = {k: gemm[k] if peak_name == 'measured' else PEAKS[peak_name][k] for k in dtypes}

    use_compile = args.compile == 'on' or (args.compile == 'auto' and (device.type == 'cuda' or args.config in CONFIGS))
    variants = [('ours', False, DTYPES[d]) for d in dtypes]
    variants += [('ours', True, dtype)] if use_compile else []
    variants += [('torch.nn.Transformer', False, DTYPES[d]) for d in dtypes]
    train = [bench_train(cfg, impl, c, dt, batches, args.warmup, device) for impl, c, dt in variants]
    rows = {(r['impl'], r['mode'], r['dtype']): r for r in train}
    if args.profile:
        impl, compiled, dt = [v for v in variants if v[0] == 'ours'][-1]  # compiled where there is such a row
        bench_train(cfg, impl, compiled, dt, batches, args.warmup, device, profile=True)
    for r in train:
        r['mfu'] = r['flops_per_s'] / peaks[r['dtype']]
        r['of_gemm'] = r['flops_per_s'] / gemm[r['dtype']]
        r['vs_ours_eager_fp32'] = r['tokens_per_s'] / train[0]['tokens_per_s']
    speed = lambda impl, mode, dt: rows[impl, mode, dt]['tokens_per_s']
    ratios = {f'ours/built-in {dt}': speed('ours', 'eager', dt) / speed('torch.nn.Transformer', 'eager', dt)
              for dt in dtypes}
    if 'bfloat16' in dtypes:
        ratios['bfloat16/float32 (ours eager)'] = speed('ours', 'eager', 'bfloat16') / speed('ours', 'eager', 'float32')
    if use_compile:
        ratios[f'compile/eager (ours {dtype_name})'] = (speed('ours', 'compile', dtype_name)
                                                       / speed('ours', 'eager', dtype_name))

    decode = bench_decode(cfg, dec_src, dtype, args.beam, device, args.decode_len)
    timed = batches[args.warmup:]
    record = dict(
        device=torch.cuda.get_device_name() if gpu else cpu_name(), device_type=device.type, torch=torch.__version__,
        threads=torch.get_num_threads(), load_avg_before=load, config=args.config, model_cfg=asdict(cfg),
        params=train[0]['params'], data=args.data or 'synthetic', batch_tokens=args.batch_tokens,
        warmup_steps=args.warmup, timed_steps=args.steps,
        sentences_per_batch=sum(b['src'].size(0) for b in timed) / len(timed),
        real_token_fraction=(sum(b['n_src'] + b['n_tgt'] for b in timed)
                             / sum(b['src'].numel() + b['tgt_in'].numel() for b in timed)),
        peak_source=peak_name, peak_flops=peaks, gemm_flops=gemm, train=train, ratios=ratios, decode=decode,
        kv_cache_speedup=decode[0]['sents_per_s'] / decode[1]['sents_per_s'], decode_sentences=len(dec_src),
        decode_len=args.decode_len,
        decode_dtype=dtype_name, elapsed_s=time.perf_counter() - t_start)
    if args.json:
        print(json.dumps(record))
    else:
        report(record)
    return record


def report(r):
    c = r['model_cfg']
    print(f"{r['device']} ({r['device_type']}, {r['threads']} threads), torch {r['torch']}, "
          f"load average before the run {r['load_avg_before']:.2f}")
    if r['device_type'] == 'cpu' and r['load_avg_before'] > 0.5:
        print('WARNING: other processes were using the CPU; close them and rerun for trustworthy figures')
    print(f"config {r['config']}: {c['n_enc_layers']}+{c['n_dec_layers']} layers, d_model {c['d_model']}, "
          f"d_ff {c['d_ff']}, heads {c['n_heads']}, vocab {c['vocab_size']}, {r['params'] / 1e6:.1f}M params")
    print(f"batches: {r['data']}, <= {r['batch_tokens']} padded tokens per side, {r['sentences_per_batch']:.0f} "
          f"sentences on average, {100 * r['real_token_fraction']:.0f}% real tokens; {r['warmup_steps']} warm-up + "
          f"{r['timed_steps']} timed steps per row")
    print(f"peak ({r['peak_source']}): " + ', '.join(f'{k} {v / 1e12:.3g} TFLOP/s' for k, v in r['peak_flops'].items())
          + '; GEMM timed here: ' + ', '.join(f'{k} {v / 1e12:.3g} TFLOP/s' for k, v in r['gemm_flops'].items()))
    print('\nTraining step (forward + backward + Adam). tok/s = real (non-pad) source + target tokens; '
          'FLOP/s over padded shapes (flops_per_step)')
    hdr = (f"{'implementation':<22}{'mode':<9}{'dtype':<10}{'step ms':>9}{'tok/s':>9}{'tgt tok/s':>10}"
           f"{'TFLOP/s':>9}{'MFU':>7}{'of GEMM':>8}{'x ref':>7}{'warmup s':>10}{'peak MiB':>10}")
    print(hdr + '\n' + '-' * len(hdr))
    for t in r['train']:
        print(f"{t['impl']:<22}{t['mode']:<9}{t['dtype']:<10}{t['step_ms']:>9.0f}{t['tokens_per_s']:>9.0f}"
              f"{t['tgt_tokens_per_s']:>10.0f}{t['flops_per_s'] / 1e12:>9.3f}{100 * t['mfu']:>6.1f}%{100 * t['of_gemm']:>7.1f}%"
              f"{t['vs_ours_eager_fp32']:>7.2f}{t['warmup_s']:>10.1f}{t['peak_mem_bytes'] / 2**20:>10.0f}")
    print(f"x ref = tokens/s relative to the first row; warmup s includes compilation; "
          f"peak MiB = {r['train'][0]['mem_kind']}")
    print('ratios: ' + ', '.join(f'{k} {v:.2f}x' for k, v in r['ratios'].items()))
    print(f"\nDecoding {r['decode_sentences']} sentences of 24 tokens in one batch, {r['decode_len']} output tokens "
          f"each, the same random weights ({r['decode_dtype']} for model.py; CT2 = CTranslate2 export_ct2.py)")
    hdr = f"{'search':<10}{'implementation':<20}{'sent/s':>9}{'tgt tok/s':>11}{'vs model.py':>13}"
    print(hdr + '\n' + '-' * len(hdr))
    ours = {d['search']: d['sents_per_s'] for d in r['decode'] if d['impl'] == 'model.py'}
    for d in r['decode']:
        print(f"{d['search']:<10}{d['impl']:<20}{d['sents_per_s']:>9.1f}{d['tgt_tokens_per_s']:>11.0f}"
              f"{d['sents_per_s'] / ours[d['search']]:>12.2f}x")
    print(f"KV cache speed-up (greedy): {r['kv_cache_speedup']:.2f}x\ntotal {r['elapsed_s']:.0f} s")


if __name__ == '__main__':
    try:
        main()
    except KeyboardInterrupt:
        sys.exit('bench.py: interrupted')
