import ast
import contextlib
import dataclasses
import importlib.util
import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import bench
import dataset
import model as M
import speed
from test_translate import reverse

TINY = ['--config', 'tiny', '--compile', 'off', '--warmup', '1', '--steps', '2',
        '--batch-tokens', '256', '--decode-sents', '4', '--json']
CT2 = importlib.util.find_spec('ctranslate2') is not None
# Not model.Config's ids: bench.py takes them from meta.json
IDS = dict(vocab_size=503, pad_id=500, bos_id=501, eos_id=502)


def count(model):
    return sum(p.numel() for p in model.parameters())


def write_prepared(folder):
    """bench.synthetic_split written out as data_prep.py writes a prepared folder."""
    data = bench.synthetic_split(300, 500)
    for lang, tok, idx in (('de', *data[:2]), ('en', *data[2:])):
        tok.astype(np.uint16).tofile(folder / f'train.{lang}.bin')
        idx.tofile(folder / f'train.{lang}.idx')
    meta = dict(src='de', tgt='en', dtype='uint16', **IDS)
    (folder / 'meta.json').write_text(json.dumps(meta))
    return str(folder), data


@pytest.fixture
def prepared(tmp_path):
    return write_prepared(tmp_path)


def start_early(request, names):
    """bench.py's tiny run on a prepared folder, with its profile, in both dtypes (bf16 where
    native: emulated takes minutes), on one thread at the lowest priority -> {test name: (its
    process, (the dtypes, the folder of its stdout.txt and stderr.txt))}."""
    name = 'test_a_tiny_run_prints_one_json_record_and_its_profile_on_stderr'
    if name not in names:
        return {}
    fast = speed.fast_dtype('cpu')
    dtypes = ['float32']
    if fast != 'float32':
        dtypes.append(fast)
    made = request.getfixturevalue('tmp_path_factory').mktemp
    folder, _ = write_prepared(made('prepared'))
    outputs = made('tiny_run')  # files: a pipe nobody reads yet could fill
    argv = [*TINY, '--profile', '--data', folder, '--dtype', *dtypes]
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    with open(outputs / 'stdout.txt', 'w') as out, open(outputs / 'stderr.txt', 'w') as err:
        process = subprocess.Popen([sys.executable, 'bench.py', *argv], cwd=bench.HERE, text=True,
                                   stdout=out, stderr=err, env=env,
                                   preexec_fn=lambda: os.nice(19))  # in the time others leave
    return {name: (process, (dtypes, outputs))}


def test_flops_hand_count():
    # d=8, d_ff=16, V=10, one layer each; B=2 sentences, source padded to S=3, decoder input to T=4.
    # Every matmul (m x k) @ (k x n) costs 2*m*k*n; B*S = 6 source and B*T = 8 target positions.
    enc = (2 * 6 * 8 * 24 + 2 * 6 * 8 * 8      # QKV, output projection
           + 2 * 6 * 8 * 16 + 2 * 6 * 16 * 8   # FFN in and out
           + 2 * 2 * 3 * 8 * 3 + 2 * 2 * 3 * 3 * 8)  # Q K^T, attn @ V
    dec = (2 * 8 * 8 * 24 + 2 * 8 * 8 * 8 + 2 * 8 * 8 * 16 + 2 * 8 * 16 * 8  # self-attention, FFN
           + 2 * 2 * 4 * 8 * 4 + 2 * 2 * 4 * 4 * 8   # self-attention scores, values (full 4x4)
           + 2 * 8 * 8 * 8 + 2 * 8 * 8 * 8           # cross Q and output projection over T
           + 2 * 6 * 8 * 16                          # cross K, V over the 6 source positions
           + 2 * 2 * 4 * 8 * 3 + 2 * 2 * 4 * 3 * 8)  # cross scores, values (4x3)
    assert (enc, dec) == (6720, 13568)
    cfg = M.Config(vocab_size=10, n_enc_layers=1, n_dec_layers=1, d_model=8, d_ff=16, n_heads=2)
    assert bench.flops_per_step(cfg, B=2, S=3, T=4) == 3 * (enc + dec + 2 * 8 * 8 * 10) == 64704
    # train.py projects only the real target tokens onto the vocabulary: 5 of the 8 positions here
    assert bench.flops_per_step(cfg, B=2, S=3, T=4, tokens=5) == 3 * (enc + dec + 2 * 5 * 8 * 10)


@pytest.mark.filterwarnings('ignore:enable_nested_tensor')  # the built-in's pre-norm notice
@pytest.mark.parametrize('cls', [M.Transformer, bench.Builtin])
def test_flops_and_size_match_torch_for_ours_and_the_builtin(cls):
    # PyTorch's FlopCounterMode over a real forward + backward, with the math attention kernel,
    # which it sees (the fused CPU one it does not); its backward is exactly 2x forward, like the
    # formula.
    torch.manual_seed(0)
    cfg = M.Config(vocab_size=50, n_enc_layers=2, n_dec_layers=1, d_model=16, d_ff=24, n_heads=4,
                   dropout=0.0)
    model = cls(cfg).train()  # train(): torch.nn.Transformer's inference fast path hides matmuls
    src = torch.tensor([[5, 6, 7, 8, 2], [5, 6, 2, 0, 0], [9, 2, 0, 0, 0]])
    tgt = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 5, 6, 0, 0, 0], [1, 4, 0, 0, 0, 0]])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(src, tgt).sum().backward()
    assert counter.get_total_flops() == bench.flops_per_step(cfg, 3, 5, 6)
    for c in (cfg, M.Config(**bench.CONFIGS['tiny'], pre_norm=True)):
        assert count(cls(c)) == count(M.Transformer(c))


def test_synthetic_pairs_load_as_a_split_and_batch_as_training_does(prepared):
    folder, data = prepared
    for ours, loaded in zip(data, dataset.load_split(folder, 'train')):
        np.testing.assert_array_equal(ours, loaded)
    cfg = M.Config(**{**bench.CONFIGS['tiny'], **IDS})
    batches = bench.make_batches(data, cfg, 512, 5, 'cpu')
    assert len(batches) == 5
    for src, tgt_in, rows, targets in batches:  # targets: the real tokens alone, at their rows
        assert src.numel() <= 512 and tgt_in.numel() <= 512 and (targets != cfg.pad_id).all()
        assert (src == cfg.eos_id).sum() == len(src) and (tgt_in[:, 0] == cfg.bos_id).all()
        tgt_out = torch.full_like(tgt_in, cfg.pad_id).flatten()
        tgt_out = tgt_out.index_put((rows,), targets).view_as(tgt_in)
        shifted = tgt_out[:, :-1]  # the decoder input is the target shifted right, BOS in front
        assert torch.equal(tgt_in[:, 1:], shifted.masked_fill(shifted == cfg.eos_id, cfg.pad_id))


def test_batches_go_on_into_the_next_epoch_when_one_is_short(prepared):
    # Multi30k makes 20 batches of 25000 tokens: bench.py --data at that size once timed none.
    folder, data = prepared
    cfg = M.Config(**{**bench.CONFIGS['tiny'], **IDS})
    n = len(dataset.batch_plan(data, 512, 0, 0))
    batches = bench.make_batches(data, cfg, 512, n + 2, 'cpu')
    second = dataset.batch_plan(data, 512, 0, 1)[:2]
    assert len(batches) == n + 2 and [len(b[0]) for b in batches[n:]] == list(map(len, second))
    # train.py's batch order is its seed's
    seeded = bench.make_batches(data, cfg, 512, 2, 'cpu', seed=7)
    assert [len(b[0]) for b in seeded] == list(map(len, dataset.batch_plan(data, 512, 7, 0)[:2]))


@pytest.mark.started_early
def test_a_tiny_run_prints_one_json_record_and_its_profile_on_stderr(started_early):
    # On a data folder: its vocabulary and ids, and both dtypes. Synthetic batches run in
    # dev/test_gpu.py's CPU test of gpu_check.py.
    process, (dtypes, outputs) = started_early[
        'test_a_tiny_run_prints_one_json_record_and_its_profile_on_stderr']
    process.wait(timeout=300)
    res = subprocess.CompletedProcess(process.args, process.returncode,
                                      (outputs / 'stdout.txt').read_text(),
                                      (outputs / 'stderr.txt').read_text())
    assert res.returncode == 0, res.stderr[-3000:]  # a smoke test
    r = json.loads(res.stdout)
    assert 'aten::mm' in res.stderr and 'Self CPU time total' in res.stderr
    assert [(t['impl'], t['mode'], t['dtype']) for t in r['train']] == [
        (impl, 'eager', d) for d in dtypes for impl in ('ours', 'torch.nn.Transformer')]
    for t in r['train']:
        assert min(t['step_ms'], t['flops_per_s'], t['mfu'], t['of_gemm']) > 0
        assert t['tokens_per_s'] > t['tgt_tokens_per_s'] > 0
    both = set()
    if len(dtypes) == 2:
        both = {'bfloat16/float32 eager'}
    assert set(r['ratios']) == {f'ours/built-in {d}' for d in dtypes} | both
    rows = [('greedy', 'model.py'), ('beam 4', 'model.py')]
    if CT2:
        rows += [(s, f'CT2 {q}') for q in ('float32', 'int8') for s in ('greedy', 'beam 4')]
    assert [(d['search'], d['impl']) for d in r['decode']] == rows
    assert all(d['sents_per_s'] > 0 for d in r['decode'])
    cfg = M.Config(**{**bench.CONFIGS['tiny'], **IDS, 'vocab_size': 504})  # as train.py rounds it
    assert r['model_cfg'] == dataclasses.asdict(cfg) and r['params'] == count(M.Transformer(cfg))


def first_in_a_process(run_script):
    """bench.run_script that runs the first script as bench.py does, a process, and the others
    (export_ct2.py, translate.py) in this one: each process would cost a second of imports."""
    calls = []

    def run(name, *args):
        calls.append(name)
        if len(calls) == 1:
            return run_script(name, *args)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            importlib.import_module(name.removesuffix('.py')).main(list(args))
        return err.getvalue()
    return run


def nothing(*args):
    return []


def test_translate_rows_decode_the_same_lines_with_model_py_and_its_exports(toy, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv('OMP_NUM_THREADS', '1')  # the first script is a process, as bench.py runs it
    monkeypatch.setattr(bench, 'run_script', first_in_a_process(bench.run_script))
    monkeypatch.setattr(speed, 'keep_freed_memory', nothing)  # it would stay with this process
    ref = tmp_path / 'ref.txt'
    ref.write_text(''.join(reverse(line) + '\n' for line in toy['lines']))
    r = bench.main(['--translate', toy['ckpt'], '--input', toy['src'], '--ref', str(ref),
                    '--rounds', '1', '--device', 'cpu', '--json'])
    n = len(toy['lines'])
    ct2 = []
    if CT2:
        ct2 = ['CTranslate2 float32', 'CTranslate2 int8']
    beam = ['model.py', 'model.py --exact', *ct2]  # --exact: a rule of beam search alone
    greedy = ['model.py', *ct2]
    assert [(x['search'], x['impl']) for x in r['rows']] == [*(('beam 4', i) for i in beam),
                                                            *(('greedy', i) for i in greedy)]
    assert r['sentences'] == n and all(x['sents_per_s'][0] > 0 for x in r['rows'])
    own = [x for x in r['rows'] if x['impl'] == 'model.py']
    for x in own:
        assert x['same_as_model_py'] == n and x['vs_model_py'] == 1 and x['dtype'] == 'float32'
    assert own[0]['bleu'] > 90  # the toy reverses word order: its BLEU against the reversal is high
    if CT2:  # the float32 export's greedy output is model.py's (test_export)
        assert r['rows'][-2]['impl'] == 'CTranslate2 float32'
        assert r['rows'][-2]['same_as_model_py'] == n


def test_a_failing_script_ends_bench_with_its_own_last_line_of_error(tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.main(['--translate', str(tmp_path / 'nope.pt'), '--input', __file__, '--rounds', '1'])
    message = str(e.value)
    assert 'nope.pt' in message and 'Traceback' not in message and '\n' not in message


def test_no_prepared_data_ends_bench_with_one_line_that_says_how_to_prepare_it(tmp_path,
                                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)  # where config/multi30k.py's data_dir is not
    recipe = os.path.join(bench.HERE, 'config', 'multi30k.py')
    missing = str(tmp_path / 'nope')
    for argv in (['--config', recipe], ['--config', 'tiny', '--data', missing]):
        with pytest.raises(SystemExit) as e:
            bench.main([*argv, '--device', 'cpu', '--dtype', 'float32'])
        message = str(e.value)
        assert 'no prepared data' in message and 'python data_prep.py' in message
        assert '\n' not in message


@pytest.mark.parametrize('flags', [['--steps', '0'], ['--beam', '0'], ['--warmup', '-1'],
                                   ['--batch-tokens', '0']])
def test_counts_below_their_range_are_a_usage_error(flags, capsys):
    # --steps 0 timed nothing and divided by it.
    with pytest.raises(SystemExit) as e:
        bench.parse_args(flags)
    assert e.value.code == 2
    assert f'{flags[0]} must be' in capsys.readouterr().err


def test_a_training_config_file_gives_the_model_batch_size_data_dtype_and_settings(tmp_path):
    path = tmp_path / 'recipe.py'
    path.write_text("d_model = 48\nd_ff = 4 * d_model\npre_norm = True\n"
                    "max_tokens = 300\ndata_dir = 'd'\nlr = 1e-3\n")
    args = bench.parse_args(['--config', str(path)])
    cfg = M.Config(d_model=48, d_ff=192, pre_norm=True)
    assert bench.CONFIGS[args.config] == dataclasses.asdict(cfg)
    assert (args.batch_tokens, args.data) == (300, 'd')  # lr: a training setting, not the step's
    assert args.dtype is None and args.settings == bench.SETTINGS  # train.py's defaults
    assert bench.parse_args(['--config', str(path), '--batch-tokens', '64']).batch_tokens == 64
    with pytest.raises(SystemExit):
        bench.parse_args(['--config', 'smal'])
    path.write_text("dtype = 'float32'\nweight_decay = 0.1\nlabel_smoothing = 0.2\n"
                    "beta1, beta2, adam_eps = 0.8, 0.99, 1e-8\nclip_grad = 1.0\nseed = 7\n")
    args = bench.parse_args(['--config', str(path)])
    assert args.dtype == ['float32']
    assert args.settings == dict(weight_decay=0.1, label_smoothing=0.2, beta1=0.8, beta2=0.99,
                                 adam_eps=1e-8, clip_grad=1.0, seed=7)
    assert bench.parse_args(['--config', str(path), '--dtype', 'bfloat16']).dtype == ['bfloat16']
    path.write_text("dtype = 'float16'\n")  # a GPU's scaled float16: not one of bench.py's rows
    with pytest.raises(SystemExit):
        bench.parse_args(['--config', str(path)])


def train_py_defaults():
    """The settings train.py assigns at its top level, where they are literals."""
    with open(os.path.join(bench.HERE, 'train.py'), encoding='utf-8') as f:
        tree = ast.parse(f.read())
    defaults = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            continue
        for target in node.targets:
            if isinstance(target, ast.Name):
                defaults[target.id] = value
            elif isinstance(target, ast.Tuple):  # beta1, beta2, adam_eps = ...
                defaults.update(zip([name.id for name in target.elts], value))
    return defaults


def test_the_settings_a_config_file_may_leave_out_are_train_pys_defaults():
    defaults = train_py_defaults()
    assert {k: defaults[k] for k in bench.SETTINGS} == bench.SETTINGS


def test_the_cpu_step_is_train_pys_dropout_adamw_gradient_norm_loss_and_flash(monkeypatch):
    # train.py's step with its settings: the CPU dropout mask, fused AdamW with weight decay on the
    # matrices alone, the gradient norm (clipped, and its non-finite check), the label smoothing,
    # and flash attention on or off per dtype (off for bf16 on a CPU, where it is slower).
    calls, optimizers = [], []
    configure = M.configure_optimizer
    norm = torch.nn.utils.clip_grad_norm_
    smoothed = M.label_smoothed_loss

    def cpu_dropout(model):
        calls.append(('dropout', type(model).__name__))

    def configure_optimizer(model, lr, betas, eps, weight_decay):
        optimizers.append(configure(model, lr, betas, eps, weight_decay))
        calls.append(('fused', optimizers[-1].defaults['fused']))
        return optimizers[-1]

    def clip_grad_norm_(params, max_norm):
        calls.append(('norm', max_norm, torch.backends.cuda.flash_sdp_enabled()))
        return norm(params, max_norm)

    def label_smoothed_loss(*args):
        calls.append(('smoothing', args[3]))
        return smoothed(*args)

    monkeypatch.setattr(speed, 'cpu_dropout', cpu_dropout)
    monkeypatch.setattr(M, 'configure_optimizer', configure_optimizer)
    monkeypatch.setattr(torch.nn.utils, 'clip_grad_norm_', clip_grad_norm_)
    monkeypatch.setattr(M, 'label_smoothed_loss', label_smoothed_loss)
    cfg = M.Config(**bench.CONFIGS['tiny'])
    batches = bench.make_batches(bench.synthetic_split(40, cfg.vocab_size), cfg, 128, 2, 'cpu')
    cpu = torch.device('cpu')
    bench.bench_train(cfg, 'ours', False, torch.float32, batches, warmup=1, device=cpu)
    step = [('smoothing', 0.1), ('norm', math.inf, True)]
    assert calls == [('dropout', 'Transformer'), ('fused', True), *step, *step]
    decay, no_decay = optimizers[0].param_groups
    assert (decay['weight_decay'], no_decay['weight_decay']) == (0.0, 0.0)

    calls.clear()
    settings = dict(bench.SETTINGS, label_smoothing=0.2, beta1=0.8, beta2=0.9, adam_eps=1e-6,
                    weight_decay=0.3, clip_grad=1.5)
    bench.bench_train(cfg, 'ours', False, torch.bfloat16, batches, warmup=1, device=cpu,
                      settings=settings)
    step = [('smoothing', 0.2), ('norm', 1.5, False)]
    assert calls == [('dropout', 'Transformer'), ('fused', True), *step, *step]
    assert torch.backends.cuda.flash_sdp_enabled()  # back on for decoding, as translate.py has it
    opt = optimizers[1]
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert all(p.dim() >= 2 for p in decay['params'])
    assert all(p.dim() < 2 for p in no_decay['params'])
    assert (decay['weight_decay'], no_decay['weight_decay']) == (0.3, 0.0)
    assert (decay['betas'], decay['eps']) == ((0.8, 0.9), 1e-6)
    assert opt.found_inf.item() == 0  # a finite norm: the update was taken


def test_a_config_files_dtype_and_settings_reach_every_training_row(prepared, tmp_path,
                                                                    monkeypatch):
    fast = speed.fast_dtype('cpu')
    other = 'float32'  # not the device's default dtype, so the config's is seen to count
    if fast == 'float32':
        other = 'bfloat16'
    path = tmp_path / 'recipe.py'
    path.write_text(f"n_enc_layers = n_dec_layers = 1\nd_model = 32\nd_ff = 64\nn_heads = 2\n"
                    f"max_tokens = 256\ndata_dir = {prepared[0]!r}\ndtype = {other!r}\n"
                    f"weight_decay = 0.3\nlabel_smoothing = 0.2\nseed = 5\n")
    seen = []
    configure, smoothed, make = M.configure_optimizer, M.label_smoothed_loss, bench.make_batches

    def configure_optimizer(model, lr, betas, eps, weight_decay):
        seen.append(('weight_decay', type(model).__name__, weight_decay))
        return configure(model, lr, betas, eps, weight_decay)

    def label_smoothed_loss(*args):
        seen.append(('smoothing', args[3]))
        return smoothed(*args)

    def make_batches(*args):
        seen.append(('seed', args[-1]))
        return make(*args)

    def no_peak(dtype, device):
        return 1e12

    def nothing(*args):
        return []

    monkeypatch.setattr(M, 'configure_optimizer', configure_optimizer)
    monkeypatch.setattr(M, 'label_smoothed_loss', label_smoothed_loss)
    monkeypatch.setattr(bench, 'make_batches', make_batches)
    monkeypatch.setattr(bench, 'measure_peak', no_peak)
    monkeypatch.setattr(bench, 'bench_decode', nothing)  # no decoding rows
    monkeypatch.setattr(speed, 'keep_freed_memory', nothing)  # it would stay with this process
    r = bench.main(['--config', str(path), '--device', 'cpu', '--compile', 'off', '--warmup', '1',
                    '--steps', '1', '--json'])
    assert [(t['impl'], t['dtype']) for t in r['train']] == [
        ('ours', other), ('torch.nn.Transformer', other)]
    assert r['batch_tokens'] == 256 and r['model_cfg']['d_model'] == 32
    step = [('smoothing', 0.2)] * 2
    assert seen == [('seed', 5), ('weight_decay', 'Transformer', 0.3), *step,
                    ('weight_decay', 'Builtin', 0.3), *step]

