"""
How fast is model.py, measured on your own machine in one command:

    python bench.py                                      # small model, 2 minutes on 2 CPU cores
    python bench.py --config base --batch-tokens 8192    # the paper's base model
    python bench.py --config config/multi30k.py          # train.py's step of a recipe, its data
    python bench.py --data data/NAME --peak h100 --json  # real batches, MFU against a data sheet
    python bench.py --translate out/RUN/ckpt.pt --input SRC --ref REF  # real text, vs CTranslate2

Training steps on train.py's batches (synthetic or --data): model.py eager and compiled, and
torch.nn.Transformer with the same dimensions, masks, loss and optimizer; FLOP/s from
flops_per_step, MFU against a peak. Decoding: greedy and beam search, vs CTranslate2.
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
import decode
import model as M
import speed

# Configs beyond model.preset: 'small' is Multi30k-sized (what one trains on a laptop), 'tiny' is
# for tests.
CONFIGS = {
    'tiny': dict(vocab_size=512, n_enc_layers=2, n_dec_layers=2, d_model=64, d_ff=128,
                 n_heads=4),
    'small': dict(vocab_size=8000, n_enc_layers=3, n_dec_layers=3, d_model=256, d_ff=1024,
                  n_heads=4),
}
# train.py's settings of its steps beyond the model, at its defaults (a config file may set them):
# the loss, AdamW, clipping, and the seed of the batch order.
SETTINGS = dict(label_smoothing=0.1, beta1=0.9, beta2=0.98, adam_eps=1e-9, weight_decay=0.0,
                clip_grad=0.0, seed=1337)
# Dense tensor-core peaks in FLOP/s from the vendors' data sheets; float32 runs as TF32 (on here).
PEAKS = {'a100': {'bfloat16': 312e12, 'float32': 156e12},
         'h100': {'bfloat16': 989e12, 'float32': 495e12},   # SXM
         'h200': {'bfloat16': 989e12, 'float32': 495e12}}
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16}
HERE = os.path.dirname(os.path.abspath(__file__))
# translate.py's speed line names the dtype: 'torch.bfloat16', or 'CTranslate2 int8'
DTYPE_IN_LOG = r'target tokens/s \([^,]+, (?:torch\.|CTranslate2 )?([^,]+),'


def flops_per_step(cfg, B, S, T, tokens=None):
    """Matmul FLOPs of one training step (forward + backward = 3 x forward) over a padded batch:
    B sentences, source padded to S tokens (EOS included), decoder input to T: the work the hardware
    did, but for the output projection over the `tokens` real targets alone (train.py's).
    (m x k) @ (k x n): 2*m*k*n FLOPs. Attention counts the full S*S, T*T, T*S scores; O(d) per-token
    work (norms, softmax, biases) is left out."""
    d, f, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    enc_layer = (2 * B * S * (3 * d * d + d * d + 2 * d * f)  # QKV, output projection, FFN
                 + 2 * B * S * S * d * 2)                     # Q K^T and attn @ V, all heads
    dec_layer = (2 * B * T * (3 * d * d + d * d + 2 * d * f)  # self-attention projections, FFN
                 + 2 * B * T * T * d * 2                      # self-attention scores, values
                 + 2 * B * T * (d * d + d * d)                # cross-attention Q, output
                 + 2 * B * S * (2 * d * d)                    # cross-attention K, V
                 + 2 * B * T * S * d * 2)                     # cross-attention scores, values
    if tokens is None:
        tokens = B * T
    logits = 2 * tokens * d * V  # the output projection onto the vocabulary
    return 3 * (cfg.n_enc_layers * enc_layer + cfg.n_dec_layers * dec_layer + logits)


def synthetic_split(n, vocab, seed=0, median=25, cap=250):
    """n random pairs in dataset.load_split's format. Subword sentence lengths are roughly lognormal
    (WMT14 en-de: median ~25, a long right tail), the target's the source's +-15%; ids avoid the
    three specials."""
    rng = np.random.default_rng(seed)
    src_len = np.clip(rng.lognormal(math.log(median), 0.5, n).round(), 1, cap).astype(np.int64)
    tgt_len = np.clip((src_len * rng.normal(1.0, 0.15, n)).round(), 1, cap).astype(np.int64)
    sides = []
    for lens in (src_len, tgt_len):
        sides.append(rng.integers(3, vocab, lens.sum()))
        sides.append(np.concatenate([[0], np.cumsum(lens)]))
    return tuple(sides)


def make_batches(data, cfg, batch_tokens, n, device, seed=0):
    """The first n batches of train.py's epochs over data with this seed (a short corpus goes on to
    its next epoch), as its get_batch makes them: -> [(src, tgt_in, the real target tokens' rows,
    their targets)] on device."""
    batches = []
    for epoch in range(n):
        plan = dataset.batch_plan(data, batch_tokens, seed, epoch)
        for ids in plan[:n - len(batches)]:
            arrays = dataset.collate(data, ids, cfg.pad_id, cfg.bos_id, cfg.eos_id)
            batches.append(tuple(torch.from_numpy(a).to(device) for a in arrays))
        if len(batches) == n:
            break
    return batches


class Builtin(nn.Module):
    """torch.nn.Transformer, the module one would otherwise pick, completed as ours: shared
    embedding and output projection, sinusoidal positions, the same masks; the same parameters and
    FLOPs."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        pe = M.sinusoidal_positions(cfg.max_len, cfg.d_model)
        self.register_buffer('pe', pe, persistent=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.tf = nn.Transformer(cfg.d_model, cfg.n_heads, cfg.n_enc_layers, cfg.n_dec_layers,
                                 cfg.d_ff, cfg.dropout, batch_first=True, norm_first=cfg.pre_norm)
        for m in self.tf.modules():
            if isinstance(m, nn.MultiheadAttention):  # else `dropout` on the attention weights
                m.dropout = cfg.attn_dropout
        if not cfg.pre_norm:  # the post-norm paper model (and ours): no final LayerNorm per stack
            self.tf.encoder.norm = None
            self.tf.decoder.norm = None

    def embed_tokens(self, x):
        scaled = self.embed(x) * math.sqrt(self.cfg.d_model)
        return self.dropout(scaled + self.pe[:x.size(1)])

    def forward(self, src, tgt, rows=None):
        pad_mask = src == self.cfg.pad_id  # True = ignore (the opposite of model.py's convention)
        T = tgt.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)
        x = self.tf(self.embed_tokens(src), self.embed_tokens(tgt), tgt_mask=causal,
                    tgt_is_causal=True, src_key_padding_mask=pad_mask,
                    memory_key_padding_mask=pad_mask)
        if rows is None:
            return F.linear(x, self.embed.weight)
        return x.flatten(0, 1)[rows]


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


def timed(fn, device):
    """-> (fn(), seconds). GPU kernels run asynchronously: wait for them before reading the
    clock."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def measure_peak(dtype, device):
    """Best of a few large square GEMMs: MFU's denominator on a CPU, a check of a GPU's data
    sheet."""
    cuda = device.type == 'cuda'
    n = 8192 if cuda else 2048
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    times = [timed(lambda: a @ b, device)[1] for _ in range(10 if cuda else 4)]
    return 2 * n ** 3 / min(times[1:])  # the first: library and clock warm-up


def bench_train(cfg, impl, compiled, dtype, batches, warmup, device, profile=False,
                settings=SETTINGS):
    """Trains on batches with train.py's step and settings; times the steps after the first `warmup`
    (compilation, allocator warm-up)."""
    torch.manual_seed(0)
    if impl == 'ours':
        model = M.Transformer(cfg)
    else:
        model = Builtin(cfg)
    model = model.to(device).train()
    if impl == 'ours' and device.type == 'cpu':  # train.py's faster dropout mask
        speed.cpu_dropout(model)
    chunk_fn = M.loss_chunk
    if compiled:  # as train.py: per layer (identical layers share a graph), and the loss's chunks
        for layer in [*model.encoder, *model.decoder]:
            layer.compile(dynamic=True)
        chunk_fn = torch.compile(M.loss_chunk, dynamic=True)
    betas = (settings['beta1'], settings['beta2'])
    opt = M.configure_optimizer(model, 1e-4, betas, settings['adam_eps'], settings['weight_decay'])
    max_norm = settings['clip_grad'] or math.inf
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def steps(batches):
        for src, tgt_in, rows, targets in batches:
            with autocast:
                x = model(src, tgt_in, rows)
                loss, _ = M.label_smoothed_loss(x, model.embed.weight, targets,
                                                settings['label_smoothing'], chunk_fn)
            (loss / len(rows)).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            M.skip_if_non_finite(opt, grad_norm)  # as train.py
            opt.step()
            opt.zero_grad(set_to_none=True)

    # train.py's attention kernels for this dtype: on a CPU, flash attention is slower in bf16
    flash = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(device.type != 'cpu' or dtype != torch.bfloat16)
    _, warmup_s = timed(lambda: steps(batches[:warmup]), device)
    if profile:  # by operator (kernel on a GPU); on stderr: --json's stdout stays one record
        with torch.profiler.profile() as prof:
            _, seconds = timed(lambda: steps(batches[warmup:]), device)
        print_profile(prof, device)
    else:
        _, seconds = timed(lambda: steps(batches[warmup:]), device)
    torch.backends.cuda.enable_flash_sdp(flash)  # decoding keeps it, as translate.py does
    mode = 'compile' if compiled else 'eager'
    params = sum(p.numel() for p in model.parameters())
    return dict(impl=impl, mode=mode, dtype=str(dtype).split('.')[-1], seconds=seconds,
                warmup_s=warmup_s, params=params)


def print_profile(prof, device):
    if device.type == 'cuda':
        key = 'self_device_time_total'
    else:
        key = 'self_cpu_time_total'
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
    print(table, file=sys.stderr)


def ct2_runs(model, src, beam, out_len, device):
    """The same weights exported to CTranslate2 (export_ct2.export), greedy and beam, float32 and
    int8 (float16 and int8_float16 on a GPU); [] without ctranslate2."""
    if not importlib.util.find_spec('ctranslate2'):
        return []
    import ctranslate2

    import export_ct2
    tmp, runs = tempfile.TemporaryDirectory(), []
    rows = [[str(t) for t in row[:-1]] for row in src.tolist()]  # the export adds EOS
    quantizations = ('float32', 'int8')
    threads = torch.get_num_threads()
    if device.type == 'cuda':
        quantizations = ('float16', 'int8_float16')
        threads = 0
    for quantization in quantizations:
        path = export_ct2.export(model, {}, os.path.join(tmp.name, quantization), quantization)
        tr = ctranslate2.Translator(path, device=device.type, compute_type=quantization,
                                    intra_threads=threads)
        for name, k in (('greedy', 1), (f'beam {beam}', beam)):
            runs.append((name, f'CT2 {quantization}', ct2_search(tr, rows, k, out_len)))
    return runs  # tmp goes with the return: each Translator holds its model in memory


def ct2_search(translator, rows, k, out_len):
    """-> a function that translates rows, its output in model.py's format (for the counts)."""
    def search():
        results = translator.translate_batch(rows, beam_size=k, length_penalty=0.6,
                                             max_decoding_length=out_len)
        return [[(r.hypotheses[0], 0.0)] for r in results]
    return search


def bench_decode(cfg, src, dtype, beam, device, out_len):
    # Random weights almost never emit EOS: every output runs to out_len tokens + EOS, the same
    # work for all.
    torch.manual_seed(0)
    model = M.Transformer(cfg).to(device).eval()

    def greedy():
        return decode.greedy_decode(model, src, 0.0, out_len + 1)

    def beam_search():
        return decode.beam_search(model, src, beam, 0.6, 0.0, out_len + 1)

    runs = [('greedy', 'model.py', greedy), (f'beam {beam}', 'model.py', beam_search)]
    rows = []
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    # with packed weights, as translate.py decodes (they change nothing for the CT2 rows)
    with autocast, speed.packed_weights(model):
        for name, how, fn in runs + ct2_runs(model, src, beam, out_len, device):
            fn()  # warm-up: allocator, thread pools
            out, dt = timed(fn, device)
            n_tok = sum(len(hyps[0][0]) for hyps in out)  # generated tokens, EOS not counted
            rows.append(dict(search=name, impl=how, sents_per_s=len(out) / dt,
                             tgt_tokens_per_s=n_tok / dt))
    return rows


def run_script(name, *args):
    """Runs a script of this folder -> its stderr; its failure ends bench.py with its last line of
    error."""
    cmd = [sys.executable, os.path.join(HERE, name), *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        last = (res.stderr.strip() or f'exit status {res.returncode}').splitlines()[-1]
        sys.exit(f"bench.py: {name} {' '.join(args)} failed: {last}")
    return res.stderr


def bench_translate(args):
    """Sentences/s, BLEU and agreement of translate.py on real text: model.py (its stop rule and
    --exact) and its CTranslate2 exports, beam and greedy; a process per row, the rows alternating
    in each round."""
    load, tmp = os.getloadavg()[0], tempfile.TemporaryDirectory()
    impls = [('model.py', args.translate, []), ('model.py --exact', args.translate, ['--exact'])]
    if importlib.util.find_spec('ctranslate2'):
        quantizations = ('none', 'int8')
        if args.device.startswith('cuda'):
            quantizations = ('float16', 'int8_float16')
        for q in quantizations:
            out = os.path.join(tmp.name, f'ct2_{q}')
            run_script('export_ct2.py', '--ckpt', args.translate, '--out', out, '--quantization', q)
            impls.append((f'CTranslate2 {"float32" if q == "none" else q}', out, []))
    searches = [('greedy', ['--greedy'])]
    if args.beam > 1:
        searches.insert(0, (f'beam {args.beam}', ['--beam', str(args.beam)]))
    rows = []
    for search, how in searches:
        for impl, path, flags in impls:
            if search == 'greedy' and flags:  # --exact: a rule of beam search alone
                continue
            rows.append(dict(search=search, impl=impl, cmd=[path, *how, *flags], sents_per_s=[]))
    # --ref among the options for translate.py
    common = ['--input', args.input, '--device', args.device, *args.translate_args]
    for _ in range(args.rounds):
        for i, r in enumerate(rows):
            out = os.path.join(tmp.name, f'{i}.txt')
            err = run_script('translate.py', '--ckpt', *r['cmd'], *common, '--output', out)
            r['sents_per_s'].append(float(re.search(r'([\d.]+) sentences/s', err)[1]))
            r['dtype'] = re.search(DTYPE_IN_LOG, err)[1]
            bleu = re.search(r'sacreBLEU: BLEU = ([\d.]+)', err)
            r['bleu'] = float(bleu[1]) if bleu else None
            with open(out, encoding='utf-8') as f:
                r['lines'] = f.read().splitlines()
    for r in rows:
        ref = next(x for x in rows if x['search'] == r['search'])  # model.py's, the same search
        r['median_sents_per_s'] = float(np.median(r['sents_per_s']))
        r['vs_model_py'] = r['median_sents_per_s'] / ref['median_sents_per_s']
        r['same_as_model_py'] = sum(a == b for a, b in zip(r['lines'], ref['lines']))
    summary = [{k: v for k, v in r.items() if k not in ('cmd', 'lines')} for r in rows]
    record = dict(vars(args), device_name=device_name(torch.device(args.device)),
                  torch=torch.__version__, threads=torch.get_num_threads(), load_avg_before=load,
                  sentences=len(rows[0]['lines']), rows=summary)
    if args.json:
        print(json.dumps(record))
    else:
        report_translate(record)
    return record


def report_translate(r):
    print(f"{r['device_name']}, torch {r['torch']}, {r['threads']} threads; {r['translate']} on "
          f"{r['sentences']} lines of {r['input']}, {r['rounds']} round(s)")
    warn_if_loaded(r['load_avg_before'], r['device'])
    hdr = (f"{'search':<10}{'implementation':<23}{'dtype':<14}{'sent/s (each round)':<24}"
           f"{'median':>8}{'vs model.py':>13}{'BLEU':>7}{'same as model.py':>18}")
    print(hdr + '\n' + '-' * len(hdr))
    for row in r['rows']:
        each = ' '.join(f'{x:.1f}' for x in row['sents_per_s'])
        bleu = '-' if row['bleu'] is None else f"{row['bleu']:.2f}"
        print(f"{row['search']:<10}{row['impl']:<23}{row['dtype']:<14}{each:<24}"
              f"{row['median_sents_per_s']:>8.1f}{row['vs_model_py']:>12.2f}x{bleu:>7}"
              f"{row['same_as_model_py']:>12}/{r['sentences']}")


def device_name(device):
    if device.type == 'cuda':
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):  # no /proc/cpuinfo
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':')[1].strip()
    return 'cpu'


def warn_if_loaded(load, device):
    if not device.startswith('cuda') and load > 0.5:  # other processes skew CPU timings
        print('WARNING: other processes were using the CPU; close them and rerun for trustworthy '
              'figures')


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--config', default='small',
                   help='tiny, small: defined here; base, big: model.preset; or a train.py '
                        'config file: its model, max_tokens, data_dir, dtype and settings '
                        "(train.py's step exactly)")
    p.add_argument('--batch-tokens', type=int,
                   help='max padded tokens per side per batch (default 2048)')
    p.add_argument('--data',
                   help='data/NAME from data_prep.py: its batches instead of synthetic ones')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--dtype', nargs='+', choices=DTYPES,
                   help='training rows in each, decoding in the first')
    p.add_argument('--peak', choices=['measured', *PEAKS],
                   help='MFU denominator (default: a data sheet)')
    p.add_argument('--profile', action='store_true',
                   help="where each row's timed steps went, by operator")
    p.add_argument('--compile', choices=['auto', 'on', 'off'], default='auto',
                   help='auto: on a GPU, or tiny and small (compiling base or big takes minutes on '
                        'a CPU)')
    p.add_argument('--warmup', type=int,
                   help='untimed steps per row (default 30 on a GPU, 1 on a CPU)')
    p.add_argument('--steps', type=int, default=3, help='timed training steps per row')
    p.add_argument('--decode-sents', type=int, default=32,
                   help='decoded at once, each of 24 source tokens')
    p.add_argument('--decode-len', type=int, default=20,
                   help='output tokens per sentence (then EOS)')
    p.add_argument('--beam', type=int, default=4)
    p.add_argument('--json', action='store_true', help='print one JSON record instead of tables')
    g = p.add_argument_group('--translate',
                             'other options (--ref REF for BLEU, ...) go to translate.py')
    g.add_argument('--translate', metavar='CKPT',
                   help='decode --input by CKPT and its CTranslate2 exports')
    g.add_argument('--input', help='source text, one sentence per line')
    g.add_argument('--rounds', type=int, default=3,
                   help='each row this many times, the rows alternating')
    args, args.translate_args = p.parse_known_args(argv)
    for name in ('steps', 'decode_sents', 'decode_len', 'beam', 'rounds', 'batch_tokens'):
        value = getattr(args, name)
        if value is not None and value < 1:  # batch_tokens: None until given
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        p.error('--warmup must be >= 0')
    args.settings = dict(SETTINGS)
    if args.config.endswith('.py'):
        read_config_file(args, p)
    elif args.config not in [*CONFIGS, *M.PRESETS]:
        p.error(f'--config: {args.config!r} is neither tiny, small, base, big nor a config file')
    if not args.batch_tokens:
        args.batch_tokens = 2048
    if args.translate_args and not args.translate:
        p.error(f"unrecognized arguments: {' '.join(args.translate_args)}")
    if args.translate and not args.input:  # translate.py would wait on standard input
        p.error('--translate needs --input')
    return args


def read_config_file(args, parser):
    """A train.py config file, read over train.py's defaults: its model, max_tokens, data_dir, dtype
    and settings, where the command line does not give them (0 and '': bench.py's own defaults)."""
    defaults = {**vars(M.Config()), **SETTINGS, 'max_tokens': 0, 'data_dir': '', 'dtype': 'auto'}
    s = configurator.run_file(args.config, defaults)
    CONFIGS[args.config] = {f.name: s[f.name] for f in dataclasses.fields(M.Config)}
    args.settings = {k: s[k] for k in SETTINGS}
    if not args.batch_tokens:
        args.batch_tokens = s['max_tokens']
    if not args.data:
        args.data = s['data_dir']
    if not args.dtype and s['dtype'] != 'auto':
        if s['dtype'] not in DTYPES:
            parser.error(f"{args.config}: dtype {s['dtype']!r}: bench.py times float32 and "
                         f"bfloat16 (--dtype)")
        args.dtype = [s['dtype']]


def setup(args, device):
    """The defaults that depend on the device, and train.py's settings of it."""
    cuda = device.type == 'cuda'
    if args.warmup is None:
        args.warmup = 30 if cuda else 1
    if not args.dtype:
        args.dtype = [speed.fast_dtype(device.type)]
    if cuda:  # TF32 matmuls; no cuDNN attention, which plans anew for each batch shape
        torch.set_float32_matmul_precision('high')
        torch.backends.cuda.enable_cudnn_sdp(False)
    else:
        speed.keep_freed_memory()


def model_and_data(args):
    """-> the model's Config and the training split: --data's (its vocabulary and ids), or
    synthetic."""
    cfg = M.Config(**{**CONFIGS, **M.PRESETS}[args.config])
    if not args.data:  # about twice the sentences of ~25 tokens that the batches need
        n = (args.warmup + args.steps) * args.batch_tokens // 12 + 64
        return cfg, synthetic_split(n, cfg.vocab_size)
    meta = dataset.load_meta(args.data)
    ids = {k: meta[k] for k in ('pad_id', 'bos_id', 'eos_id')}
    vocab_size = (meta['vocab_size'] + 7) // 8 * 8  # a multiple of 8, as train.py rounds it
    cfg = dataclasses.replace(cfg, vocab_size=vocab_size, **ids)
    return cfg, dataset.load_split(args.data, 'train')


def table_peak(device):
    """The data sheet's name of this device in PEAKS, else 'measured'."""
    name = device_name(device).lower()
    for k in PEAKS:
        if k in name:
            return k
    return 'measured'


def ratios(train):
    """Ratios of tokens/s between the rows measured."""
    tps = {(r['impl'], r['mode'], r['dtype']): r['tokens_per_s'] for r in train}
    pairs = []
    for d in DTYPES:
        builtin = ('torch.nn.Transformer', 'eager', d)
        pairs.append((f'ours/built-in {d}', ('ours', 'eager', d), builtin))
    for d in DTYPES:
        pairs.append((f'compile/eager {d}', ('ours', 'compile', d), ('ours', 'eager', d)))
    bf16, fp32 = ('ours', 'eager', 'bfloat16'), ('ours', 'eager', 'float32')
    pairs.append(('bfloat16/float32 eager', bf16, fp32))
    return {name: tps[a] / tps[b] for name, a, b in pairs if a in tps and b in tps}


def main(argv=None):
    args = parse_args(argv)
    if args.translate:
        return bench_translate(args)
    t_start = time.perf_counter()
    load = os.getloadavg()[0]
    device = torch.device(args.device)
    if args.data and not os.path.isfile(os.path.join(args.data, 'meta.json')):
        sys.exit(f"bench.py: no prepared data in {args.data}: prepare it, "
                 f"`python data_prep.py CORPUS ... --out {args.data}`")
    setup(args, device)
    cfg, data = model_and_data(args)
    compiled = args.compile == 'on'
    if args.compile == 'auto':  # compiling base or big takes minutes on a CPU
        compiled = device.type == 'cuda' or args.config in ('tiny', 'small')
    n = args.warmup + args.steps
    batches = make_batches(data, cfg, args.batch_tokens, n, device, args.settings['seed'])
    if compiled:  # torch.compile ties equal sizes: a first batch with S == T would recompile later
        batches.sort(key=lambda b: b[0].size(1) == b[1].size(1))
    timed_batches = batches[args.warmup:]
    n_src = sum(int((b[0] != cfg.pad_id).sum()) for b in timed_batches)  # + EOS, as the targets
    n_tgt = sum(len(b[2]) for b in timed_batches)
    padded = sum(b[0].numel() + b[1].numel() for b in timed_batches)
    sentences = sum(b[0].size(0) for b in timed_batches)
    flops = 0
    for src, tgt_in, rows, _ in timed_batches:
        flops += flops_per_step(cfg, src.size(0), src.size(1), tgt_in.size(1), len(rows))

    peak_name = args.peak or table_peak(device)
    gemm = {d: measure_peak(DTYPES[d], device) for d in args.dtype}
    peaks = gemm
    if peak_name != 'measured':
        peaks = {d: PEAKS[peak_name][d] for d in args.dtype}
    variants = []
    for d in args.dtype:
        variants.append(('ours', False, d))
        if compiled:
            variants.append(('ours', True, d))
        variants.append(('torch.nn.Transformer', False, d))
    train = []
    for impl, compile_row, d in variants:
        r = bench_train(cfg, impl, compile_row, DTYPES[d], batches, args.warmup, device,
                        args.profile, args.settings)
        dt = r.pop('seconds')
        r.update(step_ms=1e3 * dt / len(timed_batches), tokens_per_s=(n_src + n_tgt) / dt,
                 tgt_tokens_per_s=n_tgt / dt, flops_per_s=flops / dt,
                 mfu=flops / dt / peaks[d], of_gemm=flops / dt / gemm[d])
        train.append(r)

    dec_src = torch.randint(3, cfg.vocab_size, (args.decode_sents, 24))
    dec_src = F.pad(dec_src, (0, 1), value=cfg.eos_id).to(device)
    dec_dtype = DTYPES[args.dtype[0]]
    decoding = bench_decode(cfg, dec_src, dec_dtype, args.beam, device, args.decode_len)
    record = dict(vars(args), device_name=device_name(device), torch=torch.__version__,
                  threads=torch.get_num_threads(), load_avg_before=load,
                  model_cfg=dataclasses.asdict(cfg), params=train[0]['params'],
                  sentences_per_batch=sentences / len(timed_batches),
                  real_token_fraction=(n_src + n_tgt) / padded,
                  peak_source=peak_name, peak_flops=peaks, gemm_flops=gemm, train=train,
                  ratios=ratios(train), decode=decoding, elapsed_s=time.perf_counter() - t_start)
    if args.json:
        print(json.dumps(record))
    else:
        report(record)
    return record


def tflops(flops_by_dtype):
    return ', '.join(f'{k} {v / 1e12:.3g} TFLOP/s' for k, v in flops_by_dtype.items())


def report(r):
    c = r['model_cfg']
    print(f"{r['device_name']} ({r['device']}, {r['threads']} threads), torch {r['torch']}, "
          f"load average before the run {r['load_avg_before']:.2f}")
    warn_if_loaded(r['load_avg_before'], r['device'])
    print(f"config {r['config']}: {c['n_enc_layers']}+{c['n_dec_layers']} layers, "
          f"d_model {c['d_model']}, d_ff {c['d_ff']}, heads {c['n_heads']}, "
          f"vocab {c['vocab_size']}, {r['params'] / 1e6:.1f}M params")
    print(f"batches: {r['data'] or 'synthetic'}, <= {r['batch_tokens']} padded tokens per side, "
          f"{r['sentences_per_batch']:.0f} sentences on average, "
          f"{r['real_token_fraction']:.0%} real tokens; "
          f"{r['warmup']} warm-up + {r['steps']} timed steps per row")
    print(f"peak ({r['peak_source']}): {tflops(r['peak_flops'])}; "
          f"GEMM timed here: {tflops(r['gemm_flops'])}")
    print("\nTraining step (forward + backward + AdamW); tok/s: real source + target tokens; "
          "FLOP/s: padded")
    hdr = (f"{'implementation':<22}{'mode':<9}{'dtype':<10}{'step ms':>9}{'tok/s':>9}"
           f"{'tgt tok/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'of GEMM':>8}{'warmup s':>10}")
    print(hdr + '\n' + '-' * len(hdr))
    row = ('{impl:<22}{mode:<9}{dtype:<10}{step_ms:>9.0f}{tokens_per_s:>9.0f}'
           '{tgt_tokens_per_s:>10.0f}{tf:>9.3f}{mfu:>7.1%}{of_gemm:>8.1%}{warmup_s:>10.1f}')
    for t in r['train']:
        print(row.format(**t, tf=t['flops_per_s'] / 1e12))
    print('ratios of tokens/s: ' + ', '.join(f'{k} {v:.2f}x' for k, v in r['ratios'].items()))
    print(f"\nDecoding {r['decode_sents']} sentences of 24 tokens in one batch, "
          f"{r['decode_len']} output tokens each, the same random weights, {r['dtype'][0]}")
    hdr = f"{'search':<10}{'implementation':<20}{'sent/s':>9}{'tgt tok/s':>11}{'vs model.py':>13}"
    print(hdr + '\n' + '-' * len(hdr))
    ours = {d['search']: d['sents_per_s'] for d in r['decode'] if d['impl'] == 'model.py'}
    for d in r['decode']:
        vs_ours = d['sents_per_s'] / ours[d['search']]
        print(f"{d['search']:<10}{d['impl']:<20}{d['sents_per_s']:>9.1f}"
              f"{d['tgt_tokens_per_s']:>11.0f}{vs_ours:>12.2f}x")
    print(f"total {r['elapsed_s']:.0f} s")


if __name__ == '__main__':
    main()
