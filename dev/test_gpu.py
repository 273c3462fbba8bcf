"""
What must hold on a CUDA GPU; those tests skip where torch sees none (CI). On a GPU machine:
    python -m pytest -q dev/test_gpu.py
dev/gpu_check.py runs them there among its stages; the last test runs gpu_check.py itself, tiny, on
the CPU.
"""
import base64
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The root's modules, and the helpers of test_train.py and test_speed.py: in the root or in tests/.
sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests')]

import data_prep  # noqa: E402
import decode  # noqa: E402
import model as M  # noqa: E402
from test_train import free_port, records, toy_corpus, train  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')


def toy_data_dir(request):
    """test_train.py's toy corpus (conftest.py's, which test_train.py reads too). Where rustbpe is
    missing to learn its BPE (a GPU machine's image may lack it): with a tokenizer of the 256 bytes
    alone, which data_prep.py takes as given (--tokenizer)."""
    if importlib.util.find_spec('rustbpe'):
        return request.getfixturevalue('toy_data')
    root = request.getfixturevalue('tmp_path_factory').mktemp('toy')
    ranks = [[base64.b64encode(bytes([i])).decode('ascii'), i] for i in range(256)]
    specials = {s: 256 + i for i, s in enumerate(data_prep.SPECIALS)}
    tokenizer = dict(name='bytes', pattern=data_prep.PATTERN, ranks=ranks, special_tokens=specials)
    (root / 'bytes.json').write_text(json.dumps(tokenizer))
    return toy_corpus(root, tokenizer=root / 'bytes.json')


@pytest.fixture(scope='module')
def data_dir(request):
    return toy_data_dir(request)


@pytest.fixture(autouse=True)
def attention_as_the_scripts_run_it():
    # train.py, translate.py and bench.py turn cuDNN attention off on CUDA (it plans anew for each
    # shape); importing model.py leaves it on. The in-process tests run what the scripts run.
    old = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(old)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = M.Config(vocab_size=96, n_enc_layers=2, n_dec_layers=2, d_model=64, d_ff=128, n_heads=4,
                   dropout=0.0)
    return M.Transformer(cfg).eval()


def batch(cfg, B=6, S=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, cfg.vocab_size, (B, S), generator=g)
    src[:, -1] = cfg.eos_id
    src[0, 5:] = cfg.pad_id  # a padded row: masks must work on the GPU too
    src[0, 4] = cfg.eos_id
    return src


@pytest.fixture
def strict_fp32():  # TF32 would change float32 results in the 3rd decimal
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def translate(args, **env):
    """translate.py from the root -> its completed process."""
    return subprocess.run([sys.executable, 'translate.py', *args], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, **env))


@cuda
def test_cuda_forward_and_decoding_match_the_cpu_in_float32(strict_fp32):
    cpu = tiny_model()
    gpu = tiny_model().cuda()
    src = batch(cpu.cfg)
    tgt = torch.randint(3, cpu.cfg.vocab_size, (src.size(0), 9))
    with torch.no_grad():
        ref = cpu(src, tgt)
        out = gpu(src.cuda(), tgt.cuda()).cpu()
    assert (out - ref).norm() / ref.norm() < 1e-5

    def greedy(m, s):
        return decode.greedy_decode(m, s, 1.0, 5)

    def beam(m, s):
        return decode.beam_search(m, s, 4, 0.6, 1.0, 5)
    for decoder in (greedy, beam):
        a = decoder(cpu, src)
        b = decoder(gpu, src.cuda())
        assert [[h[0] for h in hyps] for hyps in a] == [[h[0] for h in hyps] for hyps in b]
        scores_a = [h[1] for hyps in a for h in hyps]
        scores_b = [h[1] for hyps in b for h in hyps]
        assert scores_a == pytest.approx(scores_b, abs=1e-4)


@cuda
def test_cache_matches_full_forward_on_cuda_in_bfloat16():
    model = tiny_model().cuda()
    src = batch(model.cfg).cuda()
    tgt = torch.randint(3, model.cfg.vocab_size, (src.size(0), 7), device='cuda')
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        full = torch.log_softmax(model(src, tgt).float(), -1)
        memory, src_mask = model.encode(src)
        cache = model.new_cache()
        steps = []
        for t in range(tgt.size(1)):
            x = model.decode(tgt[:, t:t + 1], memory, src_mask, cache)
            steps.append(model.output(x)[:, 0].float())
    steps = torch.log_softmax(torch.stack(steps, 1), -1)
    assert (steps - full).abs().max() < 0.1  # bf16 rounding differs between the two paths


@cuda
@pytest.mark.parametrize('pack_kw', [{}, dict(size=80, max_len=16)])
def test_packed_flash_attention_gives_the_padded_loss_and_gradients_on_cuda(pack_kw):
    from test_model import pad_batch
    from test_speed import packed_and_padded_grads
    m = tiny_model().cuda().train()
    src = batch(m.cfg).cuda()
    seqs = [[5, 6, 7, 2], [8, 2], [3, 4, 5, 6, 7, 8, 9, 2], [4, 2], [9, 9, 2], [7, 2]]
    tgt_out = pad_batch(seqs).cuda()
    with torch.autocast('cuda', dtype=torch.bfloat16):
        (want, want_g), (got, got_g) = packed_and_padded_grads(m, src, tgt_out, **pack_kw)
    assert abs(got.item() - want.item()) < 1e-2 * abs(want.item())
    for (name, _), a, b in zip(m.named_parameters(), got_g, want_g):
        assert (a - b).norm() <= 2e-2 * b.norm() + 1e-6, name


@cuda
def test_bfloat16_training_on_cuda_fits_a_batch():
    model = tiny_model().cuda().train()
    src = batch(model.cfg).cuda()
    tgt = src.flip(1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9, fused=True)
    losses = []
    target = tgt[:, 1:].flatten()
    rows = (target != model.cfg.pad_id).nonzero().squeeze(1)
    for _ in range(60):
        with torch.autocast('cuda', dtype=torch.bfloat16):
            x = model(src, tgt[:, :-1], rows)
            loss, _ = M.label_smoothed_loss(x, model.embed.weight, target[rows])
        (loss / len(rows)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item() / len(rows))
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[-1] < 0.5 * losses[0]


@cuda
@pytest.mark.parametrize('extra', [['--dtype=bfloat16', '--compile=True'], ['--dtype=float16'],
                                   ['--dtype=bfloat16', '--compile=True', '--cuda_graphs=True']])
def test_train_one_process_on_cuda_writes_a_loadable_checkpoint(data_dir, tmp_path, extra):
    out = tmp_path / 'run'
    args = ['--device=cuda', '--max_steps=30', '--save_interval=15', '--bleu_interval=0']
    res = train(args + extra, out, data_dir)
    assert 'device cuda' in res.stdout, res.stdout[-2000:]
    losses = [r['loss'] for r in records(out, 'loss')]
    assert len(losses) == 30 and losses[-1] < losses[0]
    assert records(out, 'valid_bleu')[-1]['valid_bleu'] >= 0
    # The weights were saved from the GPU: they must still translate where torch sees none.
    src = os.path.join(data_dir, 'valid.xx.txt')
    res = translate(['--ckpt', str(out / 'ckpt.pt'), '--input', src], CUDA_VISIBLE_DEVICES='')
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 40, res.stderr[-2000:]
    assert '(cpu, ' in res.stderr


# graphs: speed.all_reduce_grads averages; master_weights: rank 0's float32 weights broadcast
@cuda
@pytest.mark.parametrize('extra', [[], ['--cuda_graphs=True', '--dtype=bfloat16',
                                        '--master_weights=True']])
def test_torchrun_with_nccl_runs_the_ddp_path_and_stops_at_max_minutes(data_dir, tmp_path, extra):
    out = tmp_path / 'ddp'
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=1',
                f'--master_port={free_port()}']
    args = ['--device=cuda', '--max_steps=1000000', '--max_minutes=0.1', '--save_interval=0']
    res = train(args + extra, out, data_dir, launcher=torchrun)
    assert re.search(r'max_minutes=0.1 reached at step \d+', res.stdout), res.stdout[-2000:]
    assert 'device cuda:0' in res.stdout
    assert os.path.exists(out / 'ckpt.pt')


@cuda
def test_cuda_graphs_in_float32_is_a_one_line_error(data_dir, tmp_path):
    # flash attention: bf16/fp16 only
    args = ['--device=cuda', '--cuda_graphs=True', '--dtype=float32']
    res = train(args, tmp_path, data_dir, ok=False)
    assert 'dtype bfloat16 or float16' in res.stderr  # train(ok=False): one line, no traceback


@cuda
def test_translate_cli_on_cuda_gives_the_cpu_output_in_float32(data_dir, tmp_path):
    out = tmp_path / 'run'
    train(['--device=cuda', '--max_steps=40', '--bleu_interval=-1'], out, data_dir)
    src = os.path.join(data_dir, 'valid.xx.txt')
    lines = {}
    for device in ('cpu', 'cuda'):
        args = ['--ckpt', str(out / 'ckpt.pt'), '--input', src, '--device', device,
                '--dtype', 'float32']
        res = translate(args, NVIDIA_TF32_OVERRIDE='0')
        assert res.returncode == 0, res.stderr[-2000:]
        lines[device] = res.stdout.splitlines()
    assert len(lines['cuda']) == 40 and lines['cuda'] == lines['cpu']


@cuda
def test_a_bfloat16_run_resumes_in_float16(data_dir, tmp_path):
    # Its state holds an empty grad-scaler state (bf16 needs none); float16's scaler starts afresh
    # from it.
    first = ['--device=cuda', '--dtype=bfloat16', '--max_steps=2', '--save_interval=2']
    train(first, tmp_path, data_dir)
    resumed = ['--device=cuda', '--dtype=float16', '--max_steps=3', '--init_from=resume']
    train(resumed, tmp_path, data_dir)
    assert [r['step'] for r in records(tmp_path, 'loss')] == [1, 2, 3]


def start_early(request, names):
    """gpu_check.py --tiny, started before the first test (conftest.py): 13 s on one core, which
    the rest of the suite overlaps; at the usual priority, as its stages have time limits -> {test
    name: (its process, its out folder)}."""
    name = 'test_gpu_check_runs_end_to_end_in_tiny_mode_on_the_cpu'
    if name not in names:
        return {}
    out = request.getfixturevalue('tmp_path_factory').mktemp('gpu_check') / 'out'
    script = os.path.join(ROOT, 'dev', 'gpu_check.py')
    cmd = [sys.executable, script, str(out), toy_data_dir(request), '--tiny']
    with open(out.parent / 'output.txt', 'w') as output:  # a pipe nobody reads yet could fill
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    return {name: (process, out)}


@pytest.mark.started_early
def test_gpu_check_runs_end_to_end_in_tiny_mode_on_the_cpu(started_early):
    # Its stages on the CPU, tiny (gpu_check.py --tiny): a check on a GPU machine must not find it
    # broken.
    process, out = started_early['test_gpu_check_runs_end_to_end_in_tiny_mode_on_the_cpu']
    process.wait(timeout=170)
    report = json.loads((out / 'report.json').read_text())
    stages = {s['name']: s for s in report['stages']}
    names = ['test_gpu.py', 'bench tiny 256', 'bench data 256', 'train wmt_base', 'translate beam',
             'translate greedy']
    statuses = {k: s['status'] for k, s in stages.items()}
    assert statuses == dict.fromkeys(names, 'ok'), (out / 'summary.txt').read_text()
    assert process.returncode == 0 and report['data']['src'] == 'xx'  # the languages of meta.json
    tests = stages['test_gpu.py']
    assert tests['counts']['skipped'] >= 8 and not tests['failures']
    for name in ('bench tiny 256', 'bench data 256'):
        rows = stages[name]['rows']
        assert {r['mode'] for r in rows} == {'eager'}
        assert all(r['step_ms'] > 0 and r['mfu'] > 0 for r in rows)
    trained = stages['train wmt_base']
    assert trained['steps'] == 12 and trained['steps_per_s'] > 0 and trained['recompiles'] == 0
    assert trained['bench_row'] == 'bench data 256 eager' and trained['vs_bench'] > 0
    for s in ('beam', 'greedy'):
        translated = stages[f'translate {s}']
        assert translated['sents_per_s'] > 0 and translated['bleu'] >= 0
    assert sorted(os.listdir(out)) == ['bench.log', 'report.json', 'summary.txt', 'tests.log',
                                       'train.log', 'translate.log']
