import ast
import json
import os
import random
import socket
import subprocess
import sys

import pytest
import torch

import translate

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ['--n_enc_layers=1', '--n_dec_layers=1', '--d_model=32', '--d_ff=64', '--n_heads=4', '--max_tokens=256',
        '--log_interval=1', '--eval_interval=0', '--bleu_interval=-1', '--save_interval=0', '--compile=False',
        '--schedule=inverse_sqrt', '--lr=1e-3', '--warmup=10', '--device=cpu']


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """A toy parallel corpus (word-for-word substitution, reversed) prepared by data_prep.py."""
    root = tmp_path_factory.mktemp('toy')
    rng = random.Random(0)
    words = [f'w{i}' for i in range(40)]
    for split, n in [('train', 1200), ('valid', 40), ('test', 40)]:
        src = [[rng.choice(words) for _ in range(rng.randint(2, 12))] for _ in range(n)]
        (root / f'{split}.xx').write_text('\n'.join(' '.join(s) for s in src) + '\n')
        (root / f'{split}.yy').write_text('\n'.join(' '.join('v' + w[1:] for w in s[::-1]) for s in src) + '\n')
    out = root / 'data'
    subprocess.run([sys.executable, 'data_prep.py', 'custom', '--train', str(root / 'train'), '--valid',
                    str(root / 'valid'), '--test', str(root / 'test'), '--src', 'xx', '--tgt', 'yy',
                    '--vocab-size', '300', '--out', str(out)], cwd=HERE, check=True, capture_output=True)
    return str(out)


def free_port():
    with socket.socket() as s:  # torchrun's --master_port=0 hangs the static rendezvous
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def train(args, out_dir, data_dir, nproc=1):
    launcher = [sys.executable] if nproc == 1 else [sys.executable, '-m', 'torch.distributed.run',
                                                    f'--nproc_per_node={nproc}', f'--master_port={free_port()}']
    cmd = launcher + ['train.py'] + TINY + [f'--data_dir={data_dir}', f'--out_dir={out_dir}'] + args
    env = dict(os.environ, OMP_NUM_THREADS='1')
    res = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


def final_params(out_dir, step):
    return torch.load(os.path.join(out_dir, f'ckpt_{step:07d}.pt'), weights_only=False)['model']


def train_losses(out_dir):
    return [r['loss'] for r in map(json.loads, open(os.path.join(out_dir, 'log.jsonl'))) if 'loss' in r]


def test_few_steps_write_loadable_checkpoint(data_dir, tmp_path):
    out = tmp_path / 'run'
    res = train(['--max_steps=6', '--save_interval=3', '--bleu_interval=0'], out, data_dir)
    assert 'tgt tok/s' in res.stdout and 'ETA' in res.stdout
    assert sorted(os.listdir(out)) == ['ckpt.pt', 'ckpt_0000003.pt', 'ckpt_0000006.pt', 'ckpt_best.pt', 'log.jsonl']
    model, enc, ckpt = translate.load_checkpoint(str(out / 'ckpt.pt'), 'cpu')
    assert ckpt['step'] == 6 and ckpt['config']['max_steps'] == 6
    assert len(list(translate.translate_lines(model, enc, ['w1 w2 w3'], beam=2))) == 1


def test_ddp_two_processes_equal_one_process_with_update_freq_2(data_dir, tmp_path):
    common = ['--max_steps=4', '--dtype=float32', '--dropout=0.0', '--save_interval=4']
    train(common + ['--update_freq=2'], tmp_path / 'one', data_dir)
    train(common, tmp_path / 'two', data_dir, nproc=2)
    a, b = final_params(tmp_path / 'one', 4), final_params(tmp_path / 'two', 4)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)


def test_resume_is_exact(data_dir, tmp_path):
    common = ['--dtype=float32', '--dropout=0.1', '--save_interval=5']
    train(common + ['--max_steps=10'], tmp_path / 'straight', data_dir)
    train(common + ['--max_steps=5'], tmp_path / 'split', data_dir)
    train(common + ['--max_steps=10', '--init_from=resume'], tmp_path / 'split', data_dir)
    assert train_losses(tmp_path / 'split') == train_losses(tmp_path / 'straight')
    a, b = final_params(tmp_path / 'straight', 10), final_params(tmp_path / 'split', 10)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def load_get_lr(**settings):
    """get_lr from train.py, without running the script around it."""
    tree = ast.parse(open(os.path.join(HERE, 'train.py')).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == 'get_lr')
    scope = dict(settings, sys=sys)
    exec(compile(ast.Module(body=[fn], type_ignores=[]), 'train.py', 'exec'), scope)
    return scope['get_lr']


def test_noam_schedule_matches_paper_formula():
    class Cfg:
        d_model = 512
    get_lr = load_get_lr(schedule='noam', lr_scale=1.0, warmup=4000, model_cfg=Cfg)
    assert get_lr(1) == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    assert get_lr(4000) == pytest.approx(512 ** -0.5 * 4000 ** -0.5)  # the peak, ~7.0e-4
    assert get_lr(100000) == pytest.approx(512 ** -0.5 * 100000 ** -0.5)
    assert get_lr(4000) == pytest.approx(6.988e-4, rel=1e-3)


def test_inverse_sqrt_schedule():
    get_lr = load_get_lr(schedule='inverse_sqrt', lr=5e-4, warmup=4000)
    assert get_lr(2000) == pytest.approx(2.5e-4)
    assert get_lr(4000) == pytest.approx(5e-4)
    assert get_lr(16000) == pytest.approx(2.5e-4)


@pytest.mark.parametrize('args,message', [
    (['--no_such_key=1'], "unknown setting 'no_such_key'"),
    (['--max_steps=ten'], 'max_steps must be int'),
    (['--dropout=True'], 'dropout must be float'),
    (['--max_steps'], 'expected --key=value'),
    (['config/none.py'], 'config file config/none.py not found'),
    (['--data_dir=does/not/exist'], 'python data_prep.py'),
])
def test_bad_settings_give_clear_errors(args, message):
    res = subprocess.run([sys.executable, 'train.py'] + args, cwd=HERE, capture_output=True, text=True)
    assert res.returncode != 0
    assert message in res.stderr and 'Traceback' not in res.stderr


def test_unknown_key_in_config_file_is_named(tmp_path):
    cfg = tmp_path / 'bad.py'
    cfg.write_text('d_model = 256\nlearning_rate = 1e-3\n')
    res = subprocess.run([sys.executable, 'train.py', str(cfg)], cwd=HERE, capture_output=True, text=True)
    assert res.returncode != 0 and "unknown setting 'learning_rate'" in res.stderr and str(cfg) in res.stderr


def test_average_of_three_checkpoints_is_the_mean(tmp_path):
    torch.manual_seed(0)
    states = [{'w': torch.randn(3, 4), 'b': torch.randn(4).to(torch.bfloat16)} for _ in range(3)]
    paths = []
    for i, s in enumerate(states):
        paths.append(str(tmp_path / f'ckpt_{i}.pt'))
        torch.save({'model': s}, paths[-1])
    avg = translate.average_checkpoints(paths)
    torch.testing.assert_close(avg['w'], (states[0]['w'] + states[1]['w'] + states[2]['w']) / 3)
    assert avg['b'].dtype == torch.bfloat16
    torch.testing.assert_close(avg['b'].float(), sum(s['b'].float() for s in states) / 3, atol=1e-2, rtol=0)
