"""
A 7-minute check of a GPU machine (docs/performance.md, "A 7-minute check of a GPU machine"):
bench.py for base and big, eager and compiled, at 25000 and 4096 tokens; 300 compiled steps of
config/wmt_base.py on prepared data; translate.py beam and greedy on its test set; dev/test_gpu.py.
Each stage has a time limit within one deadline; OUT_DIR gets report.json, summary.txt (both
rewritten after every stage) and a log per kind of stage.
    python dev/gpu_check.py OUT_DIR DATA_DIR          # on a GPU machine, at most 7 minutes
    python dev/gpu_check.py OUT_DIR DATA_DIR --tiny   # the stages, tiny, on the CPU (one bench run)
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

# The stages run the root's scripts from the root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds per stage, each cut to what is left of the deadline (7 minutes less a margin), as
# measured on an H200 (docs/performance.md). The order: the first bench run, bench on DATA_DIR
# (train.py's yardstick), train, translate, tests, the other bench runs; what the deadline leaves
# out is skipped, for a second run with --stages.
GPU = dict(
    limits=dict(tests=180, bench=90, train=180, translate=40),
    deadline=400,
    steps=300,
    log=50,
    bench=[('base', 25000), ('base', 4096), ('big', 25000), ('big', 4096)],
    bench_args='--device cuda --compile on --dtype bfloat16 --warmup 30 --steps 10',
    train=dict(max_tokens=25000, compile=True, device='cuda'),
    translate='--device cuda',
    env=dict(PYTHONUNBUFFERED='1'),
)
# bench.py's tiny model and batch, trained as such. One thread each (as test_train.py): with two on
# a 2-core machine that another process also uses, tiny steps took 1.5 s instead of 10 ms. One
# synthetic bench run: each bench process costs seconds of imports, and a second one would only
# repeat the first after the tests.
TINY = dict(
    limits=dict(tests=60, bench=60, train=60, translate=60),
    deadline=170,
    steps=12,
    log=4,
    bench=[('tiny', 256)],
    bench_args='--device cpu --compile off --dtype float32 --warmup 1 --steps 2 '
               '--decode-sents 4 --decode-len 4',
    train=dict(max_tokens=256, compile=False, device='cpu', dtype='float32', n_enc_layers=2,
               n_dec_layers=2, d_model=64, d_ff=128, n_heads=4),
    translate='--device cpu --max-len-b 8',
    env=dict(PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1'),
)
# Of bench.py's training rows.
ROW = 'impl mode dtype step_ms tgt_tokens_per_s mfu of_gemm warmup_s'.split()
NOTE = ("vs_bench: train.py against bench.py's compiled row on the same data and batch size "
        "('bench data'); MFU: the synthetic WMT-like rows, at WMT's vocabulary of 37000")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('out_dir')
    p.add_argument('data_dir')
    p.add_argument('--tiny', action='store_true',
                   help='tiny models on the CPU: a test that the check runs')
    p.add_argument('--stages', default='bench,train,translate,tests',
                   help='a comma-separated subset')
    p.add_argument('--deadline', type=float, help='seconds for all stages (default 400; tiny 170)')
    args = p.parse_args()
    mode = TINY if args.tiny else GPU
    if args.deadline:
        mode['deadline'] = args.deadline
    start = time.time()
    py = sys.executable
    data = os.path.abspath(args.data_dir)  # the stages run from the root
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(data, 'meta.json'), encoding='utf-8') as f:
        meta = json.load(f)  # its languages: a custom corpus need not be en-de
    report = dict(
        mode='tiny' if args.tiny else 'gpu',
        data_dir=args.data_dir,
        stages=[],
        data={k: meta.get(k) for k in ('name', 'src', 'tgt', 'vocab_size', 'splits')},
        note=NOTE,
    )

    def run(name, kind, cmd, numbers, **env):
        """numbers(stdout, stderr) -> the stage's figures, which an 'ok' stage must have."""
        if kind not in args.stages.split(','):
            return
        stage = dict(name=name, status='skipped', seconds=0.0, cmd=' '.join(cmd[1:]))
        report['stages'].append(stage)
        out = err = ''
        limit = min(mode['limits'][kind], start + mode['deadline'] - time.time())
        if limit < 10:
            stage['error'] = 'no time left before the deadline'
        else:
            rc, seconds, out, err = run_process(cmd, limit, {**os.environ, **mode['env'], **env})
            stage['status'] = 'ok' if rc == 0 else f'exit status {rc}'
            stage['seconds'] = seconds
            append_log(args.out_dir, kind, stage, cmd, out, err)
            if rc != 0:
                last_line = (err.strip() or out.strip() or '-').splitlines()[-1]
                stage['error'] = last_line[-300:]
        try:
            stage.update(numbers(out, err))
        except Exception as e:  # noqa: BLE001 (whatever is missing, the report is written)
            if stage['status'] == 'ok':
                stage['status'] = 'failed'
                stage['error'] = f'its output: {type(e).__name__}: {e}'
        write(args.out_dir, report, start)

    bench_args = mode['bench_args'].split()
    benches = []
    for cfg, n in mode['bench']:
        cmd = [py, 'bench.py', '--config', cfg, '--batch-tokens', str(n), '--json', *bench_args]
        benches.append((f'bench {cfg} {n}', 'bench', cmd, bench_numbers))
    run(*benches[0])
    # train.py's yardstick: bench.py on the same data, model and batch size (its first batches)
    cfg = mode['bench'][0][0]
    n = mode['train']['max_tokens']
    cmd = [py, 'bench.py', '--data', data, '--config', cfg, '--batch-tokens', str(n), '--json',
           *bench_args]
    run(f'bench data {n}', 'bench', cmd, bench_numbers)
    with tempfile.TemporaryDirectory() as tmp:  # the run's checkpoints: hundreds of MB at base size
        run_dir = os.path.join(tmp, 'run')
        settings = dict(data_dir=data, out_dir=run_dir, max_steps=mode['steps'],
                        log_interval=mode['log'], eval_interval=0, bleu_interval=-1,
                        save_interval=0, save_minutes=0.0, **mode['train'])
        flags = [f'--{k}={v}' for k, v in settings.items()]
        cmd = [py, 'train.py', 'config/wmt_base.py', *flags]

        def numbers(out, err):
            return train_numbers(run_dir, out, err, report, mode['train']['compile'])
        # each recompilation says so, and why, on stderr
        run('train wmt_base', 'train', cmd, numbers, TORCH_LOGS='recompiles')
        src = os.path.join(data, f"test.{meta['src']}.txt")
        ref = os.path.join(data, f"test.{meta['tgt']}.txt")
        ckpt = os.path.join(run_dir, 'ckpt.pt')
        hyp = os.path.join(tmp, 'hyp.txt')
        for search, flags in [('beam', []), ('greedy', ['--greedy'])]:
            files = ['--ckpt', ckpt, '--input', src, '--ref', ref, '--output', hyp]
            cmd = [py, 'translate.py', *files, *mode['translate'].split(), *flags]
            run(f'translate {search}', 'translate', cmd, translate_numbers)
    # not the tiny-mode test: it would run this check again
    cmd = [py, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'dev/test_gpu.py',
           '-k', 'not tiny_mode']
    run('test_gpu.py', 'tests', cmd, lambda out, _: tests_numbers(out, args.tiny))
    for b in benches[1:]:
        run(*b)
    all_ok = all(s['status'] == 'ok' for s in report['stages'])
    sys.exit(0 if all_ok else 1)


def run_process(cmd, limit, env):
    """cmd from the root, in a process group of its own, killed whole at its limit (compile workers,
    torchrun's ranks) -> (exit status, or it and the time out; seconds; stdout; stderr)."""
    with tempfile.TemporaryFile('w+') as fo, tempfile.TemporaryFile('w+') as fe:
        t = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fo, stderr=fe, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # not yet waited for: its group still exists
            rc = f'{proc.wait()}, timed out at {limit:.0f} s'
        seconds = round(time.time() - t)
        fo.seek(0)
        fe.seek(0)
        return rc, seconds, fo.read(), fe.read()


def append_log(out_dir, kind, stage, cmd, out, err):
    with open(os.path.join(out_dir, f'{kind}.log'), 'a', encoding='utf-8') as log:
        log.write(f"=== {stage['name']}: {stage['status']}, {stage['seconds']} s\n")
        log.write(f"$ {' '.join(cmd)}\n")
        log.write(f"--- stdout\n{out}\n--- stderr\n{err}\n")


def bench_numbers(out, _):
    # its training rows; the decoding rows are on random weights (bench.log has them)
    r = json.loads(out.splitlines()[-1])
    rows = [{k: t[k] for k in ROW} for t in r['train']]
    return dict(device_name=r['device_name'], torch=r['torch'], peak_source=r['peak_source'],
                vocab_size=r['model_cfg']['vocab_size'], rows=rows)


def translate_numbers(_, err):
    sents_per_s = re.search(r'([\d.]+) sentences/s', err)[1]
    bleu = re.search(r'sacreBLEU: BLEU = ([\d.]+)', err)[1]
    return dict(sents_per_s=float(sents_per_s), bleu=float(bleu))


def tests_numbers(out, tiny):
    counts = {k: int(n) for n, k in re.findall(r'(\d+) (\w+)', out.splitlines()[-1])}
    # only where torch sees no GPU: a GPU check that checked nothing
    if not tiny and 'skipped' in counts:
        raise ValueError(f"{counts['skipped']} skipped")
    return dict(counts=counts, failures=re.findall(r'^(?:FAILED|ERROR) (\S+)', out, re.M))


def train_numbers(run_dir, out, err, report, compiled):
    with open(os.path.join(run_dir, 'log.jsonl'), encoding='utf-8') as f:
        logs = [r for r in map(json.loads, f) if 'tok_per_s' in r]
    first, last = logs[0], logs[-1]  # the first window holds the compilation: steps/s after it
    seconds = (last['elapsed_min'] - first['elapsed_min']) * 60
    steps_per_s = (last['step'] - first['step']) / seconds
    n = dict(
        steps=last['step'],
        steps_per_s=steps_per_s,
        first_window_s=first['elapsed_min'] * 60,
        tgt_tok_per_s=[round(r['tok_per_s']) for r in logs],
        vocab_size=report['data']['vocab_size'],
        params=re.search(r'model: ([\d.]+M) parameters', out)[1],
        recompiles=err.count('Recompiling'),
        eager_fallback=bool(re.search(r'recompile_limit|cache_size_limit', err)),
    )
    # its model.py row in train.py's mode: bench.py on the same data, else the first bench run
    benches = [s for s in report['stages'] if s['name'].startswith('bench') and 'rows' in s]
    on_data = [s for s in benches if s['name'].startswith('bench data')]
    if on_data:
        bench = on_data[0]
    elif benches:
        bench = benches[0]
    else:
        return n
    mode = 'compile' if compiled else 'eager'
    row = next(r for r in bench['rows'] if r['impl'] == 'ours' and r['mode'] == mode)
    n['bench_row'] = f"{bench['name']} {row['mode']}"
    n['bench_steps_per_s'] = 1e3 / row['step_ms']
    n['vs_bench'] = steps_per_s * row['step_ms'] / 1e3
    return n


def write(out_dir, report, start):
    report['total_s'] = round(time.time() - start, 1)
    with open(os.path.join(out_dir, 'report.json'), 'w', encoding='utf-8') as f:
        json.dump(report, f, indent=1)
    title = f"{report['mode']} check of {report['data_dir']}: {report['total_s']} s in all"
    lines = [title, report['note']]
    for s in report['stages']:
        figures = []
        for k, v in s.items():
            if k in ('name', 'status', 'seconds', 'cmd', 'rows'):
                continue
            if isinstance(v, float):
                figures.append(f'{k} {v:.4g}')
            else:
                figures.append(f'{k} {v}')
        head = f"{s['name']:<16} {s['status']:<10} {s['seconds']:>6.1f} s  "
        lines.append(head + ', '.join(figures))
        for r in s.get('rows', []):
            lines.append(f"    {r['impl']:<21}{r['mode']:<8}{r['dtype']:<9}{r['step_ms']:>8.1f} ms "
                         f"{r['mfu']:>6.1%} MFU {r['tgt_tokens_per_s']:>9.0f} tgt tok/s")
    with open(os.path.join(out_dir, 'summary.txt'), 'w', encoding='utf-8') as f:
        f.write('\n'.join(lines) + '\n')


if __name__ == '__main__':
    main()
