"""
Tests for train.py, run as users run it on a toy corpus that data_prep.py prepares once: a process
of its own, forked from a server that has imported torch (forkserver.py), or torchrun's processes.
Runs that several tests read are module fixtures; each test copies what it changes. Functions of
train.py that need no run (the configurator, the schedule) are loaded from its source, and the
checks that refuse a run are called in-process where one run shows the refusal end to end.
"""

import ast
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import checkpoint
import cluster
import model as M
import configurator
import data_prep
import dataset
import forkserver
import speed
import translate
from test_translate import reading

pytestmark = pytest.mark.both_cores  # its runs start two at a time: after the other files
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the root: the scripts
TINY = [
    '--n_enc_layers=1',
    '--n_dec_layers=1',
    '--d_model=32',
    '--d_ff=64',
    '--n_heads=4',
    '--max_tokens=256',
    '--log_interval=1',
    '--eval_interval=0',
    '--bleu_interval=-1',
    '--save_interval=0',
    '--compile=False',
    '--schedule=inverse_sqrt',
    '--lr=1e-3',
    '--warmup=10',
    '--device=cpu',
    '--dtype=float32',
]
SPLITS = (('train', 1200, 2, 12), ('valid', 40, 2, 12), ('test', 40, 2, 12))


def toy_corpus(root, seed=0, tokenizer=None, sizes=SPLITS):
    """A toy parallel corpus (word-for-word substitution, reversed) prepared by data_prep.py, with
    a BPE of its own or the given --tokenizer's -> its folder."""
    rng = random.Random(seed)
    words = [f'w{i}' for i in range(40)]
    for split, n, lo, hi in sizes:
        src = [[rng.choice(words) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
        tgt = [['v' + w[1:] for w in s[::-1]] for s in src]
        (root / f'{split}.xx').write_text(''.join(' '.join(s) + '\n' for s in src))
        (root / f'{split}.yy').write_text(''.join(' '.join(t) + '\n' for t in tgt))
    out = root / 'data'
    bpe = ['--vocab-size', '300']
    if tokenizer:
        bpe = ['--tokenizer', str(tokenizer)]
    splits = []
    for split in ('train', 'valid', 'test'):
        splits += [f'--{split}', str(root / split)]
    # In-process, as conftest.py prepares Multi30k: a process would cost a second of imports.
    data_prep.main(['custom', *splits, '--src', 'xx', '--tgt', 'yy', *bpe, '--out', str(out)])
    return str(out)


@pytest.fixture(scope='module')
def data_dir(toy_data):  # conftest.py's: the toy corpus above, shared with dev/test_gpu.py
    return toy_data


TWO = ['--dropout=0.3', '--save_interval=3']  # the two-process runs'


def free_port():
    with socket.socket() as s:  # torchrun's --master_port=0 hangs the static rendezvous
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def start(args, out_dir, data_dir, nproc=1, launcher=None):
    """train.py with TINY's settings and args, started -> the running process: under torchrun for
    nproc > 1; else on the CPU forked from a server that has imported torch (forkserver.py), on a
    GPU (dev/test_gpu.py) a new process, as the GPU check runs it."""
    cmd = ['train.py', *TINY, f'--data_dir={data_dir}', f'--out_dir={out_dir}', *args]
    env = dict(os.environ, OMP_NUM_THREADS='1')
    on_gpu = any(arg.startswith('--device=cuda') for arg in args)
    if nproc == 1 and not on_gpu:
        if launcher is not None:  # a wrapper, [python, '-c', WRAPPER]: -c WRAPPER train.py ...
            cmd = [*launcher[1:], *cmd]
        return forkserver.server().start(cmd, HERE, env)
    if launcher is None and nproc == 1:
        launcher = [sys.executable]
    if launcher is None:
        launcher = [sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={nproc}',
                    f'--master_port={free_port()}']
    return subprocess.Popen([*launcher, *cmd], cwd=HERE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finish(proc, ok=True):
    """Waits for a process of start() -> its CompletedProcess. ok: it must succeed; else it must
    fail with an error of its own, no traceback."""
    out, err = proc.communicate(timeout=600)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if ok:
        assert res.returncode == 0, out[-2000:] + err[-3000:]
    else:
        assert res.returncode != 0, err[-3000:]
        assert 'Traceback' not in err, err[-3000:]
    return res


def train(args, out_dir, data_dir, nproc=1, ok=True, launcher=None):
    return finish(start(args, out_dir, data_dir, nproc, launcher), ok)


def refused(*runs):
    """train.py runs [(args, out_dir, data_dir)] that must each stop with one line and no
    traceback, started together on the two cores -> their stderr."""
    procs = [start(args, out_dir, data_dir) for args, out_dir, data_dir in runs]
    errs = []
    for proc in procs:
        err = finish(proc, ok=False).stderr
        assert len(err.strip().splitlines()) == 1, err
        errs.append(err)
    return errs


def in_process_refusal(check, *args):
    """check(*args), one of the checks train.py runs before any work, must stop it as train.py
    stops: sys.exit with one line -> the line."""
    with pytest.raises(SystemExit) as e:
        check(*args)
    message = str(e.value)
    assert '\n' not in message, message
    return message


def params(out_dir, name):
    return torch.load(os.path.join(out_dir, name), weights_only=True)['model']


def records(out_dir, key):
    with open(os.path.join(out_dir, 'log.jsonl')) as f:
        return [r for r in map(json.loads, f) if key in r]


def losses(out_dir):
    return [r['loss'] for r in records(out_dir, 'loss')]


def assert_same_params(a, b):
    for k in a:
        assert torch.equal(a[k], b[k]), k


ONE = ['--max_steps=4', '--dropout=0.0', '--save_interval=1', '--bleu_interval=0',
       '--schedule=constant', '--warmup=1', '--lr=0.01']
# train.py run by a wrapper: `python -c WRAPPER train.py ARGS`.
def wrapped(wrapper):
    return [sys.executable, '-c', wrapper]


CHECKPOINT_COUNTED = (  # train.py with torch.utils.checkpoint counting its calls
    "import os, runpy, sys, torch.utils.checkpoint as c\n"
    "f, calls, leave = c.checkpoint, [], os._exit  # os._exit: train.py's last line\n"
    "c.checkpoint = lambda *a, **k: calls.append(1) or f(*a, **k)\n"
    "os._exit = lambda code: print('checkpointed layer calls', len(calls), flush=True)"
    " or leave(code)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path('train.py', run_name='__main__')\n"
)
# Compiled with dynamo's 'eager' backend, and each line it prints says how many graphs were
# compiled by then.
GRAPHS_COUNTED = (
    "import runpy, sys, torch\n"
    "from torch._dynamo.utils import counters\n"
    "torch._dynamo.config.fail_on_recompile_limit_hit = True\n"
    "compile, module_compile = torch.compile, torch.nn.Module.compile\n"
    "torch.compile = lambda fn, **kw: compile(fn, **{**kw, 'backend': 'eager'})\n"
    "torch.nn.Module.compile = lambda self, **kw: module_compile(self,"
    " **{**kw, 'backend': 'eager'})\n"
    "import builtins\n"
    "say = print\n"
    "builtins.print = lambda *a, **k: say(*a, 'graphs', counters['stats']['unique_graphs'],"
    " **k)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path('train.py', run_name='__main__')\n"
)
FLOAT32_CPU = ("import runpy, sys, speed\n"  # an AVX2-only CPU: dtype 'auto' is float32
               "speed.fast_dtype = lambda device_type: 'float32'\n"
               "sys.argv = sys.argv[1:]\n"
               "runpy.run_path('train.py', run_name='__main__')\n")
# train.py's cuda_graphs path on the CPU: the capture is the callable itself, and attention within
# each packed sentence is speed.attend's CPU path.
GRAPHS_MOCKED = ("import runpy, sys, torch, speed\n"
                 "speed.check_settings = lambda *args: None\n"
                 "torch.cuda.make_graphed_callables = lambda body, inputs: body\n"
                 "sys.argv = sys.argv[1:]\n"
                 "runpy.run_path('train.py', run_name='__main__')\n")
HEADS_CHECKED = ("import runpy, sys, speed\n"
                 "def refuse(cfg, cuda_graphs):  # with the head size it is given\n"
                 "    sys.exit(f'head size {cfg.d_head or cfg.d_model // cfg.n_heads}')\n"
                 "speed.check_heads = refuse\n"
                 "sys.argv = sys.argv[1:]\n"
                 "runpy.run_path('train.py', run_name='__main__')\n")
# Ctrl-C as the end's averaging begins, after the loop's last look for a stop signal.
INTERRUPTED_AT_THE_END = ("import os, runpy, signal, sys, checkpoint\n"
                          "average = checkpoint.average_checkpoints\n"
                          "def interrupted(paths):\n"
                          "    os.kill(os.getpid(), signal.SIGINT)\n"
                          "    return average(paths)\n"
                          "checkpoint.average_checkpoints = interrupted\n"
                          "sys.argv = sys.argv[1:]\n"
                          "runpy.run_path('train.py', run_name='__main__')\n")
NO_DROPOUT = ['--max_steps=5', '--dropout=0.0']
LEARNED = ['--positions=learned', '--n_heads=3', '--d_head=4', '--save_interval=2',
           '--keep_state=2', '--dropout=0.1']
# The runs that the fixtures below and the tests named read: (args, processes, launcher).
SHARED = {
    'run': (['--max_steps=6', '--save_interval=3', '--dropout=0.1', '--bleu_interval=0'], 1, None),
    'one': (ONE + ['--update_freq=2'], 1, None),
    'two': (TWO + ['--max_steps=6', '--keep_state=2'], 2, None),
    'test_activation_checkpointing_trains_the_same_steps': (
        ['--max_steps=6', '--save_interval=3', '--dropout=0.1', '--bleu_interval=0',
         '--checkpoint_activations=True'], 1, wrapped(CHECKPOINT_COUNTED)),
    'test_learned_positions_and_d_head_are_trained_saved_averaged_and_resumed': (
        LEARNED + ['--max_steps=4'], 1, None),
    'test_a_streak_of_non_finite_updates_stops_the_run': (
        ['--max_steps=20', '--lr=1e38', '--warmup=1', '--max_bad_steps=3'], 1, None),
    'test_compiled_training_does_not_recompile_per_batch_shape': (
        ['--max_steps=40', '--compile=True', '--eval_interval=4', '--bleu_interval=0'], 1,
        wrapped(GRAPHS_COUNTED)),
    'padded': (NO_DROPOUT, 1, None),
    'test_the_cuda_graphs_path_trains_as_padded_batches_do': (
        NO_DROPOUT + ['--cuda_graphs=True'], 1, wrapped(GRAPHS_MOCKED)),
    'test_master_weights_are_checked_against_the_dtype_auto_picks': (
        ['--dtype=auto', '--master_weights=True'], 1, wrapped(FLOAT32_CPU)),
}


@pytest.fixture(scope='module')
def shared(request, data_dir, tmp_path_factory, selected):
    """The runs of SHARED that the selected tests use, started together on the two cores
    -> {name: (its out_dir, its process)}."""
    started = {}
    for name, (args, nproc, launcher) in SHARED.items():
        if name in selected[request.module]:
            out = tmp_path_factory.mktemp(name[:30]) / 'run'
            started[name] = out, start(args, out, data_dir, nproc, launcher)
    yield started
    for _, proc in started.values():  # those a failed fixture left
        proc.kill()
        proc.wait()


@pytest.fixture
def solo(request, shared):
    """The test's own run of SHARED -> (its out_dir, its process)."""
    return shared[request.node.originalname]


@pytest.fixture(scope='module')
def run(shared):
    """6 steps with dropout, a snapshot and a state every 3: what most tests copy, resume or
    fine-tune."""
    out, proc = shared['run']
    return out, finish(proc)


def copy_run(run, tmp_path):
    shutil.copytree(run[0], tmp_path / 'run')
    return tmp_path / 'run'


def test_a_run_logs_progress_and_writes_snapshots_a_state_and_their_average(run):
    out, res = run
    assert 'tgt tok/s' in res.stdout and 'ETA' in res.stdout
    # keep_state=1: the older state is gone
    assert sorted(os.listdir(out)) == ['ckpt.pt', 'ckpt_0000003.pt', 'ckpt_0000006.pt',
                                       'ckpt_best.pt', 'log.jsonl', 'state_0000006.pt']
    assert 'optimizer' not in torch.load(out / 'ckpt_0000003.pt', weights_only=True)
    snapshots = [str(out / 'ckpt_0000003.pt'), str(out / 'ckpt_0000006.pt')]
    avg = checkpoint.average_checkpoints(snapshots)
    assert_same_params(avg, params(out, 'ckpt.pt'))
    model, enc, ckpt = checkpoint.load_checkpoint(str(out / 'ckpt.pt'), 'cpu')
    assert ckpt['step'] == 6 and ckpt['config']['max_steps'] == 6
    assert ckpt['model_cfg']['tokenizer_size'] == enc.n_vocab  # the ids past it are never decoded
    assert len(list(translate.translate_lines(model, enc, ['w1 w2 w3'], beam=2))) == 1
    # The final evaluation's BLEU, which it holds.
    best = torch.load(out / 'ckpt_best.pt', weights_only=True)
    assert best['valid_bleu'] == records(out, 'valid_bleu')[-1]['valid_bleu']


def test_resume_is_exact(run, data_dir, tmp_path):
    out = copy_run(run, tmp_path)
    for f in ('ckpt.pt', 'ckpt_best.pt', 'ckpt_0000006.pt', 'state_0000006.pt'):
        os.remove(out / f)
    # The state of step 3 as the run wrote it: a run of 3 steps writes the same state.
    train(['--max_steps=3', '--save_interval=3', '--dropout=0.1', '--overwrite=True'], out,
          data_dir)
    state = torch.load(out / 'state_0000003.pt', weights_only=False)
    for key in ('positions', 'd_head'):  # as a state saved before these settings existed
        del state['config'][key], state['model_cfg'][key]
    torch.save(state, out / 'state_0000003.pt')
    # Killed after the state, before its snapshot: the resume writes it.
    (out / 'ckpt_0000003.pt').unlink()
    args = ['--max_steps=6', '--save_interval=3', '--dropout=0.1', '--init_from=resume',
            '--bleu_interval=0']
    train(args, out, data_dir)
    assert losses(out) == losses(run[0])
    assert_same_params(params(out, 'ckpt_0000006.pt'), params(run[0], 'ckpt_0000006.pt'))
    # The step-3 snapshot was written, with a snapshot's keys.
    assert_same_params(params(out, 'ckpt.pt'), params(run[0], 'ckpt.pt'))
    written = torch.load(os.path.join(run[0], 'ckpt_0000003.pt'), weights_only=False)
    assert torch.load(out / 'ckpt_0000003.pt', weights_only=False).keys() == written.keys()


def test_activation_checkpointing_trains_the_same_steps(run, solo):
    # Backward recomputes each layer's forward, dropout masks included: the same losses and weights.
    out, proc = solo
    res = finish(proc)
    calls = int(res.stdout.split('checkpointed layer calls')[1])
    assert calls >= 6 * 2  # 6 steps of 1+1 layers at least
    assert losses(out) == losses(run[0])
    assert_same_params(params(out, 'ckpt_0000006.pt'), params(run[0], 'ckpt_0000006.pt'))


@pytest.fixture(scope='module')
def one(shared):
    """4 steps of one process with update_freq 2, no dropout, a snapshot each: two processes'
    reference."""
    out, proc = shared['one']
    finish(proc)
    return out, ONE


def test_ddp_two_processes_equal_one_process_with_update_freq_2(one, data_dir, tmp_path):
    # Validation is split across the ranks: its loss and BLEU must still be those of one process.
    res = train(one[1], tmp_path, data_dir, nproc=2)
    assert 'Warning' not in res.stderr  # nor DDP's, per rank
    a, b = params(one[0], 'ckpt_0000004.pt'), params(tmp_path, 'ckpt_0000004.pt')
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)
    # The logged training loss too: over both ranks' tokens, not rank 0's times two.
    assert losses(tmp_path) == pytest.approx(losses(one[0]), rel=1e-5)
    (va,), (vb,) = records(one[0], 'valid_bleu'), records(tmp_path, 'valid_bleu')
    assert va['valid_bleu'] == vb['valid_bleu']
    assert va['valid_loss'] == pytest.approx(vb['valid_loss'], rel=1e-5)


def test_master_weights_train_a_bf16_copy_as_float32_training_does(one, data_dir, tmp_path):
    # The copy in bf16 runs the steps, the float32 weights take Adam's first step whole,
    # lr * sign(g) (bf16 weights would round it), each step's new weights reach the copy, and both
    # ranks start from rank 0's float32 weights: float32's losses to bf16's rounding (at step 2
    # 4.753 against 4.752; 5.799 without the copy back, 5.487 with each rank's own start;
    # 2026-12-01).
    train(one[1] + ['--dtype=bfloat16', '--master_weights=True'], tmp_path, data_dir, nproc=2)
    assert losses(tmp_path) == pytest.approx(losses(one[0]), abs=0.02)
    a, b = params(one[0], 'ckpt_0000001.pt'), params(tmp_path, 'ckpt_0000001.pt')
    # 0, or 1, 2 where gradients' signs differ
    steps = torch.cat([(b[k] - a[k]).flatten() for k in a]) / 0.01
    whole = (steps - steps.round()).abs() < 0.01
    assert whole.float().mean() > 0.99  # 0.997; the rest: |g| near eps


@pytest.fixture(scope='module')
def two(shared):
    """6 steps of two processes with dropout, a state every 3, both kept: what the resumed,
    stopped, restarted and two-node runs must end equal to."""
    out, proc = shared['two']
    finish(proc)
    return out


def test_two_process_resume_is_exact_and_keeps_the_time_spent(two, data_dir, tmp_path):
    # The run's state of step 3, as if it had stopped there after 100 s.
    out = tmp_path / 'split'
    shutil.copytree(two, out)
    for f in ('ckpt.pt', 'ckpt_0000006.pt', 'state_0000006.pt'):
        os.remove(out / f)
    state = torch.load(out / 'state_0000003.pt', weights_only=False)
    torch.save({**state, 'elapsed': 100.0}, out / 'state_0000003.pt')
    train(TWO + ['--max_steps=6', '--init_from=resume'], out, data_dir, nproc=2)
    assert_same_run(out, two)
    assert torch.load(out / 'state_0000006.pt', weights_only=False)['elapsed'] >= 100.0


def assert_same_run(out, reference):
    assert losses(out) == losses(reference)
    assert_same_params(params(out, 'ckpt_0000006.pt'), params(reference, 'ckpt_0000006.pt'))


def test_learned_positions_and_d_head_are_trained_saved_averaged_and_resumed(data_dir, tmp_path,
                                                                            solo):
    # Table 3's rows (E) and (B) as settings (LEARNED): the learned table trains, and the
    # checkpoints, their average and a resume hold it and the Config (h 3 x d_k 4 = 12, under
    # d_model 32, which 3 does not divide).
    finish(solo[1])
    shutil.copytree(solo[0], tmp_path / 'a')
    model, _, ckpt = checkpoint.load_checkpoint(str(tmp_path / 'a' / 'ckpt.pt'))
    assert (ckpt['model_cfg']['positions'], ckpt['model_cfg']['d_head']) == ('learned', 4)
    assert model.decoder[0].self_attn.qkv_proj.weight.shape == (3 * 12, 32)
    two = params(tmp_path / 'a', 'ckpt_0000002.pt')
    four = params(tmp_path / 'a', 'ckpt_0000004.pt')
    assert not torch.equal(two['pe'], four['pe'])
    snapshots = [str(tmp_path / 'a' / f'ckpt_000000{s}.pt') for s in (2, 4)]
    average = checkpoint.average_checkpoints(snapshots)
    assert_same_params(average, params(tmp_path / 'a', 'ckpt.pt'))
    shutil.copytree(tmp_path / 'a', tmp_path / 'b')
    for f in ('ckpt.pt', 'ckpt_0000004.pt', 'state_0000004.pt'):
        os.remove(tmp_path / 'b' / f)
    train(LEARNED + ['--max_steps=4', '--init_from=resume'], tmp_path / 'b', data_dir)
    assert_same_params(params(tmp_path / 'b', 'ckpt_0000004.pt'), four)


def test_a_used_out_dir_is_refused_unless_overwrite_which_waits_for_every_input(run, data_dir,
                                                                                tmp_path):
    outs = [tmp_path / str(i) for i in range(4)]  # each its own copy: the runs go at once
    for out in outs:
        shutil.copytree(run[0], out)
    # Fine-tuning from an out_dir's own checkpoint into it, starting over; meanwhile the used
    # out_dir, then --overwrite with a mistake found later (a typo, too few batches): each refused.
    tuned = outs[3]
    fine_tune = start(['--max_steps=1', '--overwrite=True', f'--init_from={tuned / "ckpt.pt"}'],
                      tuned, data_dir)
    err, _, too_few = refused(
        (['--max_steps=2'], outs[0], data_dir),
        (['--max_steps=1', '--overwrite=True'], outs[1], tmp_path / 'typo'),
        (['--max_steps=1', '--overwrite=True', '--update_freq=1000'], outs[2], data_dir))
    finish(fine_tune)
    assert str(outs[0]) in err and '--init_from=resume' in err and '--overwrite=True' in err
    assert '1 process(es) x update_freq 1000' in too_few
    for out in outs[:3]:
        assert len(records(out, 'loss')) == 6 and os.path.exists(out / 'ckpt.pt')
    assert [r['step'] for r in records(tuned, 'loss')] == [1]
    assert checkpoint.checkpoints(str(tuned)) == [str(tuned / 'ckpt_0000001.pt')]


def test_the_same_command_starts_over_a_run_killed_before_its_first_state(run, data_dir,
                                                                          tmp_path):
    # Killed (SIGKILL: no state saved on the way out) after a log line, and after validation BLEU
    # wrote ckpt_best.pt.
    for names in (['log.jsonl'], ['log.jsonl', 'ckpt_best.pt']):
        out = tmp_path / str(len(names))
        out.mkdir()
        for name in names:
            shutil.copy(os.path.join(run[0], name), out / name)
        res = train(SHARED['run'][0], out, data_dir)
        assert 'of a run that saved no state: starting over' in res.stdout
        assert losses(out) == losses(run[0])


def test_a_run_into_an_out_dir_another_run_is_using_is_refused(data_dir, tmp_path):
    first = start(['--max_steps=100000'], tmp_path, data_dir)
    try:
        deadline = time.time() + 60
        log = tmp_path / 'log.jsonl'
        while not log.exists() or '"loss"' not in log.read_text():  # training: past every check
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.05)
        res = train(['--max_steps=2', '--init_from=resume'], tmp_path, data_dir, ok=False)
        assert 'in use by another train.py run' in res.stderr
    finally:
        first.kill()
        first.communicate()


@pytest.fixture(scope='module')
def other_data_dir(tmp_path_factory):
    # The same sizes, another corpus: another BPE of as many tokens.
    return toy_corpus(tmp_path_factory.mktemp('other'), seed=1)


def test_resume_or_fine_tune_with_another_tokenizer_is_refused(run, data_dir, other_data_dir,
                                                               tmp_path):
    vocab_size = dataset.load_meta(data_dir)['vocab_size']
    assert vocab_size == dataset.load_meta(other_data_dir)['vocab_size']
    out = copy_run(run, tmp_path)
    resume, tune = refused(
        (['--init_from=resume'], out, other_data_dir),
        ([f'--init_from={out / "ckpt.pt"}'], tmp_path / 'b', other_data_dir),
    )
    assert 'another tokenizer' in resume and 'state_0000006.pt' in resume
    assert 'another tokenizer' in tune and 'ckpt.pt' in tune


def test_data_prepared_with_the_checkpoints_tokenizer_fine_tunes_it(run, tmp_path):
    # The README's recipe, another corpus.
    mine = toy_corpus(tmp_path, seed=1, tokenizer=run[0] / 'ckpt.pt')
    path = os.path.join(mine, 'tokenizer.json')
    with open(path) as f:
        renamed = json.load(f)
    with open(path, 'w') as f:  # the name is a label, not the tokenizer
        json.dump({**renamed, 'name': 'renamed'}, f)
    train(['--max_steps=1', f'--init_from={run[0] / "ckpt.pt"}'], tmp_path / 'b', mine)


def test_fine_tune_starts_from_the_checkpoint_weights_with_a_fresh_optimizer(run, data_dir,
                                                                             tmp_path):
    # lr 0: the new run's first state holds the source weights unchanged, at step 1, with a fresh
    # optimizer. The settings' d_model (TINY's 32 and 48 here) is the checkpoint's to decide, and
    # said; dropout (the run's 0.1, 0.3 here) is the new run's.
    args = ['--lr=0.0', '--d_model=48', '--n_heads=6', '--positions=learned', '--dropout=0.3']
    args += [f'--init_from={run[0] / "ckpt.pt"}']
    res = train(['--max_steps=1', '--save_interval=1'] + args, tmp_path / 'b', data_dir)
    new = torch.load(tmp_path / 'b' / 'state_0000001.pt', weights_only=False)
    assert "keeps the checkpoint's architecture" in res.stdout and new['config']['d_model'] == 32
    assert new['config']['positions'] == new['model_cfg']['positions'] == 'sinusoidal'
    assert new['config']['dropout'] == new['model_cfg']['dropout'] == 0.3
    assert_same_params(params(run[0], 'ckpt.pt'), new['model'])
    assert all(s['step'].item() == 1 for s in new['optimizer']['state'].values())
    # As it began.
    train(['--max_steps=2', '--init_from=resume'] + args[:-1], tmp_path / 'b', data_dir)
    ckpt = torch.load(tmp_path / 'b' / 'ckpt.pt', weights_only=True)
    assert ckpt['model_cfg']['d_model'] == 32


def test_weight_decay_is_decoupled_and_spares_gains_and_biases(run, data_dir, tmp_path):
    # One step from the same weights, the same batch and dropout, with and without decay: AdamW's
    # decay takes lr * wd * w off each matrix and leaves the Adam step as it was (an L2 term would
    # change it). The two runs go at once.
    lr, wd, init = 0.01, 0.5, run[0] / 'ckpt.pt'
    args = ['--max_steps=1', '--schedule=constant', '--warmup=1', f'--lr={lr}',
            f'--init_from={init}']
    procs = []
    for w in (0.0, wd):
        procs.append(start(args + [f'--weight_decay={w}'], tmp_path / str(w), data_dir))
    for proc in procs:
        finish(proc)
    w0 = params(run[0], 'ckpt.pt')
    plain = params(tmp_path / '0.0', 'ckpt.pt')
    decayed = params(tmp_path / str(wd), 'ckpt.pt')
    for k, w in w0.items():
        took = plain[k] - decayed[k]
        expected = torch.zeros_like(w)
        if w.dim() > 1:
            expected = lr * wd * w
        assert torch.allclose(took, expected, atol=1e-6), k


def test_resume_with_another_architecture_optimizer_or_batch_plan_is_refused(run, data_dir,
                                                                             tmp_path):
    out = copy_run(run, tmp_path)
    # seed and max_tokens make the batch plan the saved position indexes: another would skip or
    # repeat data. checkpoint.check_resume's refusal, end to end.
    args = ['--max_steps=8', '--init_from=resume', '--d_model=64', '--positions=learned',
            '--weight_decay=0.1', '--seed=7', '--max_tokens=300']
    res = train(args, out, data_dir, ok=False)
    for arg in ('d_model=64', "positions='learned'", 'weight_decay=0.1', 'seed=7',
                'max_tokens=300'):
        assert arg in res.stderr
    assert "(the run's:" in res.stderr and '--init_from=' in res.stderr


def other_training_pairs(folder):
    """The run's tokenizer, other training pairs (its validation set's), as data_prep.py would
    write them."""
    for ext in ('bin', 'idx'):
        for lang in ('xx', 'yy'):
            shutil.copy(folder / f'valid.{lang}.{ext}', folder / f'train.{lang}.{ext}')
    meta = json.loads((folder / 'meta.json').read_text())
    meta['splits']['train'] = meta['splits']['valid']
    (folder / 'meta.json').write_text(json.dumps(meta))


@pytest.fixture(scope='module')
def resumed(run, data_dir, tmp_path_factory):
    """The run resumed once for the four tests below: on a copy of its data, with update_freq 2 to
    the first step of epoch 1, a ckpt_best.pt no later model can beat and a state as if two
    processes had saved it -> (its out_dir, the data's copy, its stdout, epoch 0's last step)."""
    folder = tmp_path_factory.mktemp('resumed')
    out = copy_run(run, folder)
    copy = folder / 'copy'
    shutil.copytree(data_dir, copy)
    state = torch.load(out / 'state_0000006.pt', weights_only=False)
    torch.save({**state, 'rng': state['rng'] * 2}, out / 'state_0000006.pt')
    best = torch.load(out / 'ckpt_best.pt', weights_only=False)
    torch.save({**best, 'valid_bleu': 100.0}, out / 'ckpt_best.pt')
    n = len(dataset.batch_plan(dataset.load_split(data_dir, 'train'), 256, 1337, 0))
    last = 6 + (n - 6) // 2  # epoch 0's last step when batches 6, 7, ... are taken two at a time
    args = [f'--max_steps={last + 1}', '--update_freq=2', '--init_from=resume', '--dropout=0.1',
            '--bleu_interval=0']
    res = train(args, out, copy)
    return out, copy, res.stdout, last


def test_resume_on_other_training_data_is_refused_and_on_a_copy_goes_on(resumed, tmp_path):
    out, copy, stdout, last = resumed
    assert 'resuming from' in stdout
    assert [r['step'] for r in records(out, 'loss')][-1] == last + 1
    # Prepared again in place, e.g. with another --max-len: checkpoint.check_resume in-process
    # (another architecture shows its refusal end to end).
    other = tmp_path / 'other'
    shutil.copytree(copy, other)
    other_training_pairs(other)
    path = checkpoint.checkpoints(str(out), 'state')[-1]
    state = torch.load(path, weights_only=False)
    config = dict(state['config'], data_dir=str(other))
    train_split = dataset.load_meta(other)['splits']['train']
    check = checkpoint.check_resume
    message = in_process_refusal(check, state, config, None, train_split, str(out))
    assert 'other training pairs' in message and 'data_dir=' in message
    # In the run's own data_dir: say it was prepared again, not that the setting differs.
    config['data_dir'] = state['data_dir']
    message = in_process_refusal(check, state, config, None, train_split, str(out))
    pairs = (train_split['pairs'], state['train_split']['pairs'])
    assert "(prepared again since: %d training pairs, the run's: %d)" % pairs in message


def test_resume_with_another_number_of_processes_says_dropout_is_reseeded(resumed):
    _, _, stdout, _ = resumed
    assert 'resumed by 1 process(es), saved by 2: dropout is reseeded' in stdout


def test_resume_keeps_the_best_checkpoint_unless_a_better_one_comes(resumed):
    out, _, _, _ = resumed
    assert records(out, 'valid_bleu')[-1]['step'] > 6  # evaluated after the resume
    assert torch.load(out / 'ckpt_best.pt', weights_only=False)['step'] == 6


def test_resume_with_another_update_freq_continues_at_the_next_batch(resumed):
    out, _, _, last = resumed
    epochs = {r['step']: r['epoch'] for r in records(out, 'loss')}
    assert (epochs[last], epochs[last + 1]) == (0, 1)


def load_settings():
    """train.py's settings and their defaults, read from its source (they end where the
    configurator's `defaults, config = ...` reads them)."""
    with open(os.path.join(HERE, 'train.py')) as f:
        tree = ast.parse(f.read())
    settings = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        if not isinstance(node.targets[0], ast.Name):
            break
        name = node.targets[0].id
        if not name.startswith('_'):
            settings[name] = ast.literal_eval(node.value)
    return settings


def test_a_learning_rate_setting_the_schedule_does_not_read_gets_a_warning():
    settings = load_settings()
    cases = [(['--schedule=noam', '--lr=3e-3'], "lr=0.003 is not read by schedule='noam'"),
             (['--schedule=constant', '--lr_scale=2.0'], "lr_scale=2.0 is read by schedule='noam'"),
             (['--schedule=noam', '--lr_scale=2.0'], None),
             (['--schedule=constant', '--lr=3e-3'], None)]
    for flags, expected in cases:
        config = configurator.override(dict(settings), flags)
        unread = configurator.unread_settings(config, settings)
        if expected is None:
            assert unread == []
        else:
            assert len(unread) == 1 and expected in unread[0]


def test_bad_settings_missing_data_and_too_small_sizes_are_one_line_errors_before_any_work(
        data_dir, tmp_path):
    # Each check in-process, as train.py calls it; the last before the model is built end to end.
    settings = load_settings()
    message = in_process_refusal(configurator.override, dict(settings), ['--max_steps=ten'])
    assert 'max_steps must be int' in message
    mistakes = [('--dropout=1.5', 'dropout must be in [0, 1)'),
                ('--n_heads=3', 'n_heads must be a divisor of d_model'),
                ('--positions=rotary', "positions must be 'sinusoidal' or 'learned'"),
                ('--lr=1e999', 'lr must be a finite number, got inf'),
                ('--keep_last=2', 'average_last must be at most keep_last, the snapshots kept, '
                                  'got 5 > 2')]
    for flag, expected in mistakes:
        config = configurator.override(dict(settings), [*TINY, flag])
        assert expected in in_process_refusal(configurator.check_ranges, config)
    message = in_process_refusal(dataset.open_prepared, 'nowhere/wmt14_en_fr')
    assert 'no prepared data in nowhere/wmt14_en_fr: prepare it' in message
    splits = [dataset.load_split(data_dir, 'train'), dataset.load_split(data_dir, 'valid')]
    smallest = dataset.pair_sizes(splits[0]).min()
    message = in_process_refusal(dataset.check_sizes, *splits, smallest - 1, 1024, data_dir, print)
    assert f'raise it to at least {smallest}' in message
    problem = in_process_refusal(speed.check_settings, 'cpu', 'float32', True, False, 1, False)
    assert 'cuda_graphs needs a GPU' in problem
    # TINY's dtype
    problem = in_process_refusal(speed.check_settings, 'cpu', 'float32', False, True, 1, False)
    assert 'master_weights must be False with dtype float32' in problem
    (err,) = refused((['--max_len=8'], tmp_path, data_dir))
    assert 'max_len=8' in err
    assert not os.path.exists(tmp_path / 'log.jsonl')


def pairs(*lengths):
    """A split as load_split gives it, of pairs whose sides have these lengths."""
    ends = np.cumsum([0, *lengths])
    tokens = np.full(ends[-1], 7, dtype=np.uint16)
    return tokens, ends, tokens, ends


def test_validation_pairs_over_max_len_are_left_out_and_training_ones_refused(capsys):
    train_data, valid_data = pairs(3, 5), pairs(3, 9, 4)  # sizes (+ EOS): 4, 6 and 4, 10, 5
    dataset.check_sizes(train_data, valid_data, 12, 8, 'data', print)
    assert "1 validation pairs are over the model's max_len=8" in capsys.readouterr().out
    plan = dataset.batch_plan(valid_data, 12, 0, epoch=0, shuffle=False, max_len=8)
    assert sorted(i for batch in plan for i in batch) == [0, 2]
    message = in_process_refusal(dataset.check_sizes, valid_data, train_data, 12, 8, 'data', print)
    assert 'data has training sentences over the model' in message
    message = in_process_refusal(dataset.check_sizes, train_data, pairs(9), 12, 8, 'data', print)
    assert 'every validation pair of data is over' in message


def test_a_streak_of_non_finite_updates_stops_the_run(solo):  # lr 1e38
    res = finish(solo[1], ok=False)
    assert 'non-finite updates in a row' in res.stderr


def test_resume_counts_the_training_time_already_spent(run, data_dir, tmp_path):
    out = copy_run(run, tmp_path)
    state = torch.load(out / 'state_0000006.pt', weights_only=False)
    assert 0 < state['elapsed'] < 300
    # As if it had trained 10 minutes.
    torch.save({**state, 'elapsed': 600.0}, out / 'state_0000006.pt')
    args = ['--max_steps=50', '--max_minutes=5.0', '--init_from=resume', '--dropout=0.1']
    res = train(args, out, data_dir)
    assert checkpoint.checkpoints(str(out))[-1].endswith('6.pt') and 'step 7 ' not in res.stdout


def test_training_steps_between_log_lines_read_nothing_back_from_the_device(data_dir, tmp_path):
    # Host syncs (.item(), bool() of a tensor) stop a GPU from running ahead: count them per run.
    # The two runs go at once.
    wrapper = (
        "import os, runpy, sys, torch\n"
        "n = [0]\n"
        "def counted(f):\n"
        "    def g(*a, **k):\n"
        "        n[0] += 1\n"
        "        return f(*a, **k)\n"
        "    return g\n"
        "torch.Tensor.item = counted(torch.Tensor.item)\n"
        "torch.Tensor.__bool__ = counted(torch.Tensor.__bool__)\n"
        "sys.argv = sys.argv[1:]\n"
        "leave = os._exit  # train.py's last line\n"
        "os._exit = lambda code: print('host reads', n[0], flush=True) or leave(code)\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    procs = []
    for steps in (4, 12):
        args = [f'--max_steps={steps}', f'--log_interval={steps}']
        launcher = [sys.executable, '-c', wrapper]
        procs.append(start(args, tmp_path / str(steps), data_dir, launcher=launcher))
    reads = [int(finish(proc).stdout.split('host reads')[-1]) for proc in procs]
    assert reads[0] == reads[1]


def test_compiled_training_does_not_recompile_per_batch_shape(data_dir, solo):
    # Token batches change shape every step: compiled per layer with dynamic shapes (as bench.py
    # times it), train.py must not compile per shape, nor fall back to eager at dynamo's recompile
    # limit (an error here). The backend is dynamo's 'eager' (GRAPHS_COUNTED): capture and
    # guards, which decide recompiles, are inductor's too.
    res = finish(solo[1])
    graphs = []
    for line in res.stdout.splitlines():
        if line.startswith(('step 8 ', 'step 40 ')):
            graphs.append(int(line.split('graphs')[-1]))
    data = dataset.load_split(data_dir, 'train')
    plan = dataset.batch_plan(data, 256, 1337, 0)
    shapes = []
    for n in (8, 40):
        batches = [dataset.collate(data, ids, 0, 1, 2)[:2] for ids in plan[:n]]
        shapes.append({tuple(a.shape) for batch in batches for a in batch})
    assert len(shapes[1]) > len(shapes[0]), (graphs, shapes)
    assert graphs[0] == graphs[1] <= 8, (graphs, shapes)


def test_batches_are_prefetched_in_order_by_a_background_thread():
    import threading

    prefetched = dataset.prefetched
    made, last = [], threading.Event()

    def items():
        for i in range(5):
            made.append((i, threading.current_thread() is threading.main_thread()))
            if i == 4:
                last.set()
            yield i

    got = prefetched(items())
    assert [next(got) for _ in range(4)] == [0, 1, 2, 3]
    # The item after the one in hand is made meanwhile, in another thread.
    assert last.wait(timeout=60)
    assert made == [(i, False) for i in range(5)]


def load_function(name, **scope):
    """A function of train.py with the globals given, without running the script around it."""
    with open(os.path.join(HERE, 'train.py')) as f:
        tree = ast.parse(f.read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module(body=[fn], type_ignores=[]), 'train.py', 'exec'), scope)
    return scope[name]


def load_override():
    return configurator.override


def test_a_flag_and_its_value_apart_are_named_not_read_as_a_config_file():
    settings = {'max_steps': 10}
    message = in_process_refusal(configurator.override, settings, ['--max_steps', '5'])
    assert message == '--max_steps: expected --key=value'


def test_help_lists_every_setting_with_its_default_and_exits_0(capsys):
    settings = {'out_dir': 'out/x', 'max_steps': 10}
    for flag in ('-h', '--help'):
        with pytest.raises(SystemExit) as e:
            configurator.override(dict(settings), ['config/multi30k.py', flag])
        assert e.value.code == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].endswith('[CONFIG_FILE ...] [--key=value ...]')
        assert lines[-2:] == ["  --out_dir='out/x'", '  --max_steps=10']


def test_numbers_given_for_a_text_setting_are_kept_as_text():
    settings = {'out_dir': 'out/x', 'dtype': 'auto', 'max_steps': 10}
    config = load_override()(settings, ['--out_dir=2024', "--dtype='float32'"])
    assert config == {'out_dir': '2024', 'dtype': 'float32', 'max_steps': 10}


def test_a_config_file_reads_the_settings_so_far_may_import_and_yields_to_flags(tmp_path):
    override = load_override()
    (tmp_path / 'c.py').write_text(
        'import math\nd_model = 64\nd_ff = 4 * d_model\n'
        'warmup = max(w * 2 for w in [int(math.sqrt(d_model))])\n'
    )
    settings = {'d_model': 512, 'd_ff': 2048, 'warmup': 4000, 'lr': 1.0}
    config = override(dict(settings), [str(tmp_path / 'c.py'), '--lr=2'])
    assert config == {'d_model': 64, 'd_ff': 256, 'warmup': 16, 'lr': 2.0}
    config = override(dict(settings), ['--d_model=32', str(tmp_path / 'c.py')])
    # A flag wins wherever it stands; the file saw 64.
    assert config['d_model'] == 32 and config['d_ff'] == 256
    # A file of comments alone, or a docstring, sets nothing and is no mistake.
    (tmp_path / 'e.py').write_text('"""The defaults."""\n# nothing to change\n')
    assert override(dict(settings), [str(tmp_path / 'e.py')]) == settings


@pytest.mark.parametrize(
    'text,message',
    [
        ('d_modle = 64\n', "unknown setting 'd_modle'"),
        ('d_model = 256\nlr = (1e-3\n', 'line 2: SyntaxError'),
        ('d_model = 256\n\nd_ff = 4 * dmodel\n', "line 3: NameError"),
        ('{"d_model": 64, "lr": 2.0}\n', 'line 1: a bare Dict sets no setting'),  # JSON: was silent
    ],
)
def test_config_file_mistakes_name_the_file_the_line_and_the_key(tmp_path, text, message):
    (tmp_path / 'c.py').write_text(text)
    with pytest.raises(SystemExit) as e:
        load_override()({'d_model': 512, 'd_ff': 2048, 'lr': 1.0}, [str(tmp_path / 'c.py')])
    assert str(tmp_path / 'c.py') in str(e.value) and message in str(e.value)


def load_get_lr(**settings):
    budget = {'cooldown': 0.0, 'max_minutes': 0.0, 'max_steps': 10**6}
    return load_function('get_lr', sys=sys, **{**budget, **settings})


def test_noam_schedule_matches_paper_formula():
    class Cfg:
        d_model = 512

    get_lr = load_get_lr(schedule='noam', lr_scale=1.0, warmup=4000, model_cfg=Cfg)
    assert get_lr(1) == pytest.approx(512**-0.5 * 4000**-1.5)
    assert get_lr(4000) == pytest.approx(512**-0.5 * 4000**-0.5)  # the peak, ~7.0e-4
    assert get_lr(100000) == pytest.approx(512**-0.5 * 100000**-0.5)
    assert get_lr(4000) == pytest.approx(6.988e-4, rel=1e-3)


def test_inverse_sqrt_schedule():
    get_lr = load_get_lr(schedule='inverse_sqrt', lr=5e-4, warmup=4000)
    assert get_lr(2000) == pytest.approx(2.5e-4)
    assert get_lr(4000) == pytest.approx(5e-4)
    assert get_lr(16000) == pytest.approx(2.5e-4)


def test_constant_schedule_warms_up_then_holds_lr_until_the_cooldown():
    get_lr = load_get_lr(schedule='constant', lr=2e-3, warmup=800, cooldown=0.3, max_steps=8000)
    assert get_lr(400) == pytest.approx(1e-3)
    assert get_lr(800) == get_lr(5600) == pytest.approx(2e-3)
    assert get_lr(6800) == pytest.approx(1e-3) and get_lr(8000) == 0.0


def test_cooldown_takes_the_lr_linearly_to_zero_by_the_budget_that_ends_the_run_first():
    get_lr = load_get_lr(schedule='inverse_sqrt', lr=1e-3, warmup=100, cooldown=0.25,
                         max_minutes=10.0)
    assert get_lr(400, elapsed=0) == pytest.approx(5e-4)
    assert get_lr(400, elapsed=450) == pytest.approx(5e-4)  # 7.5 of 10 minutes: cooldown starts
    assert get_lr(400, elapsed=525) == pytest.approx(2.5e-4)
    assert get_lr(400, elapsed=600) == 0.0 and get_lr(400, elapsed=700) == 0.0
    get_lr = load_get_lr(schedule='inverse_sqrt', lr=1e-3, warmup=100, cooldown=0.5,
                         max_steps=800, max_minutes=600.0)
    assert get_lr(400, elapsed=60) == pytest.approx(5e-4)  # half of max_steps: cooldown starts
    assert get_lr(800, elapsed=60) == 0.0
    # The clock is further along: it rules.
    assert get_lr(400, elapsed=600 * 60 * 0.75) == pytest.approx(2.5e-4)


def test_cpu_dropout_keeps_each_element_with_1_minus_p_and_rescales():
    drop, x = torch.nn.Dropout(0.2), torch.ones(200_000, requires_grad=True)
    speed.cpu_dropout(drop)  # train.py's on a CPU, and bench.py's
    torch.manual_seed(0)
    y = drop.train()(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.005
    assert torch.allclose(y[kept], torch.tensor(1.25))
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # the gradient goes through the same mask and scale
    assert drop.eval()(x) is x and drop.train()(x.detach().bfloat16()).dtype == torch.bfloat16


def copies_of_rank(rank, port, out):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.distributed.init_process_group('gloo', rank=rank, world_size=2)
    cfg = M.Config(vocab_size=40, n_enc_layers=1, n_dec_layers=1, d_model=16, d_ff=32, n_heads=2)
    for master_weights in (False, True):
        torch.manual_seed(rank)  # as train.py: each rank draws its own initialisation
        model = M.Transformer(cfg)
        train_model, _ = speed.training_model(model, True, 'cpu', 'bfloat16', master_weights,
                                              False, False)
        weights = [p.detach().clone() for p in train_model.parameters()]
        torch.save(weights, f'{out}.{master_weights}.{rank}')
    torch.distributed.destroy_process_group()


@pytest.fixture(scope='module')
def copies(tmp_path_factory):
    """The weights each of two ranks steps from, without and with master_weights (one spawn for
    both) -> the files' common prefix."""
    out = str(tmp_path_factory.mktemp('copies') / 'weights')
    torch.multiprocessing.spawn(copies_of_rank, args=(free_port(), out), nprocs=2)
    return out


@pytest.mark.parametrize('master_weights', [False, True])
def test_every_rank_steps_from_rank_0s_weights_with_or_without_master_weights(master_weights,
                                                                               copies):
    # cuda_graphs replaces DDP's wrapper, whose constructor broadcasts: train.py's own broadcast
    # must come first, before the bf16 copy of master_weights is taken.
    first = torch.load(f'{copies}.{master_weights}.0')
    second = torch.load(f'{copies}.{master_weights}.1')
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    if master_weights:
        assert first[0].dtype == torch.bfloat16


def test_cuda_graphs_head_sizes_outside_flash_attentions_are_refused():
    def check(head_size):
        return speed.check_heads(M.Config(d_model=512, n_heads=1, d_head=head_size), True)
    assert check(64) is None and check(256) is None
    for head_size in (512, 12, 4):  # Table 3 row A at h=1 is 512
        assert 'multiple of 8 and at most 256' in in_process_refusal(check, head_size)
    assert speed.check_heads(M.Config(d_model=512, n_heads=1), False) is None


def test_the_speed_settings_are_checked_with_a_fine_tuned_checkpoints_heads(run, data_dir,
                                                                           tmp_path):
    # Fine-tuning keeps the checkpoint's heads (32 / 4 = 8), not --d_head=4: cuda_graphs' check of
    # the head size must see those (HEADS_CHECKED refuses with the head size it is given).
    proc = start(['--d_head=4', f'--init_from={run[0] / "ckpt.pt"}'], tmp_path, data_dir,
                 launcher=wrapped(HEADS_CHECKED))
    assert 'head size 8' in finish(proc, ok=False).stderr


@pytest.fixture(scope='module')
def padded(shared):
    """5 steps without dropout, padded batches."""
    out, proc = shared['padded']
    finish(proc)
    return out


def test_the_cuda_graphs_path_trains_as_padded_batches_do(padded, solo):
    # Rows packed to a fixed size, stepped as the CUDA graphs step them (GRAPHS_MOCKED: on the CPU,
    # the capture is the callable itself): the training and validation losses of padded batches.
    # (Not the weights: the keys' bias has a zero gradient but for rounding, which Adam scales up.)
    out, proc = solo
    finish(proc)
    assert losses(out) == pytest.approx(losses(padded), rel=1e-5)
    (valid,), (want,) = records(out, 'valid_loss'), records(padded, 'valid_loss')
    assert valid['valid_loss'] == pytest.approx(want['valid_loss'], rel=1e-5)


def test_master_weights_are_checked_against_the_dtype_auto_picks(solo):
    # On an AVX2-only CPU dtype='auto' is float32 (FLOAT32_CPU): a bf16 copy would be a redundant
    # float32 one.
    res = finish(solo[1], ok=False)
    assert 'master_weights must be False with dtype float32' in res.stderr


def test_a_state_saved_before_weight_decay_is_refused_in_one_line(run, data_dir, tmp_path):
    # Before weight decay the optimizer had one group for every parameter; torch's load_state_dict
    # raises a ValueError on it.
    out = copy_run(run, tmp_path)
    path = out / 'state_0000006.pt'
    state = torch.load(path, weights_only=False)
    groups = state['optimizer']['param_groups']
    merged = dict(groups[0], params=[i for g in groups for i in g['params']])
    state['optimizer']['param_groups'] = [merged]
    torch.save(state, path)
    res = train(['--max_steps=8', '--init_from=resume', '--save_interval=3', '--dropout=0.1',
                 '--bleu_interval=0'], out, data_dir, ok=False)
    assert 'holds an optimizer of 1 parameter group(s)' in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_weights_that_no_longer_fit_model_py_are_one_line_naming_the_parameters(run, data_dir,
                                                                              tmp_path):
    # A forker changes model.py (a parameter added, one removed) and reruns: resuming the run, or
    # fine-tuning from its checkpoint, cannot load the old weights.
    out = copy_run(run, tmp_path)
    for name in ('state_0000006.pt', 'ckpt.pt'):
        ckpt = torch.load(out / name, weights_only=False)
        ckpt['model']['encoder.0.ffn.gain'] = ckpt['model'].pop('encoder.0.ffn.w1.bias')
        torch.save(ckpt, out / name)
    resume = ['--max_steps=8', '--init_from=resume', '--save_interval=3', '--dropout=0.1',
              '--bleu_interval=0']
    fine_tune = [f'--init_from={out / "ckpt.pt"}', '--max_steps=2']
    errs = refused((resume, out, data_dir), (fine_tune, tmp_path / 'tuned', data_dir))
    for name, err in zip(('state_0000006.pt', 'ckpt.pt'), errs):
        assert f"{name} does not fit this model.py" in err
        assert 'missing encoder.0.ffn.w1.bias' in err
        assert 'unexpected encoder.0.ffn.gain' in err


# --- a run on a cluster: preempted, restarted, on two nodes ---------------------------------------

STOPPER = '''
import os, runpy, signal, sys, torch
# Signals this process at update STOP_AT on rank STOP_RANK, in torchrun's first attempt only.
rank = int(os.environ.get('RANK', 0))
first_attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') == '0'
at, who, how = int(os.environ['STOP_AT']), int(os.environ['STOP_RANK']), os.environ['STOP_HOW']
clip, n = torch.nn.utils.clip_grad_norm_, [0]
def counted(*args, **kwargs):  # train.py calls it once per update
    n[0] += 1
    if n[0] == at and rank == who and first_attempt:
        for name in how.split(','):
            os.kill(os.getpid(), getattr(signal, name))
    return clip(*args, **kwargs)
torch.nn.utils.clip_grad_norm_ = counted
sys.argv = sys.argv[1:]
sys.path.insert(0, os.getcwd())  # the script lies elsewhere
runpy.run_path('train.py', run_name='__main__')
'''


def stopped_run(args, out_dir, data_dir, how, at, rank=0, torchrun_flags=()):
    """train.py under torchrun with 2 processes (or 1 with no flags), rank `rank` sent the signals
    `how` at update `at`, started -> the running process."""
    script = out_dir.parent / f'stopper_{out_dir.name}.py'
    script.write_text(STOPPER)
    launcher = [sys.executable, str(script)]
    if torchrun_flags:  # a rendezvous of its own per attempt: no address of a killed worker
        launcher = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2',
                    '--rdzv-backend=c10d', f'--rdzv-endpoint=127.0.0.1:{free_port()}',
                    *torchrun_flags, str(script)]
    cmd = launcher + ['train.py'] + TINY + [f'--data_dir={data_dir}', f'--out_dir={out_dir}', *args]
    env = dict(os.environ, OMP_NUM_THREADS='1', STOP_AT=str(at), STOP_RANK=str(rank), STOP_HOW=how)
    return subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


# The runs the tests below stop: (args, signals, at update, on rank, torchrun's flags). The killed
# worker's first: its time is taken as it ends.
STOPS = dict(
    killed=(TWO + ['--max_steps=6'], 'SIGKILL', 5, 1, ['--max-restarts=0']),
    sigterm=(TWO + ['--max_steps=6'], 'SIGTERM', 4, 1, ['--max-restarts=0']),
    restarted=(TWO + ['--max_steps=6'], 'SIGKILL', 5, 1, ['--max-restarts=1']),
    second_signal=(['--max_steps=6', '--save_interval=3'], 'SIGINT,SIGINT', 2, 0, []),
)


@pytest.fixture(scope='module')
def stopped(data_dir, tmp_path_factory):
    """The runs of STOPS, started together (torchrun's processes are mostly imports, which two
    cores overlap) -> {name: (its out_dir, its finished process, seconds from its start to its
    end)}."""
    started = {}
    for name, (args, how, at, rank, flags) in STOPS.items():
        out = tmp_path_factory.mktemp(name) / 'run'
        proc = stopped_run(args, out, data_dir, how, at, rank, flags)
        started[name] = out, proc, time.time()
    ended = {}
    for name, (out, proc, t) in started.items():
        stdout, stderr = proc.communicate(timeout=300)
        res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        ended[name] = out, res, time.time() - t
    return ended


def test_a_damaged_state_or_best_checkpoint_in_out_dir_is_one_line_naming_it(run, data_dir,
                                                                            tmp_path):
    # The same command reads its run's settings from the state, and resuming reads the best
    # validation BLEU from ckpt_best.pt.
    runs = []
    for name in ('state_0000006.pt', 'ckpt_best.pt'):
        out = shutil.copytree(run[0], tmp_path / name)
        os.truncate(out / name, 1000)
        runs.append((SHARED['run'][0], out, data_dir))
    for name, err in zip(('state_0000006.pt', 'ckpt_best.pt'), refused(*runs)):
        assert f'{name}: not a checkpoint, or a damaged one' in err


def test_an_error_of_one_process_keeps_its_traceback_whatever_it_says(monkeypatch):
    # "another process failed" is for a process group's collectives alone.
    seen = []
    monkeypatch.setattr(sys, '__excepthook__', lambda kind, error, tb: seen.append(kind))
    monkeypatch.setattr(cluster, 'exit_now', seen.append)
    cluster.one_line_on_failure(RuntimeError, RuntimeError('gloo: an error of its own'), None)
    assert seen == [RuntimeError]


def test_a_master_port_in_use_is_one_line(data_dir, tmp_path, monkeypatch):
    # A launch of one's own (a job script setting RANK and MASTER_PORT for srun), not torchrun's.
    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', 'MASTER_ADDR': '127.0.0.1',
               'MASTER_PORT': str(port)}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        (err,) = refused((['--max_steps=1'], tmp_path, data_dir))
    assert f'cannot start the process group at 127.0.0.1:{port}' in err
    assert err.strip().endswith('choose a free MASTER_PORT')


def test_out_of_gpu_memory_anywhere_is_one_line_with_what_to_change(monkeypatch, capsys):
    # Adam's first step and an evaluation run out of memory too, not only a forward and backward.
    monkeypatch.setattr(sys, '__excepthook__', lambda kind, error, tb: print('traceback'))
    monkeypatch.setattr(cluster, 'exit_now', sys.exit)
    error = torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB\nmore')
    with pytest.raises(SystemExit) as stopped:
        cluster.one_line_on_failure(type(error), error, None)
    assert stopped.value.code == 1
    err = capsys.readouterr().err
    assert 'Tried to allocate 2.00 GiB' in err
    assert 'lower max_tokens' in err
    assert err.count('\n') == 1


def test_a_stop_signal_after_the_last_step_ends_the_run_at_once_in_one_line(monkeypatch, capsys):
    # The loop's handlers ignored a signal in the final averaging or evaluation (exit 0), and a
    # second one ended the run without a word.
    handlers = {}
    monkeypatch.setattr(signal, 'signal', handlers.__setitem__)
    monkeypatch.setattr(cluster, 'exit_now', sys.exit)
    monkeypatch.setitem(cluster.stop, 'signal', None)
    when = 'after the last step (6), averaging or evaluating'
    cluster.signals_stop_at_once(when, True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        with pytest.raises(SystemExit) as stopped:
            handlers[sig](sig, None)
        assert stopped.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f'{name}: stopped {when}; the same command does what was left'
                     for name in ('SIGTERM', 'SIGINT')]
    # A signal that came after the last step's check ends it at once too; other ranks say nothing.
    with pytest.raises(SystemExit):
        cluster.signals_stop_at_once(when, False)
    assert capsys.readouterr().err == ''


def test_ctrl_c_in_the_final_averaging_stops_train_py_and_the_same_command_ends_it(data_dir,
                                                                                  tmp_path):
    res = train(['--max_steps=1'], tmp_path, data_dir, ok=False,
                launcher=wrapped(INTERRUPTED_AT_THE_END))
    assert res.stderr == ('SIGINT: stopped after the last step (1), averaging or evaluating; the '
                          'same command does what was left\n')
    assert not os.path.exists(tmp_path / 'ckpt.pt')
    res = train(['--max_steps=1'], tmp_path, data_dir)
    assert 'resuming from' in res.stdout and os.path.exists(tmp_path / 'ckpt.pt')


def test_remove_partial_saves_takes_what_a_killed_save_left_and_nothing_else(tmp_path):
    names = ['state_0000006.pt.a1b2c3d4.tmp', 'log.jsonl.a1b2c3d4.tmp', 'ckpt.pt', 'x.txt.a1b2.tmp']
    for name in names:
        (tmp_path / name).write_text('x')
    checkpoint.remove_partial_saves(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ['ckpt.pt', 'x.txt.a1b2.tmp']


def test_a_stop_before_the_first_step_is_one_line(data_dir, tmp_path):
    # SIGTERM while train.py waits for its data (a FIFO meta.json nobody writes)
    data = tmp_path / 'data'
    data.mkdir()
    for name in os.listdir(data_dir):
        if name != 'meta.json':
            os.symlink(os.path.join(data_dir, name), data / name)
    os.mkfifo(data / 'meta.json')
    proc = start([], tmp_path / 'run', data)
    writer = reading(data / 'meta.json', proc)
    proc.send_signal(signal.SIGTERM)
    err = finish(proc, ok=False).stderr
    os.close(writer)
    assert err.strip() == ('train.py: interrupted before the first step; the same command starts '
                           'it again')


def test_the_same_command_continues_a_finished_run_and_keeps_its_log(run, data_dir, tmp_path):
    out = copy_run(run, tmp_path)
    res = train(['--max_steps=6', '--save_interval=3', '--dropout=0.1', '--bleu_interval=0'], out,
                data_dir)
    assert 'resuming from' in res.stdout and 'state_0000006.pt' in res.stdout
    assert losses(out) == losses(run[0])
    assert records(out, 'valid_loss') == records(run[0], 'valid_loss')  # evaluated once


def test_a_fine_tune_command_continues_only_a_run_fine_tuned_from_its_checkpoint(run, data_dir,
                                                                                tmp_path):
    # A run from scratch of the same settings is not the fine-tune's run, nor a typo's.
    out = copy_run(run, tmp_path)
    typo = shutil.copytree(out, tmp_path / 'typo')
    other = tmp_path / 'other.pt'
    shutil.copy(out / 'ckpt.pt', other)
    args = SHARED['run'][0]
    errs = refused((args + [f'--init_from={other}'], out, data_dir),
                   (args + ['--init_from=resum'], typo, data_dir))
    assert f"init_from='{other}' (the run began from 'scratch')" in errs[0]
    assert "init_from='resum'" in errs[1]
    assert len(records(out, 'loss')) == 6
    tuned = tmp_path / 'tuned'
    train(['--max_steps=1', f'--init_from={other}'], tuned, data_dir)
    # Nor is the fine-tuned run the command from scratch's.
    (err,) = refused((['--max_steps=1'], tuned, data_dir))
    assert f"init_from='auto' (the run began from '{other}')" in err
    # The fine-tune command rerun goes on, its checkpoint gone and its path spelt otherwise.
    os.remove(other)
    res = train(['--max_steps=1', f'--init_from={tmp_path}/./other.pt'], tuned, data_dir)
    assert 'resuming from' in res.stdout


def test_the_same_command_does_not_go_on_with_a_run_begun_under_another_model_py(run, data_dir,
                                                                              tmp_path):
    # A reader changes model.py and reruns the command: going on would put the old run's weights
    # under the new code (and a finished run would only be evaluated again).
    out = copy_run(run, tmp_path)
    path = out / 'state_0000006.pt'
    state = torch.load(path, weights_only=False)
    state.setdefault('code', {})['model.py'] = 'another'
    torch.save(state, path)
    (err,) = refused((SHARED['run'][0], out, data_dir))
    assert 'model.py changed since the run began' in err
    res = train(SHARED['run'][0] + ['--init_from=resume'], out, data_dir)  # said: it goes on
    assert 'model.py changed since the run began: the run goes on under the new code' in res.stdout
    # Its average keeps the digests the run began with: translating it under the edit warns.
    assert torch.load(out / 'ckpt.pt', weights_only=True)['code']['model.py'] == 'another'
    saved = torch.load(run[0] / 'state_0000006.pt', weights_only=True)['code']
    assert saved == checkpoint.code_digests()  # both files, as this process reads them


def test_a_used_out_dir_names_the_settings_its_runs_command_gave(run):
    # A fine-tune's command may give an architecture its checkpoint overrides: the refusal says
    # what the command gave, not what the model is.
    state = checkpoint.checkpoints(run[0], 'state')[-1]
    given = torch.load(state, weights_only=True)['given_config']
    differ = checkpoint.settings_differ(state, dict(given, n_heads=1), {})
    assert differ == [f"n_heads=1 (the run's command: {given['n_heads']})"]


def test_sigterm_to_one_rank_saves_both_at_one_step_and_the_same_command_goes_on(two, data_dir,
                                                                               stopped):
    out, res, _ = stopped['sigterm']
    assert res.returncode != 0 and 'SIGTERM' not in res.stdout
    assert "stopped at step 4 with a training state" in res.stderr, res.stderr[:3000]
    assert [os.path.basename(p) for p in checkpoint.checkpoints(str(out), 'state')] == [
        'state_0000004.pt']
    train(TWO + ['--max_steps=6'], out, data_dir, nproc=2)
    assert_same_run(out, two)


def test_a_second_signal_stops_at_once(stopped):
    out, res, _ = stopped['second_signal']
    assert res.returncode == 128 + 2 and 'Traceback' not in res.stderr
    assert not checkpoint.checkpoints(str(out), 'state')


def test_torchrun_restarts_after_a_killed_worker_end_as_an_uninterrupted_run(two, stopped):
    out, res, _ = stopped['restarted']
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'resuming from' in res.stdout and 'state_0000003.pt' in res.stdout
    assert_same_run(out, two)


def test_a_killed_worker_ends_the_run_at_once_and_the_same_command_goes_on(two, data_dir,
                                                                          stopped):
    # torchrun SIGTERMs the other worker: its save must not wait on the dead one.
    out, res, seconds = stopped['killed']
    assert res.returncode != 0 and seconds < 60  # ddp_timeout_minutes is 60
    assert 'another process of this run failed or left' in res.stderr, res.stderr[-3000:]
    assert 'train.py", line' not in res.stderr  # torchrun's own traceback aside
    for path in glob.glob(str(out / '*.pt')):  # whole files under real names
        torch.load(path, weights_only=False)
    train(TWO + ['--max_steps=6'], out, data_dir, nproc=2)
    assert_same_run(out, two)


def node(node_rank, port, out_dir, data_dir):
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nnodes=2', f'--node_rank={node_rank}',
           '--nproc_per_node=1', '--master_addr=127.0.0.1', f'--master_port={port}', 'train.py',
           *TINY, f'--data_dir={data_dir}', f'--out_dir={out_dir}', *TWO, '--max_steps=6']
    return subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS='1'))


def test_two_nodes_on_one_machine_train_as_two_processes_and_need_one_out_dir(two, data_dir,
                                                                            tmp_path):
    # Both pairs of nodes at once: one into a shared out_dir, one into an out_dir each.
    port, own = free_port(), free_port()
    while own == port:
        own = free_port()
    nodes = [node(r, port, tmp_path / 'shared', data_dir) for r in (0, 1)]
    refused_nodes = [node(r, own, tmp_path / f'own_{r}', data_dir) for r in (0, 1)]
    for p in nodes:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    assert_same_run(tmp_path / 'shared', two)
    for p in refused_nodes:
        _, err = p.communicate(timeout=300)
        assert p.returncode != 0 and 'is not the same folder on every node' in err, err[-3000:]
