"""
The one prepared GPU check (docs/performance.md, "Running the GPU check"): bench.py for base and big, eager
and compiled, at 25000 and 4096 tokens; 300 compiled steps of config/wmt_base.py on prepared data;
translate.py beam and greedy on its test set; test_gpu.py. Each stage has a time limit within one deadline;
OUT_DIR gets report.json, summary.txt (both rewritten after every stage) and a log per kind of stage.
    python gpu_check.py OUT_DIR DATA_DIR          # on a lent GPU, in one call of at most 7 minutes
    python gpu_check.py OUT_DIR DATA_DIR --tiny   # the same stages, tiny, on the CPU (test_gpu.py runs it)
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

HERE = os.path.dirname(os.path.abspath(__file__))
# Seconds per stage, each cut to what is left of the deadline (the call's 420 s less a margin), from an H200
# call (docs/performance.md). The order: the first bench run, bench on DATA_DIR (train.py's yardstick), train,
# translate, tests, the other bench runs; what the deadline leaves out is skipped, for a call with --stages.
GPU = dict(limits=dict(tests=180, bench=90, train=180, translate=40), deadline=400, steps=300, log=50,
           bench=[('base', 25000), ('base', 4096), ('big', 25000), ('big', 4096)],
           bench_args='--device cuda --compile on --dtype bfloat16 --warmup 30 --steps 10',
           train=dict(max_tokens=25000, compile=True, device='cuda'), translate='--device cuda',
           env=dict(PYTHONUNBUFFERED='1'))
# bench.py's tiny model and batch, trained as such. One thread each (as test_train.py): with two on a 2-core
# machine that another process also uses, tiny steps took 1.5 s instead of 10 ms.
TINY = dict(limits=dict(tests=60, bench=60, train=60, translate=60), deadline=170, steps=12, log=4,
            bench=[('tiny', 256), ('tiny', 128)], bench_args='--device cpu --compile off --dtype float32 '
            '--warmup 1 --steps 2 --decode-sents 4 --decode-len 4', translate='--device cpu --max-len-b 8',
            train=dict(max_tokens=256, compile=False, device='cpu', dtype='float32', n_enc_layers=2,
                       n_dec_layers=2, d_model=64, d_ff=128, n_heads=4),
            env=dict(PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1'))
ROW = 'impl mode dtype step_ms tgt_tokens_per_s mfu of_gemm warmup_s'.split()  # of bench.py's training rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('out_dir'), p.add_argument('data_dir')
    p.add_argument('--tiny', action='store_true', help='tiny models on the CPU: a test that the check runs')
    p.add_argument('--stages', default='bench,train,translate,tests', help='a comma-separated subset')
    p.add_argument('--deadline', type=float, help='seconds for all stages (default 400; tiny 170)')
    args = p.parse_args()
    mode, start, py, data = TINY if args.tiny else GPU, time.time(), sys.executable, args.data_dir
    mode['deadline'] = args.deadline or mode['deadline']
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(data, 'meta.json'), encoding='utf-8') as f:
        meta = json.load(f)  # its languages: a custom corpus need not be en-de
    report = dict(mode='tiny' if args.tiny else 'gpu', data_dir=data, stages=[],
                  data={k: meta.get(k) for k in ('name', 'src', 'tgt', 'vocab_size', 'splits')},
                  note="vs_bench: train.py against bench.py's compiled row on the same data and batch size "
                       "('bench data'); MFU: the synthetic WMT-like rows, at WMT's vocabulary of 37000")

    def run(name, kind, cmd, numbers, **env):
        """cmd in a process group of its own, killed whole at its limit (compile workers, torchrun's ranks);
        numbers(stdout, stderr) -> the stage's figures, which an 'ok' stage must have."""
        if kind not in args.stages.split(','):
            return
        stage, out, err = dict(name=name, status='skipped', seconds=0.0, cmd=' '.join(cmd[1:])), '', ''
        report['stages'].append(stage)
        limit = min(mode['limits'][kind], start + mode['deadline'] - time.time())
        if limit < 10:
            stage['error'] = 'no time left before the deadline'
        else:
            with tempfile.TemporaryFile('w+') as fo, tempfile.TemporaryFile('w+') as fe:
                t, proc = time.time(), subprocess.Popen(cmd, cwd=HERE, stdout=fo, stderr=fe,
                                                        env={**os.environ, **mode['env'], **env},
                                                        start_new_session=True)
                try:
                    rc = proc.wait(timeout=limit)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # not yet waited for: its group still exists
                    rc = f'{proc.wait()}, timed out at {limit:.0f} s'
                stage.update(status='ok' if rc == 0 else f'exit status {rc}', seconds=round(time.time() - t))
                out, err = (f.seek(0) or f.read() for f in (fo, fe))  # seek() returns 0
            with open(os.path.join(args.out_dir, f'{kind}.log'), 'a', encoding='utf-8') as log:
                log.write(f"=== {name}: {stage['status']}, {stage['seconds']} s\n$ {' '.join(cmd)}\n"
                          f"--- stdout\n{out}\n--- stderr\n{err}\n")
            if rc != 0:
                stage['error'] = (err.strip() or out.strip() or '-').splitlines()[-1][-300:]
        try:
            stage.update(numbers(out, err))
        except Exception as e:  # noqa: BLE001 (whatever is missing, the report is written)
            if stage['status'] == 'ok':
                stage.update(status='failed', error=f'its output: {type(e).__name__}: {e}')
        write(args.out_dir, report, start)

    benches = [(f'bench {c} {n}', 'bench', [py, 'bench.py', '--config', c, '--batch-tokens', str(n), '--json',
                                            *mode['bench_args'].split()], bench_numbers)
               for c, n in mode['bench']]
    run(*benches[0])
    # train.py's yardstick: bench.py on the same data, model and batch size (train.py's first batches)
    cfg, n = mode['bench'][0][0], mode['train']['max_tokens']
    run(f'bench data {n}', 'bench', [py, 'bench.py', '--data', data, '--config', cfg, '--batch-tokens',
                                     str(n), '--json', *mode['bench_args'].split()],
        bench_numbers)
    with tempfile.TemporaryDirectory() as tmp:  # the run's checkpoints: hundreds of MB at base size
        run_dir = os.path.join(tmp, 'run')
        settings = dict(data_dir=data, out_dir=run_dir, max_steps=mode['steps'], log_interval=mode['log'],
                        eval_interval=0, bleu_interval=-1, save_interval=0, save_minutes=0.0, **mode['train'])
        run('train wmt_base', 'train', [py, 'train.py', 'config/wmt_base.py', *(f'--{k}={v}' for k, v in
                                                                                 settings.items())],
            lambda out, err: train_numbers(run_dir, out, err, report, mode['train']['compile']),
            TORCH_LOGS='recompiles')  # each recompilation says so, and why, on stderr
        src, ref = (os.path.join(data, f"test.{meta[k]}.txt") for k in ('src', 'tgt'))
        for search, flags in [('beam', []), ('greedy', ['--greedy'])]:
            run(f'translate {search}', 'translate',
                [py, 'translate.py', '--ckpt', os.path.join(run_dir, 'ckpt.pt'), '--input', src, '--ref', ref,
                 '--output', os.path.join(tmp, 'hyp.txt'), *mode['translate'].split(), *flags],
                lambda _, err: dict(sents_per_s=float(re.search(r'([\d.]+) sentences/s', err)[1]),
                                    bleu=float(re.search(r'sacreBLEU: BLEU = ([\d.]+)', err)[1])))
    run('test_gpu.py', 'tests', [py, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'test_gpu.py', '-k',
                                 'not tiny_mode'],  # the tiny-mode test would run this check again
        lambda out, _: tests_numbers(out, args.tiny))
    for b in benches[1:]:
        run(*b)
    sys.exit(0 if all(s['status'] == 'ok' for s in report['stages']) else 1)


def bench_numbers(out, _):  # its training rows; the decoding rows are on random weights (bench.log has them)
    r = json.loads(out.splitlines()[-1])
    return dict(device_name=r['device_name'], torch=r['torch'], peak_source=r['peak_source'],
                vocab_size=r['model_cfg']['vocab_size'], rows=[{k: t[k] for k in ROW} for t in r['train']])


def tests_numbers(out, tiny):
    counts = {k: int(n) for n, k in re.findall(r'(\d+) (\w+)', out.splitlines()[-1])}
    if not tiny and 'skipped' in counts:  # only where torch sees no GPU: a GPU check that checked nothing
        raise ValueError(f"{counts['skipped']} skipped")
    return dict(counts=counts, failures=re.findall(r'^(?:FAILED|ERROR) (\S+)', out, re.M))


def train_numbers(run_dir, out, err, report, compiled):
    with open(os.path.join(run_dir, 'log.jsonl'), encoding='utf-8') as f:
        logs = [r for r in map(json.loads, f) if 'tok_per_s' in r]
    first, last = logs[0], logs[-1]  # the first window holds the compilation: steps/s after it
    steps_per_s = (last['step'] - first['step']) / ((last['elapsed_min'] - first['elapsed_min']) * 60)
    n = dict(steps=last['step'], steps_per_s=steps_per_s, first_window_s=first['elapsed_min'] * 60,
             tgt_tok_per_s=[round(r['tok_per_s']) for r in logs], vocab_size=report['data']['vocab_size'],
             params=re.search(r'model: ([\d.]+M) parameters', out)[1], recompiles=err.count('Recompiling'),
             eager_fallback=bool(re.search(r'recompile_limit|cache_size_limit', err)))
    benches = [s for s in report['stages'] if s['name'].startswith('bench') and 'rows' in s]
    bench = next((s for s in benches if s['name'].startswith('bench data')), benches[0] if benches else None)
    if bench:  # its model.py row in train.py's mode: bench.py on the same data, else the first bench run
        mode = 'compile' if compiled else 'eager'
        row = next(r for r in bench['rows'] if r['impl'] == 'ours' and r['mode'] == mode)
        n.update(bench_row=f"{bench['name']} {row['mode']}", bench_steps_per_s=1e3 / row['step_ms'],
                 vs_bench=steps_per_s * row['step_ms'] / 1e3)
    return n


def write(out_dir, report, start):
    report['total_s'] = round(time.time() - start, 1)
    with open(os.path.join(out_dir, 'report.json'), 'w', encoding='utf-8') as f:
        json.dump(report, f, indent=1)
    lines = [f"{report['mode']} check of {report['data_dir']}: {report['total_s']} s in all", report['note']]
    for s in report['stages']:
        lines.append(f"{s['name']:<16} {s['status']:<10} {s['seconds']:>6.1f} s  " + ', '.join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()
            if k not in ('name', 'status', 'seconds', 'cmd', 'rows')))
        lines += [f"    {r['impl']:<21}{r['mode']:<8}{r['dtype']:<9}{r['step_ms']:>8.1f} ms {r['mfu']:>6.1%} "
                  f"MFU {r['tgt_tokens_per_s']:>9.0f} tgt tok/s" for r in s.get('rows', [])]
    with open(os.path.join(out_dir, 'summary.txt'), 'w', encoding='utf-8') as f:
        f.write('\n'.join(lines) + '\n')


if __name__ == '__main__':
    main()
