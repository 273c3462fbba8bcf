"""
How fast is model.py, measured on your own machine in one command:

    python bench.py                                     # small model, under 2 minutes on a 2-core CPU
    python bench.py --config base --batch-tokens 8192   # the paper's base model
    python bench.py --config config/multi30k.py         # train.py's step of a recipe, on its data
    python bench.py --data data/NAME --peak h100 --json # real batches, MFU against a table peak, JSON
    python bench.py --translate out/RUN/ckpt.pt --input SRC --ref REF   # decoding real text, vs CTranslate2

Training steps on train.py's batches (synthetic or --data): model.py eager and compiled, and
torch.nn.Transformer with the same dimensions, masks, loss and optimizer; FLOP/s from flops_per_step, MFU
against a peak. Decoding: greedy and beam search, vs CTranslate2.
"""
import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import configurator
import dataset
import model as M
import speed
import translate as T

# Configs beyond model.preset: 'small' is Multi30k-sized (what one trains on a laptop), 'tiny' is for tests.
CONFIGS = {
    'tiny': dict(vocab_size=512, n_enc_layers=2, n_dec_layers=2, d_model=64, d_ff=128, n_heads=4),
    'small': dict(vocab_size=8000, n_enc_layers=3, n_dec_layers=3, d_model=256, d_ff=1024, n_heads=4),
}
# Dense tensor-core peaks in FLOP/s, the vendors' data sheets; float32 runs as TF32 (bench.py turns it on).
PEAKS = {'a100': {'bfloat16': 312e12, 'float32': 156e12},
         'h100': {'bfloat16': 989e12, 'float32': 495e12},   # SXM
         'h200': {'bfloat16': 989e12, 'float32': 495e12}}
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16}
HERE = os.path.dirname(os.path.abspath(__file__))


def flops_per_step(cfg, B, S, T, tokens=None):
    """Matmul FLOPs of one training step (forward + backward = 3 x forward) over a padded batch: B sentences,
    source padded to S tokens (EOS included), decoder input to T: the work the hardware did, but for the
    output projection over the `tokens` real targets alone (train.py's). (m x k) @ (k x n): 2*m*k*n FLOPs.
    Attention counts the full S*S, T*T, T*S scores; O(d) per-token work (norms, softmax, biases) is out."""
    d, f, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    enc_layer = (2 * B * S * (3 * d * d + d * d + 2 * d * f)  # QKV, output projection, FFN, per token
                 + 2 * B * S * S * d * 2)                     # Q K^T and attn @ V, over all heads
    dec_layer = (2 * B * T * (3 * d * d + d * d + 2 * d * f)  # self-attention projections and FFN
                 + 2 * B * T * T * d * 2                      # self-attention scores and values
                 + 2 * B * T * (d * d + d * d)                # cross-attention Q and output projection
                 + 2 * B * S * (2 * d * d)                    # cross-attention K, V from the encoder
                 + 2 * B * T * S * d * 2)                     # cross-attention scores and values
    logits = 2 * (B * T if tokens is None else tokens) * d * V  # output projection onto the vocabulary
    return 3 * (cfg.n_enc_layers * enc_layer + cfg.n_dec_layers * dec_layer + logits)


def synthetic_split(n, vocab, seed=0, median=25, cap=250):
    """n random pairs in dataset.load_split's format. Subword sentence lengths are roughly lognormal (WMT14
    en-de: median ~25, a long right tail), the target's the source's +-15%; ids avoid the three specials."""
    rng = np.random.default_rng(seed)
    src_len = np.clip(rng.lognormal(math.log(median), 0.5, n).round(), 1, cap).astype(np.int64)
    tgt_len = np.clip((src_len * rng.normal(1.0, 0.15, n)).round(), 1, cap).astype(np.int64)
    side = lambda lens: (rng.integers(3, vocab, lens.sum()), np.concatenate([[0], np.cumsum(lens)]))
    return (*side(src_len), *side(tgt_len))


def make_batches(data, cfg, batch_tokens, n, device):
    """The first n batches of train.py's epochs over data (seed 0; a short corpus goes on to its next epoch),
    as get_batch makes them: -> [(src, tgt_in, the real target tokens' rows, their targets)] on device."""
    plans = (ids for epoch in range(n) for ids in dataset.batch_plan(data, batch_tokens, 0, epoch))
    collate = lambda ids: dataset.collate(data, ids, cfg.pad_id, cfg.bos_id, cfg.eos_id)
    return [tuple(torch.from_numpy(a).to(device) for a in collate(ids)) for _, ids in zip(range(n), plans)]


class Builtin(nn.Module):
    """torch.nn.Transformer, the module one would otherwise pick, completed as ours: shared embedding and
    output projection, sinusoidal positions, the same masks; the same parameters and FLOPs (tested)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.register_buffer('pe', M.sinusoidal_positions(cfg.max_len, cfg.d_model), persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.tf = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_enc_layers, cfg.n_dec_layers, cfg.d_ff,
                                 cfg.dropout, batch_first=True, norm_first=cfg.pre_norm)
        for mha in [m for m in self.tf.modules() if isinstance(m, nn.MultiheadAttention)]:
            mha.dropout = cfg.attn_dropout  # it would reuse `dropout` on attention weights; ours does not
        if not cfg.pre_norm:  # the post-norm paper model (and ours) has no final LayerNorm per stack
            self.tf.encoder.norm = self.tf.decoder.norm = None

    def forward(self, src, tgt, rows=None):
        embed = lambda x: self.dropout(self.embed(x) * math.sqrt(self.cfg.d_model) + self.pe[:x.size(1)])
        pad_mask = src == self.cfg.pad_id  # True = ignore (the opposite of model.py's convention)
        causal = torch.ones(tgt.size(1), tgt.size(1), dtype=torch.bool, device=tgt.device).triu(1)
        x = self.tf(embed(src), embed(tgt), tgt_mask=causal, tgt_is_causal=True,
                    src_key_padding_mask=pad_mask, memory_key_padding_mask=pad_mask)
        return F.linear(x, self.embed.weight) if rows is None else x.flatten(0, 1)[rows]


def timed(fn, device):
    """-> (fn(), seconds). GPU kernels run asynchronously: wait for them before reading the clock."""
    sync = torch.cuda.synchronize if device.type == 'cuda' else lambda: None
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def measure_peak(dtype, device):
    # Best of a few large square GEMMs: MFU's denominator on a CPU, a second one beside a GPU's data sheet.
    n = 8192 if device.type == 'cuda' else 2048
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    times = [timed(lambda: a @ b, device)[1] for _ in range(10 if device.type == 'cuda' else 4)]
    return 2 * n ** 3 / min(times[1:])  # the first: library and clock warm-up


def bench_train(cfg, impl, compiled, dtype, batches, warmup, device, profile=False):
    """Trains on batches; times the steps after the first `warmup` (compilation, allocator warm-up)."""
    torch.manual_seed(0)
    model = (M.Transformer if impl == 'ours' else Builtin)(cfg).to(device).train()
    if impl == 'ours' and device.type == 'cpu':  # train.py's step exactly: its dropout mask, fused Adam
        speed.cpu_dropout(model)
    for layer in [*model.encoder, *model.decoder] if compiled else []:  # as train.py: per layer (identical
        layer.compile(dynamic=True)  # layers share a graph: compile time does not grow with depth), and
    chunk_fn = torch.compile(M.loss_chunk, dynamic=True) if compiled else M.loss_chunk  # the loss's chunks
    opt = torch.optim.Adam(model.parameters(), 1e-4, (0.9, 0.98), 1e-9, fused=True)

    def steps(batches):
        for src, tgt_in, rows, targets in batches:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                x = model(src, tgt_in, rows)
                loss, _ = M.label_smoothed_loss(x, model.embed.weight, targets, 0.1, chunk_fn)
            (loss / len(rows)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)  # train.py logs the norm
            opt.step()
            opt.zero_grad(set_to_none=True)

    _, warmup_s = timed(lambda: steps(batches[:warmup]), device)
    with torch.profiler.profile() if profile else contextlib.nullcontext() as prof:
        _, seconds = timed(lambda: steps(batches[warmup:]), device)
    if profile:  # by operator (kernel on a GPU); on stderr, so that --json's stdout stays one record
        key = f'self_{"device" if device.type == "cuda" else "cpu"}_time_total'
        print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60), file=sys.stderr)
    return dict(impl=impl, mode='compile' if compiled else 'eager', dtype=str(dtype).split('.')[-1],
                seconds=seconds, warmup_s=warmup_s, params=sum(p.numel() for p in model.parameters()))


def ct2_runs(model, src, beam, out_len, device):
    """The same weights exported to CTranslate2 (export_ct2.export), greedy and beam, float32 and int8
    (float16 and int8_float16 on a GPU); [] without ctranslate2."""
    if not importlib.util.find_spec('ctranslate2'):
        return []
    import ctranslate2

    import export_ct2
    tmp, runs = tempfile.TemporaryDirectory(), []
    rows = [[str(t) for t in row[:-1]] for row in src.tolist()]  # the export adds EOS
    for quantization in ('float16', 'int8_float16') if device.type == 'cuda' else ('float32', 'int8'):
        path = export_ct2.export(model, {}, os.path.join(tmp.name, quantization), quantization)
        tr = ctranslate2.Translator(path, device=device.type, compute_type=quantization,
                                    intra_threads=torch.get_num_threads() if device.type == 'cpu' else 0)
        for name, k in (('greedy', 1), (f'beam {beam}', beam)):  # in model.py's format, for the counts
            runs.append((name, f'CT2 {quantization}', lambda tr=tr, k=k: [[(r.hypotheses[0], 0.0)] for r in (
                tr.translate_batch(rows, beam_size=k, length_penalty=0.6, max_decoding_length=out_len))]))
    return runs  # tmp goes with the return: each Translator holds its model in memory


def bench_decode(cfg, src, dtype, beam, device, out_len):
    # Random weights almost never emit EOS: every output runs to out_len tokens + EOS, the same work for all.
    torch.manual_seed(0)
    model = M.Transformer(cfg).to(device).eval()
    runs = [('greedy', 'model.py', lambda: M.greedy_decode(model, src, 0.0, out_len + 1)),
            (f'beam {beam}', 'model.py', lambda: M.beam_search(model, src, beam, 0.6, 0.0, out_len + 1))]
    rows = []  # with packed weights, as translate.py decodes (they change nothing for the CT2 rows)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32), T.packed_weights(model):
        for name, how, fn in runs + ct2_runs(model, src, beam, out_len, device):
            fn()  # warm-up: allocator, thread pools
            out, dt = timed(fn, device)
            n_tok = sum(len(hyps[0][0]) for hyps in out)  # generated tokens, EOS not counted
            rows.append(dict(search=name, impl=how, sents_per_s=len(out) / dt, tgt_tokens_per_s=n_tok / dt))
    return rows


def run_script(name, *args):
    """Runs a script of this folder -> its stderr; its failure ends bench.py with its last line of error."""
    res = subprocess.run([sys.executable, os.path.join(HERE, name), *args], capture_output=True, text=True)
    if res.returncode:
        last = (res.stderr.strip() or f'exit status {res.returncode}').splitlines()[-1]
        sys.exit(f"bench.py: {name} {' '.join(args)} failed: {last}")
    return res.stderr


def bench_translate(args):
    """Sentences/s, BLEU and agreement of translate.py on real text: model.py (its stop rule and --exact) and
    its CTranslate2 exports, beam and greedy; a process per row, the rows alternating in each round."""
    load, tmp = os.getloadavg()[0], tempfile.TemporaryDirectory()
    impls = [('model.py', args.translate, []), ('model.py --exact', args.translate, ['--exact'])]
    if importlib.util.find_spec('ctranslate2'):
        for q in ('float16', 'int8_float16') if args.device.startswith('cuda') else ('none', 'int8'):
            out = os.path.join(tmp.name, f'ct2_{q}')
            run_script('export_ct2.py', '--ckpt', args.translate, '--out', out, '--quantization', q)
            impls.append((f'CTranslate2 {"float32" if q == "none" else q}', out, []))
    searches = [(f'beam {args.beam}', ['--beam', str(args.beam)])] if args.beam > 1 else []
    common = ['--input', args.input, '--device', args.device, *args.translate_args]  # --ref among them
    rows = [dict(search=search, impl=impl, cmd=[path, *how, *flags], sents_per_s=[])  # --exact: beam only
            for search, how in searches + [('greedy', ['--greedy'])] for impl, path, flags in impls
            if search != 'greedy' or not flags]
    for _ in range(args.rounds):
        for i, r in enumerate(rows):
            out = os.path.join(tmp.name, f'{i}.txt')
            err = run_script('translate.py', '--ckpt', *r['cmd'], *common, '--output', out)
            r['sents_per_s'].append(float(re.search(r'([\d.]+) sentences/s', err)[1]))
            r['dtype'] = re.search(r'target tokens/s \([^,]+, (?:torch\.|CTranslate2 )?([^,]+),', err)[1]
            r['bleu'] = float(m[1]) if (m := re.search(r'sacreBLEU: BLEU = ([\d.]+)', err)) else None
            with open(out, encoding='utf-8') as f:
                r['lines'] = f.read().splitlines()
    for r in rows:
        ref = next(x for x in rows if x['search'] == r['search'])  # model.py's row of the same search
        r['median_sents_per_s'] = float(np.median(r['sents_per_s']))
        r['vs_model_py'] = r['median_sents_per_s'] / ref['median_sents_per_s']
        r['same_as_model_py'] = sum(a == b for a, b in zip(r['lines'], ref['lines']))
    record = dict(vars(args), device_name=device_name(torch.device(args.device)), torch=torch.__version__,
                  threads=torch.get_num_threads(), load_avg_before=load, sentences=len(rows[0]['lines']),
                  rows=[{k: v for k, v in r.items() if k not in ('cmd', 'lines')} for r in rows])
    if args.json:
        return print(json.dumps(record)) or record
    print(f"{record['device_name']}, torch {torch.__version__}, {record['threads']} threads; "
          f"{args.translate} on {record['sentences']} lines of {args.input}, {args.rounds} round(s)")
    warn_if_loaded(load, args.device)
    hdr = (f"{'search':<10}{'implementation':<23}{'dtype':<14}{'sent/s (each round)':<24}{'median':>8}"
           f"{'vs model.py':>13}{'BLEU':>7}{'same as model.py':>18}")
    print(hdr + '\n' + '-' * len(hdr))
    for r in rows:
        each = ' '.join(f'{x:.1f}' for x in r['sents_per_s'])
        bleu = '-' if r['bleu'] is None else f"{r['bleu']:.2f}"
        print(f"{r['search']:<10}{r['impl']:<23}{r['dtype']:<14}{each:<24}{r['median_sents_per_s']:>8.1f}"
              f"{r['vs_model_py']:>12.2f}x{bleu:>7}{r['same_as_model_py']:>12}/{record['sentences']}")
    return record


def device_name(device):
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError, StopIteration):  # no /proc/cpuinfo, or no model name in it
        return next(s.split(':')[1].strip() for s in open('/proc/cpuinfo') if s.startswith('model name'))
    return 'cpu'


def warn_if_loaded(load, device):
    if not device.startswith('cuda') and load > 0.5:  # other processes on the cores skew CPU timings
        print('WARNING: other processes were using the CPU; close them and rerun for trustworthy figures')


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--config', default='small', help='tiny, small: defined here; base, big: model.preset; or '
                   "a train.py config file: its model, max_tokens and data_dir (train.py's step exactly)")
    p.add_argument('--batch-tokens', type=int, help='max padded tokens per side per batch (default 2048)')
    p.add_argument('--data', help='data/NAME from data_prep.py: its batches instead of synthetic ones')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--dtype', nargs='+', choices=DTYPES, help='training rows in each, decoding in the first')
    p.add_argument('--peak', choices=['measured', *PEAKS], help='MFU denominator (default: a data sheet)')
    p.add_argument('--profile', action='store_true', help="where each row's timed steps went, by operator")
    p.add_argument('--compile', choices=['auto', 'on', 'off'], default='auto',
                   help='auto: on a GPU, or tiny and small (compiling base or big takes minutes on a CPU)')
    p.add_argument('--warmup', type=int, help='untimed steps per row (default 30 on a GPU, 1 on a CPU)')
    p.add_argument('--steps', type=int, default=3, help='timed training steps per row')
    p.add_argument('--decode-sents', type=int, default=32, help='decoded at once, each of 24 source tokens')
    p.add_argument('--decode-len', type=int, default=20, help='output tokens per sentence (then EOS)')
    p.add_argument('--beam', type=int, default=4)
    p.add_argument('--json', action='store_true', help='print one JSON record instead of tables')
    g = p.add_argument_group('--translate', 'other options (--ref REF for BLEU, ...) go to translate.py')
    g.add_argument('--translate', metavar='CKPT', help='decode --input by CKPT and its CTranslate2 exports')
    g.add_argument('--input', help='source text, one sentence per line')
    g.add_argument('--rounds', type=int, default=3, help='each row this many times, the rows alternating')
    args, args.translate_args = p.parse_known_args(argv)
    if args.config.endswith('.py'):  # a train.py config: its model, max_tokens and data_dir, as train.py's
        s = configurator.run_file(args.config, dict(vars(M.Config()), max_tokens=0, data_dir=''))
        CONFIGS[args.config] = {f.name: s[f.name] for f in dataclasses.fields(M.Config)}
        args.batch_tokens, args.data = args.batch_tokens or s['max_tokens'], args.data or s['data_dir']
    elif args.config not in [*CONFIGS, *M.PRESETS]:
        p.error(f'--config: {args.config!r} is neither tiny, small, base, big nor a config file')
    args.batch_tokens = args.batch_tokens or 2048
    if args.translate_args and not args.translate:
        p.error(f"unrecognized arguments: {' '.join(args.translate_args)}")
    if args.translate and not args.input:  # translate.py would wait on standard input
        p.error('--translate needs --input')
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.translate:
        return bench_translate(args)
    t_start, load, device = time.perf_counter(), os.getloadavg()[0], torch.device(args.device)
    cuda = device.type == 'cuda'
    args.warmup = args.warmup if args.warmup is not None else 30 if cuda else 1
    args.dtype = args.dtype or [speed.fast_dtype(device.type)]
    if cuda:  # TF32 matmuls; no cuDNN attention, which plans anew for each batch shape (docs/performance.md)
        torch.set_float32_matmul_precision('high')
        torch.backends.cuda.enable_cudnn_sdp(False)
    else:  # as train.py does (translate.py keeps the flash kernel)
        speed.keep_freed_memory()
        torch.backends.cuda.enable_flash_sdp('bfloat16' not in args.dtype)
    cfg = M.Config(**{**CONFIGS, **M.PRESETS}[args.config])
    if args.data:  # the vocabulary rounded up to a multiple of 8, as train.py does
        meta = dataset.load_meta(args.data)
        cfg = dataclasses.replace(cfg, vocab_size=(meta['vocab_size'] + 7) // 8 * 8,
                                  **{k: meta[k] for k in ('pad_id', 'bos_id', 'eos_id')})
        data = dataset.load_split(args.data, 'train')
    else:  # about twice the sentences of ~25 tokens that the batches need
        data = synthetic_split((args.warmup + args.steps) * args.batch_tokens // 12 + 64, cfg.vocab_size)
    batches = make_batches(data, cfg, args.batch_tokens, args.warmup + args.steps, device)
    # torch.compile ties equal sizes (duck sizing): a first batch with S == T recompiles in the timed steps.
    batches.sort(key=lambda b: b[0].size(1) == b[1].size(1))
    timed_batches = batches[args.warmup:]
    n_src = sum(int((b[0] != cfg.pad_id).sum()) for b in timed_batches)  # + EOS, as the targets
    n_tgt = sum(len(b[2]) for b in timed_batches)
    flops = sum(flops_per_step(cfg, src.size(0), src.size(1), tgt.size(1), len(rows))
                for src, tgt, rows, _ in timed_batches)

    peak_name = args.peak or next((k for k in PEAKS if k in device_name(device).lower()), 'measured')
    gemm = {d: measure_peak(DTYPES[d], device) for d in args.dtype}
    peaks = gemm if peak_name == 'measured' else {d: PEAKS[peak_name][d] for d in args.dtype}
    compiled = {'on': True, 'off': False, 'auto': cuda or args.config in ('tiny', 'small')}[args.compile]
    variants = [(impl, c, d) for d in args.dtype for impl, c in
                [('ours', False), ('ours', True), ('torch.nn.Transformer', False)] if compiled or not c]
    train = [bench_train(cfg, impl, c, DTYPES[d], batches, args.warmup, device, args.profile)
             for impl, c, d in variants]
    for r in train:
        dt = r.pop('seconds')
        r.update(step_ms=1e3 * dt / len(timed_batches), tokens_per_s=(n_src + n_tgt) / dt,
                 tgt_tokens_per_s=n_tgt / dt, flops_per_s=flops / dt, mfu=flops / dt / peaks[r['dtype']],
                 of_gemm=flops / dt / gemm[r['dtype']])
    tps = {(r['impl'], r['mode'], r['dtype']): r['tokens_per_s'] for r in train}
    pairs = [(f'ours/built-in {d}', ('ours', 'eager', d), ('torch.nn.Transformer', 'eager', d))
             for d in DTYPES]
    pairs += [(f'compile/eager {d}', ('ours', 'compile', d), ('ours', 'eager', d)) for d in DTYPES]
    pairs += [('bfloat16/float32 eager', ('ours', 'eager', 'bfloat16'), ('ours', 'eager', 'float32'))]
    ratios = {name: tps[a] / tps[b] for name, a, b in pairs if a in tps and b in tps}  # of the rows measured

    dec_src = F.pad(torch.randint(3, cfg.vocab_size, (args.decode_sents, 24)), (0, 1), value=cfg.eos_id)
    decode = bench_decode(cfg, dec_src.to(device), DTYPES[args.dtype[0]], args.beam, device, args.decode_len)
    record = dict(
        vars(args), device_name=device_name(device), torch=torch.__version__, threads=torch.get_num_threads(),
        load_avg_before=load, model_cfg=dataclasses.asdict(cfg), params=train[0]['params'],
        sentences_per_batch=sum(b[0].size(0) for b in timed_batches) / len(timed_batches),
        real_token_fraction=(n_src + n_tgt) / sum(b[0].numel() + b[1].numel() for b in timed_batches),
        peak_source=peak_name, peak_flops=peaks, gemm_flops=gemm, train=train, ratios=ratios, decode=decode,
        elapsed_s=time.perf_counter() - t_start)
    report(record, args.json)
    return record


def report(r, as_json=False):
    if as_json:
        return print(json.dumps(r))
    c, tflops = r['model_cfg'], lambda d: ', '.join(f'{k} {v / 1e12:.3g} TFLOP/s' for k, v in d.items())
    print(f"{r['device_name']} ({r['device']}, {r['threads']} threads), torch {r['torch']}, "
          f"load average before the run {r['load_avg_before']:.2f}")
    warn_if_loaded(r['load_avg_before'], r['device'])
    print(f"config {r['config']}: {c['n_enc_layers']}+{c['n_dec_layers']} layers, d_model {c['d_model']}, "
          f"d_ff {c['d_ff']}, heads {c['n_heads']}, vocab {c['vocab_size']}, {r['params'] / 1e6:.1f}M params")
    print(f"batches: {r['data'] or 'synthetic'}, <= {r['batch_tokens']} padded tokens per side, "
          f"{r['sentences_per_batch']:.0f} sentences on average, {r['real_token_fraction']:.0%} real tokens; "
          f"{r['warmup']} warm-up + {r['steps']} timed steps per row")
    print(f"peak ({r['peak_source']}): {tflops(r['peak_flops'])}; GEMM timed here: {tflops(r['gemm_flops'])}")
    print('\nTraining step (forward + backward + Adam); tok/s: real source + target tokens; FLOP/s: padded')
    hdr = (f"{'implementation':<22}{'mode':<9}{'dtype':<10}{'step ms':>9}{'tok/s':>9}{'tgt tok/s':>10}"
           f"{'TFLOP/s':>9}{'MFU':>7}{'of GEMM':>8}{'warmup s':>10}")
    print(hdr + '\n' + '-' * len(hdr))
    row = ('{impl:<22}{mode:<9}{dtype:<10}{step_ms:>9.0f}{tokens_per_s:>9.0f}{tgt_tokens_per_s:>10.0f}'
           '{tf:>9.3f}{mfu:>7.1%}{of_gemm:>8.1%}{warmup_s:>10.1f}')
    for t in r['train']:
        print(row.format(**t, tf=t['flops_per_s'] / 1e12))
    print('ratios of tokens/s: ' + ', '.join(f'{k} {v:.2f}x' for k, v in r['ratios'].items()))
    print(f"\nDecoding {r['decode_sents']} sentences of 24 tokens in one batch, {r['decode_len']} output "
          f"tokens each, the same random weights, {r['dtype'][0]}")
    hdr = f"{'search':<10}{'implementation':<20}{'sent/s':>9}{'tgt tok/s':>11}{'vs model.py':>13}"
    print(hdr + '\n' + '-' * len(hdr))
    ours = {d['search']: d['sents_per_s'] for d in r['decode'] if d['impl'] == 'model.py'}
    for d in r['decode']:
        print(f"{d['search']:<10}{d['impl']:<20}{d['sents_per_s']:>9.1f}{d['tgt_tokens_per_s']:>11.0f}"
              f"{d['sents_per_s'] / ours[d['search']]:>12.2f}x")
    print(f"total {r['elapsed_s']:.0f} s")


if __name__ == '__main__':
    main()
