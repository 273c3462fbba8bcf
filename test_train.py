import ast
import json
import os
import random
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

import data_prep
import translate

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ['--n_enc_layers=1', '--n_dec_layers=1', '--d_model=32', '--d_ff=64', '--n_heads=4', '--max_tokens=256',
        '--log_interval=1', '--eval_interval=0', '--bleu_interval=-1', '--save_interval=0', '--compile=False',
        '--schedule=inverse_sqrt', '--lr=1e-3', '--warmup=10', '--device=cpu']


def toy_corpus(root, seed=0, tokenizer=None):
    """A toy parallel corpus (word-for-word substitution, reversed) prepared by data_prep.py, with a BPE of its
    own or the given --tokenizer's."""
    rng = random.Random(seed)
    words = [f'w{i}' for i in range(40)]
    for split, n in [('train', 1200), ('valid', 40), ('test', 40)]:
        src = [[rng.choice(words) for _ in range(rng.randint(2, 12))] for _ in range(n)]
        (root / f'{split}.xx').write_text('\n'.join(' '.join(s) for s in src) + '\n')
        (root / f'{split}.yy').write_text('\n'.join(' '.join('v' + w[1:] for w in s[::-1]) for s in src) + '\n')
    out = root / 'data'
    subprocess.run([sys.executable, 'data_prep.py', 'custom', '--train', str(root / 'train'), '--valid',
                    str(root / 'valid'), '--test', str(root / 'test'), '--src', 'xx', '--tgt', 'yy',
                    *(['--tokenizer', str(tokenizer)] if tokenizer else ['--vocab-size', '300']), '--out', str(out)],
                   cwd=HERE, check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    return toy_corpus(tmp_path_factory.mktemp('toy'))


@pytest.fixture(scope='module')
def other_data_dir(tmp_path_factory):  # the same sizes, another corpus: another BPE of as many tokens
    return toy_corpus(tmp_path_factory.mktemp('other'), seed=1)


def free_port():
    with socket.socket() as s:  # torchrun's --master_port=0 hangs the static rendezvous
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def train(args, out_dir, data_dir, nproc=1, ok=True, launcher=None, env=()):
    launcher = launcher or ([sys.executable] if nproc == 1 else [
        sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={nproc}', f'--master_port={free_port()}'])
    cmd = launcher + ['train.py'] + TINY + [f'--data_dir={data_dir}', f'--out_dir={out_dir}'] + args
    env = dict(os.environ, OMP_NUM_THREADS='1', **dict(env))
    res = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, env=env)
    if ok:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    else:
        assert res.returncode != 0 and 'Traceback' not in res.stderr, res.stderr[-3000:]
    return res


def final_params(out_dir, step):
    return torch.load(os.path.join(out_dir, f'ckpt_{step:07d}.pt'), weights_only=False)['model']


def records(out_dir, key):
    return [r for r in map(json.loads, open(os.path.join(out_dir, 'log.jsonl'))) if key in r]


def train_losses(out_dir):
    return [r['loss'] for r in map(json.loads, open(os.path.join(out_dir, 'log.jsonl'))) if 'loss' in r]


def test_few_steps_write_loadable_checkpoint(data_dir, tmp_path):
    out = tmp_path / 'run'
    res = train(['--max_steps=6', '--save_interval=3', '--bleu_interval=0'], out, data_dir)
    assert 'tgt tok/s' in res.stdout and 'ETA' in res.stdout
    assert sorted(os.listdir(out)) == ['ckpt.pt', 'ckpt_0000003.pt', 'ckpt_0000006.pt', 'ckpt_best.pt', 'log.jsonl',
                                       'state_0000006.pt']
    model, enc, ckpt = translate.load_checkpoint(str(out / 'ckpt.pt'), 'cpu')
    assert ckpt['step'] == 6 and ckpt['config']['max_steps'] == 6
    assert len(list(translate.translate_lines(model, enc, ['w1 w2 w3'], beam=2))) == 1


def test_ddp_two_processes_equal_one_process_with_update_freq_2(data_dir, tmp_path):
    # Validation is split across the ranks: its loss and BLEU must still be those of one process.
    common = ['--max_steps=4', '--dtype=float32', '--dropout=0.0', '--save_interval=4', '--bleu_interval=0']
    train(common + ['--update_freq=2'], tmp_path / 'one', data_dir)
    train(common, tmp_path / 'two', data_dir, nproc=2)
    a, b = final_params(tmp_path / 'one', 4), final_params(tmp_path / 'two', 4)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)
    # The logged training loss too: over both ranks' tokens, not rank 0's times two.
    assert train_losses(tmp_path / 'two') == pytest.approx(train_losses(tmp_path / 'one'), rel=1e-5)
    (va,), (vb,) = records(tmp_path / 'one', 'valid_bleu'), records(tmp_path / 'two', 'valid_bleu')
    assert va['valid_bleu'] == vb['valid_bleu'] and va['valid_loss'] == pytest.approx(vb['valid_loss'], rel=1e-5)


# Loaded by each rank's interpreter (PYTHONPATH): just before the process group goes, a collective whose
# completion callback keeps a Gloo worker thread waiting for the interpreter to shut down, as a worker that is
# still releasing the last collective's tensors at that moment does by chance.
HOLD_A_GLOO_THREAD = """
import os
if 'RANK' in os.environ:  # torchrun's workers, not its launcher
    import sys, time
    import torch, torch.distributed as dist
    destroy, groups = dist.destroy_process_group, []
    def wait_for_shutdown(_, finalizing=sys.is_finalizing, sleep=time.sleep):
        while not finalizing():
            sleep(0.01)
    def hold_a_gloo_thread_then_destroy(*args, **kwargs):
        groups.append(dist.new_group(backend='gloo'))  # kept, as DDP keeps the default group: not joined
        work = dist.all_reduce(torch.ones(1), group=groups[-1], async_op=True)
        work.get_future().then(wait_for_shutdown)
        destroy(*args, **kwargs)
    dist.destroy_process_group = hold_a_gloo_thread_then_destroy
"""


def test_ddp_run_exits_cleanly_while_a_gloo_thread_still_needs_python(data_dir, tmp_path):
    # Without care the rank aborts (SIGABRT, 'terminate called without an active exception') after its run
    # finished: torchrun reports the run failed.
    (tmp_path / 'sitecustomize.py').write_text(HOLD_A_GLOO_THREAD)
    res = train(['--max_steps=2', '--dtype=float32'], tmp_path / 'run', data_dir, nproc=2,
                env={'PYTHONPATH': str(tmp_path)})
    assert 'done: step 2' in res.stdout and os.path.exists(tmp_path / 'run' / 'ckpt.pt')


def test_weight_snapshots_hold_no_optimizer_state_and_few_full_states_are_kept(data_dir, tmp_path):
    train(['--max_steps=6', '--save_interval=2', '--keep_last=3', '--keep_state=2'], tmp_path, data_dir)
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith('state_')) == ['state_0000004.pt', 'state_0000006.pt']
    for step in (2, 4, 6):
        assert 'optimizer' not in torch.load(tmp_path / f'ckpt_{step:07d}.pt', weights_only=False)
    assert 'optimizer' in torch.load(tmp_path / 'state_0000006.pt', weights_only=False)


def test_fresh_run_into_a_used_out_dir_is_refused_unless_overwrite(data_dir, tmp_path):
    train(['--max_steps=2', '--save_interval=1'], tmp_path, data_dir)
    res = train(['--max_steps=2'], tmp_path, data_dir, ok=False)
    assert str(tmp_path) in res.stderr and '--init_from=resume' in res.stderr and '--overwrite=True' in res.stderr
    assert len(records(tmp_path, 'loss')) == 2
    (tmp_path / 'state_0000003.pt.k1l2_ed.tmp').write_bytes(b'half a save')  # a run killed while saving
    train(['--max_steps=3', '--overwrite=True', '--save_interval=0'], tmp_path, data_dir)
    assert [r['step'] for r in records(tmp_path, 'loss')] == [1, 2, 3]
    assert translate.checkpoints(str(tmp_path)) == [str(tmp_path / 'ckpt_0000003.pt')]
    assert not list(tmp_path.glob('*.tmp'))


def test_a_run_into_an_out_dir_another_run_is_using_is_refused(data_dir, tmp_path):
    cmd = [sys.executable, 'train.py'] + TINY + [f'--data_dir={data_dir}', f'--out_dir={tmp_path}']
    first = subprocess.Popen(cmd + ['--max_steps=100000', '--log_interval=1'], cwd=HERE, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))
    try:
        for line in first.stdout:  # training, so past every check of out_dir
            if line.startswith('step 1 '):
                break
        for args in (['--init_from=resume'], ['--overwrite=True']):
            res = train(['--max_steps=2'] + args, tmp_path, data_dir, ok=False)
            assert 'in use by another train.py run' in res.stderr, res.stderr
    finally:
        first.kill()
        first.wait()
    train(['--max_steps=2', '--overwrite=True', '--save_interval=1'], tmp_path, data_dir)  # the kernel freed it
    (tmp_path / 'state_0000003.pt.k1l2_ed.tmp').write_bytes(b'half a save')  # a run killed while saving
    train(['--max_steps=3', '--init_from=resume'], tmp_path, data_dir)
    assert not list(tmp_path.glob('*.tmp'))


def test_an_out_dir_that_cannot_be_locked_trains_and_keeps_temporary_files(data_dir, tmp_path):
    # flock failing as on Lustre mounted without it (ENOSYS): train unguarded, and leave a save's temporary files,
    # which may be another run's
    code = ('import errno, fcntl, os, runpy, sys\n'
            'def flock(fd, op): raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))\n'
            'fcntl.flock, sys.argv = flock, sys.argv[1:]\n'
            'runpy.run_path(sys.argv[0], run_name="__main__")\n')
    res = train(['--max_steps=2', '--save_interval=1'], tmp_path, data_dir, launcher=[sys.executable, '-c', code])
    assert 'cannot be locked' in res.stdout
    (tmp_path / 'state_0000003.pt.k1l2_ed.tmp').write_bytes(b'half a save')
    train(['--max_steps=3', '--init_from=resume'], tmp_path, data_dir, launcher=[sys.executable, '-c', code])
    assert (tmp_path / 'state_0000003.pt.k1l2_ed.tmp').exists()


def test_overwrite_deletes_the_old_run_only_once_every_input_has_loaded(data_dir, tmp_path):
    train(['--max_steps=2', '--save_interval=1'], tmp_path, data_dir)
    train(['--max_steps=1', '--overwrite=True'], tmp_path, tmp_path / 'typo', ok=False)
    train(['--max_steps=1', '--overwrite=True', '--max_len=5'], tmp_path, data_dir, ok=False)  # a later check
    train(['--max_steps=1', '--overwrite=True', '--update_freq=100'], tmp_path, data_dir, ok=False)  # fewer batches
    assert len(records(tmp_path, 'loss')) == 2 and os.path.exists(tmp_path / 'ckpt.pt')
    train(['--max_steps=1', '--update_freq=100'], tmp_path / 'fresh', data_dir, ok=False)
    assert not os.path.exists(tmp_path / 'fresh' / 'log.jsonl')  # nothing that makes the next try need --overwrite
    # fine-tuning from this out_dir's own checkpoint into it, starting over
    train(['--max_steps=1', '--overwrite=True', f'--init_from={tmp_path / "ckpt.pt"}'], tmp_path, data_dir)
    assert [r['step'] for r in records(tmp_path, 'loss')] == [1]


def test_ddp_overwrite_waits_for_every_rank_to_list_the_old_run(data_dir, tmp_path):
    train(['--max_steps=2', '--save_interval=1'], tmp_path / 'run', data_dir)
    (tmp_path / 'sitecustomize.py').write_text(  # rank 1 looks at out_dir 3 s after rank 0
        "import os, time\nif os.environ.get('RANK') == '1':\n    listdir = os.listdir\n"
        "    def late(path='.'):\n        if 'run' in str(path): time.sleep(3)\n        return listdir(path)\n"
        "    os.listdir = late\n")
    train(['--max_steps=1', '--overwrite=True', '--ddp_timeout_minutes=0.5'], tmp_path / 'run', data_dir, nproc=2,
          env={'PYTHONPATH': str(tmp_path)})
    assert [r['step'] for r in records(tmp_path / 'run', 'loss')] == [1]


def test_resume_or_fine_tune_with_another_tokenizer_is_refused(data_dir, other_data_dir, tmp_path):
    assert json.load(open(os.path.join(data_dir, 'meta.json')))['vocab_size'] == \
        json.load(open(os.path.join(other_data_dir, 'meta.json')))['vocab_size']
    train(['--max_steps=2', '--save_interval=1'], tmp_path / 'a', data_dir)
    res = train(['--max_steps=4', '--init_from=resume'], tmp_path / 'a', other_data_dir, ok=False)
    assert 'another tokenizer' in res.stderr and 'state_0000002.pt' in res.stderr
    res = train(['--max_steps=4', f'--init_from={tmp_path / "a" / "ckpt.pt"}'], tmp_path / 'b', other_data_dir, ok=False)
    assert 'another tokenizer' in res.stderr and 'ckpt.pt' in res.stderr


def test_data_prepared_with_the_checkpoints_tokenizer_fine_tunes_it(data_dir, tmp_path):
    train(['--max_steps=2'], tmp_path / 'a', data_dir)  # the README's fine-tuning recipe, on another corpus
    mine = toy_corpus(tmp_path, seed=1, tokenizer=tmp_path / 'a' / 'ckpt.pt')
    train(['--max_steps=1', f'--init_from={tmp_path / "a" / "ckpt.pt"}'], tmp_path / 'b', mine)


def test_fine_tune_starts_a_new_run_from_the_checkpoint_weights(data_dir, tmp_path):
    train(['--max_steps=3', '--d_model=48', '--n_heads=6'], tmp_path / 'a', data_dir)
    # lr 0: the new run's first snapshot must hold the source weights unchanged, at step 1, with a fresh optimizer
    res = train(['--max_steps=1', '--lr=0.0', f'--init_from={tmp_path / "a" / "ckpt.pt"}'], tmp_path / 'b', data_dir)
    src = torch.load(tmp_path / 'a' / 'ckpt.pt', weights_only=False)
    new = torch.load(tmp_path / 'b' / 'state_0000001.pt', weights_only=False)
    assert new['model_cfg']['d_model'] == 48 and new['step'] == 1
    # The settings' other d_model is said, and the saved config is the model's, not the ignored setting's.
    assert "keeps the checkpoint's architecture: d_model=48" in res.stdout and new['config']['d_model'] == 48
    for k, v in src['model'].items():
        assert torch.equal(v, new['model'][k]), k
    assert all(s['step'].item() == 1 for s in new['optimizer']['state'].values())
    # Resumed with the command that began it: its settings' d_model was the checkpoint's to decide then, and is now.
    res = train(['--max_steps=2', '--lr=0.0', '--init_from=resume'], tmp_path / 'b', data_dir)
    assert "keeps the checkpoint's architecture: d_model=48" in res.stdout
    assert torch.load(tmp_path / 'b' / 'state_0000002.pt', weights_only=False)['config']['d_model'] == 48
    res = train(['--max_steps=1', f'--init_from={tmp_path / "missing.pt"}'], tmp_path / 'c', data_dir, ok=False)
    assert 'missing.pt not found' in res.stderr


def test_two_process_resume_is_exact(data_dir, tmp_path):
    common = ['--dtype=float32', '--dropout=0.3', '--save_interval=3']
    train(common + ['--max_steps=6'], tmp_path / 'straight', data_dir, nproc=2)
    train(common + ['--max_steps=3'], tmp_path / 'split', data_dir, nproc=2)
    train(common + ['--max_steps=6', '--init_from=resume'], tmp_path / 'split', data_dir, nproc=2)
    assert train_losses(tmp_path / 'split') == train_losses(tmp_path / 'straight')
    a, b = final_params(tmp_path / 'straight', 6), final_params(tmp_path / 'split', 6)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_out_dir_that_cannot_be_written_is_a_one_line_error(data_dir, tmp_path):
    (tmp_path / 'file').write_text('not a folder')
    res = train(['--max_steps=1'], tmp_path / 'file' / 'run', data_dir, ok=False)
    assert f"out_dir {tmp_path / 'file' / 'run'} cannot be created or written" in res.stderr


def test_incomplete_data_dir_is_a_one_line_error(data_dir, tmp_path):
    shutil.copytree(data_dir, tmp_path / 'data')
    os.remove(tmp_path / 'data' / 'train.xx.bin')
    res = train(['--max_steps=1'], tmp_path / 'run', tmp_path / 'data', ok=False)
    assert 'is incomplete or damaged (train' in res.stderr and 'train.xx.bin' in res.stderr
    shutil.copy(os.path.join(data_dir, 'train.xx.bin'), tmp_path / 'data')
    with open(tmp_path / 'data' / 'train.yy.bin', 'r+b') as f:  # cut short: its .idx points past the end
        f.truncate(os.path.getsize(tmp_path / 'data' / 'train.yy.bin') // 2)
    res = train(['--max_steps=1'], tmp_path / 'run', tmp_path / 'data', ok=False)
    assert 'train.yy.idx does not match' in res.stderr and 'train.yy.bin' in res.stderr
    shutil.copy(os.path.join(data_dir, 'train.yy.bin'), tmp_path / 'data')
    for name, damage in [('tokenizer.json', None), ('valid.xx.txt', None), ('meta.json', '{"src": "xx", "tgt"')]:
        os.rename(tmp_path / 'data' / name, tmp_path / name)
        if damage is not None:
            (tmp_path / 'data' / name).write_text(damage)
        res = train(['--max_steps=1'], tmp_path / 'run', tmp_path / 'data', ok=False)
        assert 'is incomplete or damaged' in res.stderr and name in res.stderr, res.stderr
        os.replace(tmp_path / name, tmp_path / 'data' / name)
    meta = json.loads((tmp_path / 'data' / 'meta.json').read_text())
    for damage in ([1, 2], {**meta, 'dtype': 'float99'}, {**meta, 'vocab_size': 10}, {**meta, 'vocab_size': 10 ** 12},
                   {**meta, 'pad_id': 5000}, {**meta, 'pad_id': '0'}, {**meta, 'eos_id': meta['pad_id']}):
        (tmp_path / 'data' / 'meta.json').write_text(json.dumps(damage))
        res = train(['--max_steps=1'], tmp_path / 'run', tmp_path / 'data', ok=False)
        assert 'is incomplete or damaged' in res.stderr, res.stderr


def test_sentence_longer_than_max_len_is_a_one_line_error_before_training(data_dir, tmp_path):
    res = train(['--max_steps=1', '--max_len=8'], tmp_path, data_dir, ok=False)
    assert "but the model's max_len is 8" in res.stderr and 'step 1 ' not in res.stdout


def test_max_tokens_below_every_pair_says_how_far_to_raise_it(data_dir, tmp_path):
    idx = [np.fromfile(os.path.join(data_dir, f'train.{lang}.idx'), dtype=np.int64) for lang in ('xx', 'yy')]
    shortest = int((np.maximum(np.diff(idx[0]), np.diff(idx[1])) + 1).min())  # padded tokens incl. EOS
    res = train(['--max_steps=1', f'--max_tokens={shortest - 1}'], tmp_path, data_dir, ok=False)
    assert f'raise max_tokens to at least {shortest}' in res.stderr and 'lower' not in res.stderr


def load_function(name, **scope):
    """A function of train.py with the globals given, without running the script around it."""
    tree = ast.parse(open(os.path.join(HERE, 'train.py')).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module(body=[fn], type_ignores=[]), 'train.py', 'exec'), scope)
    return scope[name]


def test_time_decisions_all_reduce_on_the_training_device():
    # NCCL reduces GPU tensors only; 'meta' stands in here for a device that is not the CPU.
    seen = []

    class Dist:
        ReduceOp = torch.distributed.ReduceOp

        @staticmethod
        def all_reduce(t, op=None):
            seen.append(t.device.type)

    agree = load_function('agree', ddp=True, device='meta', dist=Dist, torch=torch, pending=None)
    assert agree(True, False) == [False, False]  # read one step late
    assert seen == ['meta']


def test_training_steps_between_log_lines_read_nothing_back_from_the_device(data_dir, tmp_path):
    # Host syncs (.item(), bool() of a tensor) stop a GPU from running ahead: count them per run.
    wrapper = (
        "import runpy, sys, torch\n"
        "n = [0]\n"
        "def counted(f):\n"
        "    def g(*a, **k):\n"
        "        n[0] += 1\n"
        "        return f(*a, **k)\n"
        "    return g\n"
        "torch.Tensor.item, torch.Tensor.__bool__ = counted(torch.Tensor.item), counted(torch.Tensor.__bool__)\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
        "print('host reads', n[0])\n")
    reads = []
    for steps in (4, 12):
        res = train([f'--max_steps={steps}', f'--log_interval={steps}', '--save_interval=0'], tmp_path / str(steps),
                    data_dir, launcher=[sys.executable, '-c', wrapper])
        reads.append(int(res.stdout.split('host reads')[-1]))
    assert reads[0] == reads[1]


def test_resume_is_exact(data_dir, tmp_path):
    common = ['--dtype=float32', '--dropout=0.1', '--save_interval=5']
    train(common + ['--max_steps=10'], tmp_path / 'straight', data_dir)
    train(common + ['--max_steps=5'], tmp_path / 'split', data_dir)
    train(common + ['--max_steps=10', '--init_from=resume'], tmp_path / 'split', data_dir)
    assert train_losses(tmp_path / 'split') == train_losses(tmp_path / 'straight')
    a, b = final_params(tmp_path / 'straight', 10), final_params(tmp_path / 'split', 10)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_with_another_update_freq_continues_at_the_next_batch(data_dir, tmp_path):
    # The saved position counted updates: resumed at update_freq 2 after 4 one-batch steps, a run skipped
    # batches 4-7 of the epoch and began the next epoch two steps early.
    n = len(data_prep.batch_plan(data_prep.load_split(data_dir, 'train'), 256, 1337, 0))
    train(['--max_steps=4', '--save_interval=4'], tmp_path, data_dir)
    last = 4 + (n - 4) // 2  # epoch 0's last step when batches 4, 5, ... are taken two at a time
    train([f'--max_steps={last + 1}', '--update_freq=2', '--init_from=resume'], tmp_path, data_dir)
    epochs = {r['step']: r['epoch'] for r in records(tmp_path, 'loss')}
    assert (epochs[last], epochs[last + 1]) == (0, 1)


def test_numbers_given_for_a_text_setting_are_kept_as_text():
    override = load_function('override', sys=sys, os=os, ast=ast, builtins=__builtins__, traceback=None)
    config = override({'out_dir': 'out/x', 'dtype': 'auto', 'max_steps': 10}, ['--out_dir=2024', "--dtype='float32'"])
    assert config == {'out_dir': '2024', 'dtype': 'float32', 'max_steps': 10}


def test_a_config_file_reads_the_settings_so_far_and_may_import(tmp_path):
    override = load_function('override', sys=sys, os=os, ast=ast, builtins=__import__('builtins'), traceback=None)
    (tmp_path / 'c.py').write_text('import math\nd_model = 64\nd_ff = 4 * d_model\n'
                                   'warmup = max(w * 2 for w in [int(math.sqrt(d_model))])\n')
    config = override({'d_model': 512, 'd_ff': 2048, 'warmup': 4000, 'lr': 1.0}, [str(tmp_path / 'c.py'), '--lr=2'])
    assert config == {'d_model': 64, 'd_ff': 256, 'warmup': 16, 'lr': 2.0}
    config = override({'d_model': 512, 'd_ff': 2048, 'warmup': 4000, 'lr': 1.0}, ['--d_model=32', str(tmp_path / 'c.py')])
    assert config['d_model'] == 32 and config['d_ff'] == 256  # a flag wins wherever it stands; the file saw 64
    (tmp_path / 'typo.py').write_text('d_modle = 64\n')
    with pytest.raises(SystemExit) as e:
        override({'d_model': 512}, [str(tmp_path / 'typo.py')])
    assert "unknown setting 'd_modle'" in str(e.value)


def test_damaged_training_state_on_resume_is_a_one_line_error(data_dir, tmp_path):
    train(['--max_steps=2', '--save_interval=2'], tmp_path, data_dir)
    (tmp_path / 'state_0000002.pt').write_bytes(b'not a checkpoint')
    res = train(['--max_steps=4', '--init_from=resume'], tmp_path, data_dir, ok=False)
    assert 'state_0000002.pt' in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_averaging_more_snapshots_than_are_kept_is_warned(data_dir, tmp_path):
    res = train(['--max_steps=2', '--keep_last=2', '--average_last=4'], tmp_path, data_dir)
    assert 'average_last=4 but keep_last=2' in res.stdout


def load_get_lr(**settings):
    return load_function('get_lr', sys=sys, **{'cooldown': 0.0, 'max_minutes': 0.0, 'max_steps': 10 ** 6, **settings})


def test_resumed_run_counts_the_training_time_already_spent(data_dir, tmp_path):
    train(['--max_steps=3', '--save_interval=3'], tmp_path, data_dir)
    state = torch.load(tmp_path / 'state_0000003.pt', weights_only=False)
    assert 0 < state['elapsed'] < 300
    torch.save({**state, 'elapsed': 600.0}, tmp_path / 'state_0000003.pt')  # as if it had trained 10 minutes
    res = train(['--max_steps=50', '--max_minutes=5.0', '--init_from=resume'], tmp_path, data_dir)
    # Its time was already spent: not one more step on each resume.
    assert 'max_minutes=5.0 reached at step 3' in res.stdout and translate.checkpoints(str(tmp_path))[-1].endswith('3.pt')


def test_tokenizers_that_differ_only_in_name_are_the_same(data_dir, tmp_path):
    train(['--max_steps=1'], tmp_path / 'a', data_dir)
    renamed = tmp_path / 'renamed'
    shutil.copytree(data_dir, renamed)
    tok = json.loads((renamed / 'tokenizer.json').read_text())
    (renamed / 'tokenizer.json').write_text(json.dumps({**tok, 'name': 'renamed'}))
    train(['--max_steps=1', f'--init_from={tmp_path / "a" / "ckpt.pt"}'], tmp_path / 'b', renamed)


def test_validation_pairs_over_max_tokens_are_named_and_none_left_is_an_error(tmp_path):
    rng, words = random.Random(0), [f'w{i}' for i in range(40)]
    for split, n, lo, hi in [('train', 400, 2, 4), ('valid', 20, 8, 12), ('test', 5, 2, 4)]:  # long valid pairs
        src = [[rng.choice(words) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
        (tmp_path / f'{split}.xx').write_text('\n'.join(' '.join(x) for x in src) + '\n')
        (tmp_path / f'{split}.yy').write_text('\n'.join(' '.join(x[::-1]) for x in src) + '\n')
    data = str(tmp_path / 'data')
    subprocess.run([sys.executable, 'data_prep.py', 'custom', '--train', str(tmp_path / 'train'), '--valid',
                    str(tmp_path / 'valid'), '--test', str(tmp_path / 'test'), '--src', 'xx', '--tgt', 'yy',
                    '--vocab-size', '300', '--out', data], cwd=HERE, check=True, capture_output=True)
    t, v = (data_prep.pair_sizes(data_prep.load_split(data, split)) for split in ('train', 'valid'))
    assert v.min() > t.max()
    res = train(['--max_steps=1', f'--max_tokens={int(sorted(v)[len(v) // 2])}'], tmp_path / 'a', data)
    assert 'validation pairs need more than max_tokens' in res.stdout
    res = train(['--max_steps=1', f'--max_tokens={int(t.max())}'], tmp_path / 'b', data, ok=False)
    assert 'every validation pair' in res.stderr
    # A max_len that the training pairs fit: the message names the validation set, not data_prep's training filter.
    res = train(['--max_steps=1', f'--max_len={int(t.max())}'], tmp_path / 'c', data, ok=False)
    assert 'validation sentence of' in res.stderr and 'data_prep.py --max-len' not in res.stderr
    # Pairs over max_tokens are left out of every batch, so a max_len they exceed is no error ...
    m = int(sorted(v)[len(v) // 2])
    train(['--max_steps=1', f'--max_len={m}', f'--max_tokens={m}'], tmp_path / 'd', data)
    # ... and a fine-tune, whose max_len is the checkpoint's, is not told to raise it.
    res = train(['--max_steps=1', f'--init_from={tmp_path / "d" / "ckpt.pt"}'], tmp_path / 'e', data, ok=False)
    assert 'validation sentence of' in res.stderr and 'raise max_len' not in res.stderr and 'ckpt.pt' in res.stderr


def test_resume_with_another_architecture_or_optimizer_setting_is_refused(data_dir, tmp_path):
    train(['--max_steps=2', '--save_interval=2'], tmp_path, data_dir)
    # seed and max_tokens make the batch plan that the saved position indexes: another would skip or repeat data
    for arg in ('--d_model=64', '--weight_decay=0.1', '--dropout=0.3', '--seed=7', '--max_tokens=300'):
        res = train(['--max_steps=4', '--init_from=resume', arg], tmp_path, data_dir, ok=False)
        assert arg[2:] in res.stderr and "(the run's:" in res.stderr and '--init_from=' in res.stderr
    train(['--max_steps=4', '--init_from=resume', '--log_interval=2'], tmp_path, data_dir)  # not fixed by the state


def test_resume_from_an_older_state_with_newer_snapshots_is_refused(data_dir, tmp_path):
    # Their weights are another trajectory's: the final average would mix the two.
    train(['--max_steps=4', '--save_interval=2', '--keep_state=2'], tmp_path, data_dir)
    os.remove(tmp_path / 'state_0000004.pt')
    res = train(['--max_steps=6', '--init_from=resume'], tmp_path, data_dir, ok=False)
    assert 'ckpt_0000004.pt' in res.stderr and 'state_0000002.pt' in res.stderr


def test_bleu_interval_is_kept_without_loss_evaluations(data_dir, tmp_path):
    train(['--max_steps=4', '--eval_interval=0', '--bleu_interval=2'], tmp_path, data_dir)
    assert [r['step'] for r in records(tmp_path, 'valid_bleu')] == [2, 4]


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


def test_cooldown_takes_the_lr_linearly_to_zero_over_the_end_of_the_time_budget():
    get_lr = load_get_lr(schedule='inverse_sqrt', lr=1e-3, warmup=100, cooldown=0.25, max_minutes=10.0)
    assert get_lr(400, elapsed=0) == pytest.approx(5e-4)
    assert get_lr(400, elapsed=450) == pytest.approx(5e-4)  # 7.5 of 10 minutes: cooldown starts
    assert get_lr(400, elapsed=525) == pytest.approx(2.5e-4)
    assert get_lr(400, elapsed=600) == 0.0 and get_lr(400, elapsed=700) == 0.0
    no_budget = load_get_lr(schedule='inverse_sqrt', lr=1e-3, warmup=100, cooldown=0.25, max_minutes=0.0)
    assert no_budget(400, elapsed=10 ** 6) == pytest.approx(5e-4)


def test_cooldown_follows_max_steps_when_the_steps_run_out_first():
    get_lr = load_get_lr(schedule='inverse_sqrt', lr=1e-3, warmup=100, cooldown=0.5, max_steps=800, max_minutes=600.0)
    assert get_lr(400, elapsed=60) == pytest.approx(5e-4)  # half of max_steps: cooldown starts
    assert get_lr(600, elapsed=60) == pytest.approx(1e-3 * (100 / 600) ** 0.5 * 0.5)
    assert get_lr(800, elapsed=60) == 0.0
    assert get_lr(400, elapsed=600 * 60 * 0.75) == pytest.approx(2.5e-4)  # the clock is further along: it rules


@pytest.mark.parametrize('args,message', [
    (['--no_such_key=1'], "unknown setting 'no_such_key'"),
    (['--max_steps=ten'], 'max_steps must be int'),
    (['--dropout=True'], 'dropout must be float'),
    (['--max_steps'], 'expected --key=value'),
    (['config/none.py'], 'config file config/none.py not found'),
    (['--data_dir=does/not/exist'], 'python data_prep.py'),
    (['--data_dir=nowhere/wmt14_en_fr'], 'python data_prep.py wmt14 --src en --tgt fr --out nowhere/wmt14_en_fr'),
    (['--update_freq=0'], 'update_freq must be at least 1'),
    (['--warmup=0'], 'warmup must be at least 1'),
    (['--d_model=30', '--n_heads=4'], 'd_model=30 must be a multiple of n_heads=4'),
    (['--dtype=float64'], "dtype must be 'auto'"),
    (['--cooldown=2'], 'cooldown must be between 0 and 1'),
    (['--dropout=1.5'], 'dropout must be at least 0 and below 1'),
    (['--label_smoothing=1.0'], 'label_smoothing must be at least 0 and below 1'),
    (['--max_bad_steps=0'], 'max_bad_steps must be at least 1'),
    (['--beta1=1.5'], 'beta1 must be at least 0 and below 1'),
    (['--lr=-0.5'], 'lr must be at least 0'),
    (['--lr_scale=-1.0'], 'lr_scale must be at least 0'),
    (['--adam_eps=-1.0'], 'adam_eps must be at least 0'),
    (['--weight_decay=-1.0'], 'weight_decay must be at least 0'),
    (['--save_interval=-1'], 'save_interval must be at least 0'),
    (['--max_minutes=-1.0'], 'max_minutes must be at least 0'),
    (['--bleu_interval=-2'], 'bleu_interval must be at least -1'),
    (['--schedule=cosine'], "schedule must be 'noam' or 'inverse_sqrt'"),
    (['--device=cpux'], "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    (['--t_process=0.0'], "unknown setting 't_process'"),
    (['--seed=-1'], 'seed must be at least 0 and below 2**63'),
    (['--ddp_timeout_minutes=1e308'], 'ddp_timeout_minutes must be'),
    (['--ddp_timeout_minutes=1e-9'], 'ddp_timeout_minutes must be'),
    (['--seed=18446744073709551616'], 'seed must be at least 0 and below 2**63'),
])
def test_bad_settings_give_clear_errors(args, message, tmp_path):
    # an out_dir of its own: the default one may hold a finished run in a working checkout
    res = subprocess.run([sys.executable, 'train.py', f'--out_dir={tmp_path}/run'] + args, cwd=HERE,
                         capture_output=True, text=True)
    assert res.returncode != 0
    assert message in res.stderr and 'Traceback' not in res.stderr
    assert not os.path.exists(os.path.join(tmp_path, 'run', 'log.jsonl'))  # no run left behind to block the next


def test_unknown_key_in_config_file_is_named(tmp_path):
    cfg = tmp_path / 'bad.py'
    cfg.write_text('d_model = 256\nlearning_rate = 1e-3\n')
    res = subprocess.run([sys.executable, 'train.py', str(cfg)], cwd=HERE, capture_output=True, text=True)
    assert res.returncode != 0 and "unknown setting 'learning_rate'" in res.stderr and str(cfg) in res.stderr


def test_config_file_mistakes_name_the_file_and_line(tmp_path):
    (tmp_path / 'folder.py').mkdir()
    for name, text, message in [('syntax.py', 'd_model = 256\nlr = (1e-3\n', 'line 2: SyntaxError'),
                                ('name.py', 'd_model = 256\n\nd_ff = 4 * dmodel\n', "line 3: NameError: name 'dmodel'"),
                                ('folder.py', None, 'Is a directory')]:
        if text is not None:
            (tmp_path / name).write_text(text)
        res = subprocess.run([sys.executable, 'train.py', str(tmp_path / name)], cwd=HERE, capture_output=True, text=True)
        assert res.returncode != 0 and 'Traceback' not in res.stderr, res.stderr
        assert f'config file {tmp_path / name}' in res.stderr and message in res.stderr, res.stderr


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


def test_validation_text_files_of_unequal_length_are_a_one_line_error_before_training(data_dir, tmp_path):
    shutil.copytree(data_dir, tmp_path / 'data')
    ref = tmp_path / 'data' / 'valid.yy.txt'
    ref.write_text(''.join(ref.read_text().splitlines(keepends=True)[:-1]))
    res = train(['--max_steps=1', '--bleu_interval=0'], tmp_path / 'run', tmp_path / 'data', ok=False)
    assert 'valid.xx.txt has 40 lines, valid.yy.txt 39' in res.stderr and 'step 1 ' not in res.stdout


def test_resume_writes_the_snapshot_a_run_killed_after_its_state_did_not(data_dir, tmp_path):
    train(['--max_steps=4', '--save_interval=2'], tmp_path, data_dir)
    os.remove(tmp_path / 'ckpt_0000004.pt')  # killed while writing it, just after state_0000004.pt
    res = train(['--max_steps=4', '--init_from=resume'], tmp_path, data_dir)
    assert 'averaged 2 checkpoint(s)' in res.stdout
    state = torch.load(tmp_path / 'state_0000004.pt', weights_only=False)
    for k, v in final_params(tmp_path, 4).items():
        assert torch.equal(v, state['model'][k]), k


def other_training_pairs(folder):
    """The tokenizer of the run, other training pairs (its validation set's), as data_prep.py would write them."""
    for ext in ('bin', 'idx'):
        for lang in ('xx', 'yy'):
            shutil.copy(folder / f'valid.{lang}.{ext}', folder / f'train.{lang}.{ext}')
    meta = json.loads((folder / 'meta.json').read_text())
    (folder / 'meta.json').write_text(json.dumps({**meta, 'splits': {**meta['splits'], 'train': meta['splits']['valid']}}))


def test_resume_on_other_training_data_with_the_same_tokenizer_is_refused(data_dir, tmp_path):
    train(['--max_steps=2', '--save_interval=2'], tmp_path / 'run', data_dir)
    shutil.copytree(data_dir, tmp_path / 'copy')
    train(['--max_steps=3', '--init_from=resume'], tmp_path / 'run', tmp_path / 'copy')  # the same data elsewhere
    other = tmp_path / 'other'
    shutil.copytree(data_dir, other)
    other_training_pairs(other)
    res = train(['--max_steps=4', '--init_from=resume'], tmp_path / 'run', other, ok=False)
    assert f"data_dir='{other}' (the run's: '{tmp_path / 'copy'}', other training pairs)" in res.stderr


def test_fine_tuning_from_a_folder_names_no_option_train_py_lacks(data_dir, tmp_path):
    res = train(['--max_steps=1', f'--init_from={tmp_path}'], tmp_path / 'run', data_dir, ok=False)
    assert 'is a folder' in res.stderr and '--average-last' not in res.stderr and '--init_from=resume' in res.stderr


def test_resume_keeps_the_best_checkpoint_unless_a_better_one_comes(data_dir, tmp_path):
    train(['--max_steps=2', '--save_interval=2', '--bleu_interval=0'], tmp_path, data_dir)
    best = torch.load(tmp_path / 'ckpt_best.pt', weights_only=False)
    assert best['valid_bleu'] == records(tmp_path, 'valid_bleu')[-1]['valid_bleu']  # the final average's, after the state
    (tmp_path / 'ckpt_best.pt').write_bytes(b'damaged')  # a number to compare with: not worth stopping the run for
    res = train(['--max_steps=3', '--bleu_interval=0', '--init_from=resume'], tmp_path, data_dir)
    assert 'cannot read the valid_bleu of' in res.stdout
    best = torch.load(tmp_path / 'ckpt_best.pt', weights_only=False)
    assert best['step'] == 3
    torch.save({**best, 'valid_bleu': 100.0}, tmp_path / 'ckpt_best.pt')  # one no later model can beat
    train(['--max_steps=4', '--bleu_interval=0', '--init_from=resume'], tmp_path, data_dir)
    assert torch.load(tmp_path / 'ckpt_best.pt', weights_only=False)['step'] == 3


def test_resume_on_data_prepared_again_in_the_same_folder_is_refused(data_dir, tmp_path):
    shutil.copytree(data_dir, tmp_path / 'data')
    train(['--max_steps=2', '--save_interval=2'], tmp_path / 'run', tmp_path / 'data')
    other = tmp_path / 'data'  # prepared again in place, e.g. with another --max-len: other training pairs
    other_training_pairs(other)
    res = train(['--max_steps=4', '--init_from=resume'], tmp_path / 'run', other, ok=False)
    assert f'{other} holds other training pairs than {tmp_path / "run"} was trained on' in res.stderr


def test_resume_says_which_training_settings_changed(data_dir, tmp_path):
    train(['--max_steps=2', '--save_interval=2'], tmp_path, data_dir)
    res = train(['--max_steps=3', '--init_from=resume', '--lr=0.002', '--label_smoothing=0.0'], tmp_path, data_dir)
    said = next(line for line in res.stdout.splitlines() if line.startswith('settings changed since state_0000002.pt: '))
    assert 'lr=0.002 (was 0.001)' in said and 'label_smoothing=0.0 (was 0.1)' in said and 'max_steps=3 (was 2)' in said


def test_two_process_resume_keeps_the_training_time_already_spent(data_dir, tmp_path):
    train(['--max_steps=2', '--save_interval=2'], tmp_path, data_dir, nproc=2)
    state = torch.load(tmp_path / 'state_0000002.pt', weights_only=False)
    torch.save({**state, 'elapsed': 100.0}, tmp_path / 'state_0000002.pt')
    train(['--max_steps=3', '--save_interval=1', '--init_from=resume'], tmp_path, data_dir, nproc=2)
    assert torch.load(tmp_path / 'state_0000003.pt', weights_only=False)['elapsed'] >= 100.0  # not a clock of 0


def test_fine_tuning_reads_checkpoints_as_translate_py_does(data_dir, tmp_path):
    train(['--max_steps=1'], tmp_path / 'a', data_dir)
    ckpt = torch.load(tmp_path / 'a' / 'ckpt.pt', weights_only=False)
    torch.save({**ckpt, 'tokenizer': os.path.join(data_dir, 'tokenizer.json')}, tmp_path / 'path_tokenizer.pt')
    train(['--max_steps=1', f'--init_from={tmp_path / "path_tokenizer.pt"}'], tmp_path / 'b', data_dir)
    torch.save({**ckpt, 'tokenizer': str(tmp_path / 'gone.json')}, tmp_path / 'lost_tokenizer.pt')
    res = train(['--max_steps=1', f'--init_from={tmp_path / "lost_tokenizer.pt"}'], tmp_path / 'e', data_dir, ok=False)
    assert 'lost_tokenizer.pt: cannot read its tokenizer' in res.stderr and 'gone.json' in res.stderr
    torch.save({**ckpt, 'model_cfg': {**ckpt['model_cfg'], 'rope': True}}, tmp_path / 'odd_cfg.pt')
    res = train(['--max_steps=1', f'--init_from={tmp_path / "odd_cfg.pt"}'], tmp_path / 'c', data_dir, ok=False)
    assert 'odd_cfg.pt: model_cfg does not fit model.Config' in res.stderr
    torch.save({**ckpt, 'model': {k: v for k, v in ckpt['model'].items() if 'ffn' not in k}}, tmp_path / 'part.pt')
    res = train(['--max_steps=1', f'--init_from={tmp_path / "part.pt"}'], tmp_path / 'd', data_dir, ok=False)
    assert 'part.pt: weights do not fit its model_cfg' in res.stderr


def test_two_process_timed_saves_are_one_each_time(data_dir, tmp_path):
    # The save vote is all-reduced one step late: the step that saves had already voted to save again.
    train(['--max_steps=150', '--save_minutes=0.02', '--keep_last=1000', '--keep_state=1000'], tmp_path, data_dir,
          nproc=2)
    steps = [int(os.path.basename(p)[5:-3]) for p in translate.checkpoints(str(tmp_path))][:-1]  # not the last step's
    assert steps and all(b - a > 1 for a, b in zip(steps, steps[1:])), steps


def test_rank_set_without_a_launcher_is_a_one_line_error(tmp_path):
    res = subprocess.run([sys.executable, 'train.py', f'--out_dir={tmp_path}/run'], cwd=HERE, capture_output=True,
                         text=True, env=dict(os.environ, RANK='0'))
    assert res.returncode != 0 and 'torchrun' in res.stderr and 'Traceback' not in res.stderr, res.stderr


def test_a_damaged_snapshot_is_found_when_the_resume_starts_not_after_it_trained(data_dir, tmp_path):
    train(['--max_steps=4', '--save_interval=2'], tmp_path, data_dir)
    (tmp_path / 'ckpt_0000002.pt').write_bytes(b'damaged')  # the final average would read it
    res = train(['--max_steps=6', '--init_from=resume'], tmp_path, data_dir, ok=False)
    assert 'ckpt_0000002.pt' in res.stderr and 'step 5 ' not in res.stdout, res.stdout[-500:]
