"""
The GPU A/B and profile behind docs/performance.md: model.py's training step as bench.py's compiled
row runs it (layers compiled with dynamic shapes, the loss's chunks compiled, bf16, fused Adam) on
bench.py's synthetic WMT-like batches, in several variants in one process, the rounds alternating;
medians with MFU.
    padded   today's step: padded batches, SDPA with the padding mask
    packed   the same sentences end to end (speed.pack): flash attention over variable lengths,
             no padding
    graphs   packed to a fixed size, the model's forward and backward replayed as CUDA graphs (one
             per shape)
    eager-graphs   the same without torch.compile
    bf16, graphs-bf16   padded or graphs with the weights in bf16 and no autocast: what the casts
             cost at most
    master, graphs-master   the same on a bf16 copy, Adam on the float32 weights (train.py's
             master_weights)
    old      another version's model.py (--old), padded
    git show e1c7854:model.py > data/model_old.py     # an ignored folder
    python dev/gpu_ab.py --variants padded,packed,graphs --batch-tokens 25000 4096 [--old F]
    python dev/gpu_ab.py --variants padded,graphs --batch-tokens 4096 --profile
MFU counts the padded batches' matmul FLOPs (bench.flops_per_step) for every variant: the same work
done faster. Measurements, not a test: one process on the GPU (on a CPU: a check that it runs,
tiny).
"""
import argparse
import copy
import importlib.util
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench  # noqa: E402
import model as M  # noqa: E402
import speed  # noqa: E402

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument('--old', help="another version's model.py: variant 'old'")
p.add_argument('--variants', default='padded,old', help='comma-separated, of those above')
p.add_argument('--config', default='base', choices=[*M.PRESETS, *bench.CONFIGS])
p.add_argument('--batch-tokens', type=int, nargs='+', default=[25000])
p.add_argument('--warmup', type=int, default=20)
p.add_argument('--steps', type=int, default=10, help='per round')
p.add_argument('--rounds', type=int, default=3)
p.add_argument('--graphs-max-tokens', type=int, default=8192,
               help='graph variants only up to this batch size: each shape keeps its own '
                    'activations (5 of base at 25000 tokens: 64 GB)')
p.add_argument('--profile', action='store_true',
               help="then where the fastest variant's GPU time goes")
args = p.parse_args()
torch.set_float32_matmul_precision('high')
torch.backends.cuda.enable_cudnn_sdp(False)  # as the scripts (docs/performance.md, GPU)
dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
cfg = M.Config(**{**bench.CONFIGS, **M.PRESETS}[args.config])
variants = [v for v in args.variants.split(',') if v != 'old' or args.old]


def load(path):
    spec = importlib.util.spec_from_file_location('model_old', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def to_dev(b):
    return tuple(x.to(dev) if torch.is_tensor(x) else x for x in b)


def packed_batches(batches, size=None, max_len=None):  # on the host, as train.py's get_batch would
    out = []
    for src, tgt_in, rows, targets in batches:
        s, t, rows, (ps, pt) = speed.pack(src, tgt_in, cfg.pad_id, size, max_len)
        out.append((s.to(dev), t.to(dev), rows, targets.to(dev), ps.to(dev), pt.to(dev)))
    return out


def trainer(lib, name, compiled=True):
    """-> steps(batches): lib's model trained as bench.py's compiled row, on the variant's
    batches."""
    torch.manual_seed(0)
    weights = lib.Transformer(cfg).to(dev).train()  # Adam's
    bf16 = name.endswith(('bf16', 'master'))  # weights in bf16, no autocast: the casts' bound, or
    master = name.endswith('master')  # as train.py's master_weights: Adam's weights in float32
    model = copy.deepcopy(weights).to(torch.bfloat16) if master else weights
    if bf16 and dev.type == 'cuda':
        model.to(torch.bfloat16)
    chunk_fn = lib.loss_chunk
    if compiled:
        for layer in [*model.encoder, *model.decoder]:
            layer.compile(dynamic=True)
        chunk_fn = torch.compile(lib.loss_chunk, dynamic=True)
    opt = torch.optim.Adam(weights.parameters(), 1e-4, (0.9, 0.98), 1e-9, fused=dev.type == 'cuda')
    graphed = speed.Graphed(model)
    use_autocast = dev.type == 'cuda' and not bf16
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_autocast,
                              cache_enabled=False)

    def forward(src, tgt_in, rows, ps=None, pt=None):
        if ps is None:
            return model(src, tgt_in, rows)
        if 'graphs' in name:
            return graphed(src, tgt_in, rows, ps, pt)
        return speed.forward(model, src, tgt_in, rows, (ps, pt))

    def steps(bs):
        for src, tgt_in, rows, targets, *packed in bs:
            with autocast:
                x = forward(src, tgt_in, rows, *packed)
                loss, _ = lib.label_smoothed_loss(x, model.embed.weight, targets, 0.1, chunk_fn)
            (loss / len(targets)).backward()
            if master:
                for p, q in zip(weights.parameters(), model.parameters()):
                    p.grad = q.grad.float()
                    q.grad = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            if master:
                copies = [q.detach() for q in model.parameters()]
                torch._foreach_copy_(copies, list(weights.parameters()))
    steps.graphs = graphed.graphs
    return steps


def measure(tokens):
    """Every variant at one batch size: warm-up, timed rounds, their medians and a profile."""
    n = args.warmup + args.steps
    data = bench.synthetic_split(n * tokens // 12 + 64, cfg.vocab_size)
    padded = bench.make_batches(data, cfg, tokens, n, torch.device('cpu'))
    padded.sort(key=lambda b: b[0].size(1) == b[1].size(1))  # as bench.py: S == T would recompile
    longest = max(max(b[0].size(1), b[1].size(1)) for b in padded)
    max_len = 2 ** (longest - 1).bit_length()  # one bound for every batch: fewer shapes
    kinds = {
        'padded': [to_dev(b) for b in padded],
        'old': [to_dev(b) for b in padded],
        'packed': packed_batches(padded),
        'graphs': packed_batches(padded, tokens + max_len, max_len),
    }
    for name in ('eager-graphs', 'graphs-bf16', 'graphs-master'):
        kinds[name] = kinds['graphs']
    for name in ('bf16', 'master'):
        kinds[name] = kinds['padded']
    runs = warm_up(tokens, kinds)
    timed = padded[args.warmup:]
    flops = 0
    for s, t, r, _ in timed:
        flops += bench.flops_per_step(cfg, s.size(0), s.size(1), t.size(1), len(r))
    times = {name: [] for name in runs}
    mem = {name: 0.0 for name in runs}
    for r in range(args.rounds):  # the order rotates
        names = list(runs)
        for name in names[r % len(names):] + names[:r % len(names)]:
            if dev.type == 'cuda':
                torch.cuda.reset_peak_memory_stats()
            batches = kinds[name][args.warmup:]
            try:
                seconds = bench.timed(lambda: runs[name](batches), dev)[1]
                times[name].append(seconds)
            except torch.OutOfMemoryError as e:
                print(f'{tokens}: {name}: out of memory: {str(e)[:300]}', flush=True)
            if dev.type == 'cuda':  # graphs' pools stay allocated: this counts the others' too
                mem[name] = max(mem[name], torch.cuda.max_memory_allocated() / 2 ** 30)
    peak = bench.PEAKS['h100']['bfloat16']  # the H200's too
    print(f'{bench.device_name(dev)}, torch {torch.__version__}; {args.config}, {tokens} tokens, '
          f'max_len bound {max_len}, {args.rounds} rounds of {args.steps} steps; '
          f'MFU against {peak / 1e12:.0f} TFLOP/s')
    report(tokens, times, mem, flops, peak)
    if args.profile and dev.type == 'cuda' and runs:
        profile(runs, kinds, times)


def warm_up(tokens, kinds):
    """-> {variant: steps} for those that ran their warm-up steps."""
    runs = {}
    for name in variants:
        if 'graphs' in name and tokens > args.graphs_max_tokens:
            print(f'{tokens}: {name}: skipped, over --graphs-max-tokens')
            continue
        try:
            lib = load(args.old) if name == 'old' else M
            steps = trainer(lib, name, compiled=name != 'eager-graphs')
            seconds = bench.timed(lambda: steps(kinds[name][:args.warmup]), dev)[1]
            runs[name] = steps
            print(f'{tokens}: {name}: {args.warmup} warm-up steps in {seconds:.1f} s, '
                  f'{len(steps.graphs)} graphs', flush=True)
        except Exception as e:  # a variant that fails on this machine: said, the others go on
            print(f'{tokens}: {name}: failed: {type(e).__name__}: {str(e)[:600]}', flush=True)
    return runs


def report(tokens, times, mem, flops, peak):
    """One line per variant, with its MFU and its speed-up against the first."""
    base = 1.0
    first = next(iter(times.values()), [])
    if first:
        base = statistics.median(first)
    for name, ts in times.items():
        if not ts:
            continue
        median = statistics.median(ts)
        each = ', '.join(f'{1e3 * t / args.steps:.1f}' for t in ts)
        print(f'{tokens} {name:<12} {1e3 * median / args.steps:6.1f} ms/step (rounds {each}), '
              f'MFU {flops / median / peak:.1%}, speed-up {base / median:.3f}, '
              f'peak {mem[name]:.1f} GiB', flush=True)


def profile(runs, kinds, times):
    """Where the fastest variant's GPU time goes, over 4 steps."""
    measured = [n for n in runs if times[n]]
    name = min(measured, key=lambda n: statistics.median(times[n]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runs[name](kinds[name][args.warmup:args.warmup + 4])
    print(f'profile: {name}, 4 steps')
    print(prof.key_averages().table(sort_by='self_device_time_total', row_limit=25,
                                    max_name_column_width=90))


for tokens in args.batch_tokens:
    measure(tokens)
    # the variants' models, batches and graphs are freed with measure's frame
    if dev.type == 'cuda':
        torch.cuda.empty_cache()
