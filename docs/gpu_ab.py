"""
The GPU A/B and profile behind docs/performance.md: model.py's training step as bench.py's compiled row runs
it (layers compiled with dynamic shapes, the loss's chunks compiled, bf16, fused Adam) on bench.py's synthetic
WMT-like batches, in several variants in one process, the rounds alternating; medians with MFU.
    padded   today's step: padded batches, SDPA with the padding mask
    packed   the same sentences end to end (speed.pack): flash attention over variable lengths, no padding
    graphs   packed to a fixed size, the model's forward and backward replayed as CUDA graphs (one per shape)
    eager-graphs   the same without torch.compile
    bf16, graphs-bf16   padded or graphs with the weights in bf16 and no autocast: what the casts cost at most
    master, graphs-master   the same on a bf16 copy, Adam on the float32 weights (train.py's master_weights)
    old      another version's model.py (--old), padded
    git show e1c7854:model.py > .gpu_data/model_old.py     # an ignored folder that the device call carries
    python3 docs/gpu_ab.py --variants padded,packed,graphs --batch-tokens 25000 4096 [--old F] [--profile]
MFU counts the padded batches' matmul FLOPs (bench.flops_per_step) for every variant: the same work done
faster. Measurements, not a test: one process on the GPU (on a CPU: a check that it runs, tiny).
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
import speed

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument('--old', help="another version's model.py: variant 'old'")
p.add_argument('--variants', default='padded,old', help='comma-separated, of those above')
p.add_argument('--config', default='base', choices=[*M.PRESETS, *bench.CONFIGS])
p.add_argument('--batch-tokens', type=int, nargs='+', default=[25000])
p.add_argument('--warmup', type=int, default=20)
p.add_argument('--steps', type=int, default=10, help='per round')
p.add_argument('--rounds', type=int, default=3)
p.add_argument('--graphs-max-tokens', type=int, default=8192, help='graph variants only up to this '
               'batch size: each shape keeps its own activations (5 of base at 25000 tokens: 64 GB)')
p.add_argument('--profile', action='store_true', help="then where the fastest variant's GPU time goes")
args = p.parse_args()
torch.set_float32_matmul_precision('high')
torch.backends.cuda.enable_cudnn_sdp(False)  # as the scripts (docs/performance.md, GPU (H100))
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
    """-> steps(batches): lib's model trained as bench.py's compiled row, on the variant's batches."""
    torch.manual_seed(0)
    weights = model = lib.Transformer(cfg).to(dev).train()  # weights: Adam's
    bf16 = name.endswith(('bf16', 'master'))  # weights in bf16, no autocast: the casts' bound, or
    master = name.endswith('master')  # as train.py's master_weights: Adam's weights in float32
    model = copy.deepcopy(weights).to(torch.bfloat16) if master else weights
    model.to(torch.bfloat16) if bf16 and dev.type == 'cuda' else None
    for layer in [*model.encoder, *model.decoder] if compiled else []:
        layer.compile(dynamic=True)
    chunk_fn = torch.compile(lib.loss_chunk, dynamic=True) if compiled else lib.loss_chunk
    opt = torch.optim.Adam(weights.parameters(), 1e-4, (0.9, 0.98), 1e-9, fused=dev.type == 'cuda')
    graphed = speed.Graphed(model)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == 'cuda' and not bf16,
                              cache_enabled=False)

    def forward(src, tgt_in, rows, ps=None, pt=None):
        if ps is None:
            return model(src, tgt_in, rows)
        return (graphed if 'graphs' in name else lambda *a: speed.forward(model, *a))(src, tgt_in, rows, (ps, pt))

    def steps(bs):
        for src, tgt_in, rows, targets, *packed in bs:
            with autocast:
                x = forward(src, tgt_in, rows, *packed)
                loss, _ = lib.label_smoothed_loss(x, model.embed.weight, targets, 0.1, chunk_fn)
            (loss / len(targets)).backward()
            for p, q in zip(weights.parameters(), model.parameters()) if master else []:
                p.grad, q.grad = q.grad.float(), None
            opt.step()
            opt.zero_grad(set_to_none=True)
            if master:
                torch._foreach_copy_([q.detach() for q in model.parameters()], list(weights.parameters()))
    steps.graphs = graphed.graphs
    return steps


for tokens in args.batch_tokens:
    n = args.warmup + args.steps
    data = bench.synthetic_split(n * tokens // 12 + 64, cfg.vocab_size)
    padded = bench.make_batches(data, cfg, tokens, n, torch.device('cpu'))
    padded.sort(key=lambda b: b[0].size(1) == b[1].size(1))  # as bench.py: S == T would recompile
    longest = max(max(b[0].size(1), b[1].size(1)) for b in padded)
    max_len = 2 ** (longest - 1).bit_length()  # one bound for every batch: fewer shapes
    kinds = {'padded': [to_dev(b) for b in padded], 'old': [to_dev(b) for b in padded],
             'packed': packed_batches(padded),
             'graphs': packed_batches(padded, tokens + max_len, max_len)}
    kinds['eager-graphs'] = kinds['graphs-bf16'] = kinds['graphs-master'] = kinds['graphs']
    kinds['bf16'] = kinds['master'] = kinds['padded']
    runs = {}
    for name in variants:
        if 'graphs' in name and tokens > args.graphs_max_tokens:
            print(f'{tokens}: {name}: skipped, over --graphs-max-tokens')
            continue
        try:
            steps = trainer(load(args.old) if name == 'old' else M, name, compiled=name != 'eager-graphs')
            seconds = bench.timed(lambda: steps(kinds[name][:args.warmup]), dev)[1]
            runs[name] = steps
            print(f'{tokens}: {name}: {args.warmup} warm-up steps in {seconds:.1f} s, '
                  f'{len(steps.graphs)} graphs', flush=True)
        except Exception as e:  # a variant that fails on this machine: said, the others go on
            print(f'{tokens}: {name}: failed: {type(e).__name__}: {str(e)[:600]}', flush=True)
    timed = padded[args.warmup:]
    flops = sum(bench.flops_per_step(cfg, s.size(0), s.size(1), t.size(1), len(r)) for s, t, r, _ in timed)
    times, mem = {name: [] for name in runs}, {name: 0.0 for name in runs}
    for r in range(args.rounds):  # the order rotates
        names = list(runs)
        for name in names[r % len(names):] + names[:r % len(names)]:
            torch.cuda.reset_peak_memory_stats() if dev.type == 'cuda' else None
            try:
                times[name].append(bench.timed(lambda: runs[name](kinds[name][args.warmup:]), dev)[1])
            except torch.OutOfMemoryError as e:
                print(f'{tokens}: {name}: out of memory: {str(e)[:300]}', flush=True)
            if dev.type == 'cuda':  # graphs' pools stay allocated: this counts the others' too
                mem[name] = max(mem[name], torch.cuda.max_memory_allocated() / 2 ** 30)
    peak = bench.PEAKS['h100']['bfloat16']  # the H200's too
    print(f'{bench.device_name(dev)}, torch {torch.__version__}; {args.config}, {tokens} tokens, '
          f'max_len bound {max_len}, {args.rounds} rounds of {args.steps} steps; '
          f'MFU against {peak / 1e12:.0f} TFLOP/s')
    base = statistics.median(times[next(iter(times))]) if times and next(iter(times.values())) else 1.0
    for name, ts in [(n, ts) for n, ts in times.items() if ts]:
        median, each = statistics.median(ts), ', '.join(f'{1e3 * t / args.steps:.1f}' for t in ts)
        print(f'{tokens} {name:<12} {1e3 * median / args.steps:6.1f} ms/step (rounds {each}), '
              f'MFU {flops / median / peak:.1%}, speed-up {base / median:.3f}, peak {mem[name]:.1f} GiB',
              flush=True)
    if args.profile and dev.type == 'cuda' and runs:
        name = min((n for n in runs if times[n]), key=lambda n: statistics.median(times[n]))  # the fastest
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            runs[name](kinds[name][args.warmup:args.warmup + 4])
        print(f'profile: {name}, 4 steps')
        print(prof.key_averages().table(sort_by='self_device_time_total', row_limit=25,
                                        max_name_column_width=90))
    del runs, kinds
    torch.cuda.empty_cache() if dev.type == 'cuda' else None
