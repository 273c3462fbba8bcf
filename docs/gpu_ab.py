"""
The GPU A/B and profile behind docs/performance.md, "GPU (H200)": model.py's training step as bench.py's
compiled row runs it (layers compiled with dynamic shapes, the loss's chunks compiled, bf16, fused Adam) on
bench.py's synthetic WMT-like batches, this checkout's model.py against another version of it in the same
process, the rounds alternating; medians with MFU. --profile: then where this version's GPU time goes.
    git show e1c7854:model.py > .gpu_data/model_old.py     # an ignored folder that the device call carries
    python3 docs/gpu_ab.py --old .gpu_data/model_old.py --profile [--config base --batch-tokens 25000]
Without --old it times and profiles this version alone. Measurements, not a test: one process on the GPU.
"""
import argparse
import importlib.util
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import model as M  # noqa: E402

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument('--old', help="another version's model.py")
p.add_argument('--config', default='base', choices=[*M.PRESETS, *bench.CONFIGS])
p.add_argument('--batch-tokens', type=int, default=25000)
p.add_argument('--warmup', type=int, default=20)
p.add_argument('--steps', type=int, default=10, help='per round')
p.add_argument('--rounds', type=int, default=3)
p.add_argument('--profile', action='store_true')
args = p.parse_args()
torch.set_float32_matmul_precision('high')
torch.backends.cuda.enable_cudnn_sdp(False)  # as the scripts (docs/performance.md, GPU (H100))
dev = torch.device('cuda' if torch.cuda.is_available() else 'cpu')  # cpu: only a check that this runs
cfg = M.Config(**{**bench.CONFIGS, **M.PRESETS}[args.config])
n = args.warmup + args.steps
data = bench.synthetic_split(n * args.batch_tokens // 12 + 64, cfg.vocab_size)
batches = bench.make_batches(data, cfg, args.batch_tokens, n, dev)
batches.sort(key=lambda b: b[0].size(1) == b[1].size(1))  # as bench.py: S == T would recompile


def load(path):
    spec = importlib.util.spec_from_file_location('model_old', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trainer(lib):
    """-> steps(batches): lib's model trained as bench.py's compiled row."""
    torch.manual_seed(0)
    model = lib.Transformer(cfg).to(dev).train()
    for layer in [*model.encoder, *model.decoder]:
        layer.compile(dynamic=True)
    chunk_fn = torch.compile(lib.loss_chunk, dynamic=True)
    opt = torch.optim.Adam(model.parameters(), 1e-4, (0.9, 0.98), 1e-9, fused=dev.type == 'cuda')

    def steps(bs):
        for src, tgt_in, rows, targets in bs:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == 'cuda'):
                loss, _ = lib.label_smoothed_loss(model(src, tgt_in, rows), model.embed.weight, targets, 0.1,
                                                  chunk_fn)
            (loss / len(rows)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return steps


versions = {'this': trainer(M)} | ({'old': trainer(load(args.old))} if args.old else {})
for name, steps in versions.items():
    seconds = bench.timed(lambda: steps(batches[:args.warmup]), dev)[1]
    print(f'{name}: {args.warmup} warm-up steps (compilation) in {seconds:.1f} s')
timed = batches[args.warmup:]
flops = sum(bench.flops_per_step(cfg, s.size(0), s.size(1), t.size(1), len(r)) for s, t, r, _ in timed)
times = {name: [] for name in versions}
for r in range(args.rounds):  # which version goes first alternates
    for name, steps in list(versions.items())[::-1 if r % 2 else 1]:
        times[name].append(bench.timed(lambda: steps(timed), dev)[1])
peak = bench.PEAKS['h100']['bfloat16']  # the H200's too
print(f'{bench.device_name(dev)}, torch {torch.__version__}; {args.config}, {args.batch_tokens} tokens, '
      f'{args.rounds} rounds of {args.steps} steps; MFU against {peak / 1e12:.0f} TFLOP/s')
for name, ts in times.items():
    median, each = statistics.median(ts), ', '.join(f'{1e3 * t / args.steps:.1f}' for t in ts)
    print(f'{name:<5} {1e3 * median / args.steps:6.1f} ms/step (rounds {each}), '
          f'MFU {flops / median / peak:.1%}')
if args.old:
    print(f"old/this: {statistics.median(times['old']) / statistics.median(times['this']):.3f}")
if args.profile and dev.type == 'cuda':
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        versions['this'](timed[:4])
    print(prof.key_averages().table(sort_by='self_device_time_total', row_limit=30, max_name_column_width=90))
