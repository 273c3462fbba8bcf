"""
What must hold on a CUDA GPU; those tests skip where torch sees none (CI). Run on a GPU machine:
$ python -m pytest -q test_gpu.py
gpu_check.py runs them there among its stages; the last test runs gpu_check.py itself, tiny, on the CPU.
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

import data_prep
import model as M
from test_train import HERE, free_port, records, toy_corpus, train

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """test_train.py's toy corpus. Where rustbpe is missing to learn its BPE (the lent GPU machines' image):
    with a tokenizer of the 256 bytes alone, which data_prep.py takes as given (--tokenizer)."""
    root = tmp_path_factory.mktemp('toy')
    if importlib.util.find_spec('rustbpe'):
        return toy_corpus(root)
    ranks = [[base64.b64encode(bytes([i])).decode('ascii'), i] for i in range(256)]
    (root / 'bytes.json').write_text(json.dumps(dict(
        name='bytes', pattern=data_prep.PATTERN, ranks=ranks,
        special_tokens={s: 256 + i for i, s in enumerate(data_prep.SPECIALS)})))
    return toy_corpus(root, tokenizer=root / 'bytes.json')


@pytest.fixture(autouse=True)
def attention_as_the_scripts_run_it():
    # train.py, translate.py and bench.py turn cuDNN attention off on CUDA (it plans anew for each shape);
    # importing model.py leaves it on. The in-process tests run what the scripts run.
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


@cuda
def test_cuda_forward_and_decoding_match_the_cpu_in_float32(strict_fp32):
    cpu = tiny_model()
    gpu = tiny_model().cuda()
    src = batch(cpu.cfg)
    tgt = torch.randint(3, cpu.cfg.vocab_size, (src.size(0), 9))
    with torch.no_grad():
        ref, out = cpu(src, tgt), gpu(src.cuda(), tgt.cuda()).cpu()
    assert (out - ref).norm() / ref.norm() < 1e-5
    for decode in (lambda m, s: M.greedy_decode(m, s, 1.0, 5),
                   lambda m, s: M.beam_search(m, s, 4, 0.6, 1.0, 5)):
        a, b = decode(cpu, src), decode(gpu, src.cuda())
        assert [[h[0] for h in hyps] for hyps in a] == [[h[0] for h in hyps] for hyps in b]
        assert [h[1] for hyps in a for h in hyps] == pytest.approx([h[1] for hyps in b for h in hyps],
                                                                   abs=1e-4)


@cuda
def test_cache_matches_full_forward_on_cuda_in_bfloat16():
    model = tiny_model().cuda()
    src = batch(model.cfg).cuda()
    tgt = torch.randint(3, model.cfg.vocab_size, (src.size(0), 7), device='cuda')
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        full = torch.log_softmax(model(src, tgt).float(), -1)
        memory, src_mask = model.encode(src)
        cache = model.new_cache()
        steps = [model.output(model.decode(tgt[:, t:t + 1], memory, src_mask, cache))[:, 0].float()
                 for t in range(tgt.size(1))]
    steps = torch.log_softmax(torch.stack(steps, 1), -1)
    assert (steps - full).abs().max() < 0.1  # bf16 rounding differs between the two paths



@cuda
@pytest.mark.parametrize('pack_kw', [{}, dict(size=80, max_len=16)])
def test_packed_flash_attention_gives_the_padded_loss_and_gradients_on_cuda(pack_kw):
    from test_speed import packed_and_padded_grads

    from test_model import pad_batch
    m = tiny_model().cuda().train()
    src = batch(m.cfg).cuda()
    tgt_out = pad_batch([[5, 6, 7, 2], [8, 2], [3, 4, 5, 6, 7, 8, 9, 2], [4, 2], [9, 9, 2], [7, 2]]).cuda()
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
    losses, target = [], tgt[:, 1:].flatten()
    rows = (target != model.cfg.pad_id).nonzero().squeeze(1)
    for _ in range(60):
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss, _ = M.label_smoothed_loss(model(src, tgt[:, :-1], rows), model.embed.weight, target[rows])
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
    res = train(['--device=cuda', '--max_steps=30', '--save_interval=15', '--bleu_interval=0'] + extra, out,
                data_dir)
    assert 'device cuda' in res.stdout, res.stdout[-2000:]
    losses = [r['loss'] for r in records(out, 'loss')]
    assert len(losses) == 30 and losses[-1] < losses[0]
    assert records(out, 'valid_bleu')[-1]['valid_bleu'] >= 0
    # The weights were saved from the GPU: they must still translate where torch sees none.
    res = subprocess.run([sys.executable, 'translate.py', '--ckpt', str(out / 'ckpt.pt'), '--input',
                          os.path.join(data_dir, 'valid.xx.txt')], cwd=HERE, capture_output=True, text=True,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=''))
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 40, res.stderr[-2000:]
    assert '(cpu, ' in res.stderr


@cuda  # graphs: speed.all_reduce_grads averages; master_weights: rank 0's float32 weights broadcast
@pytest.mark.parametrize('extra', [[], ['--cuda_graphs=True', '--dtype=bfloat16', '--master_weights=True']])
def test_torchrun_with_nccl_runs_the_ddp_path_and_stops_at_max_minutes(data_dir, tmp_path, extra):
    out = tmp_path / 'ddp'
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=1',
                f'--master_port={free_port()}']
    res = train(['--device=cuda', '--max_steps=1000000', '--max_minutes=0.1', '--save_interval=0', *extra],
                out, data_dir, launcher=torchrun)
    assert re.search(r'max_minutes=0.1 reached at step \d+', res.stdout), res.stdout[-2000:]
    assert 'device cuda:0' in res.stdout
    assert os.path.exists(out / 'ckpt.pt')


@cuda
def test_cuda_graphs_in_float32_is_a_one_line_error(data_dir, tmp_path):  # flash attention: bf16/fp16 only
    res = train(['--device=cuda', '--cuda_graphs=True', '--dtype=float32'], tmp_path, data_dir, ok=False)
    assert 'dtype bfloat16 or float16' in res.stderr  # train(ok=False): one line, no traceback


@cuda
def test_translate_cli_on_cuda_gives_the_cpu_output_in_float32(data_dir, tmp_path):
    out = tmp_path / 'run'
    train(['--device=cuda', '--max_steps=40', '--bleu_interval=-1'], out, data_dir)
    src = os.path.join(data_dir, 'valid.xx.txt')
    lines = {}
    for device in ('cpu', 'cuda'):
        res = subprocess.run([sys.executable, 'translate.py', '--ckpt', str(out / 'ckpt.pt'), '--input', src,
                              '--device', device, '--dtype', 'float32'], cwd=HERE, capture_output=True,
                             text=True, env=dict(os.environ, NVIDIA_TF32_OVERRIDE='0'))
        assert res.returncode == 0, res.stderr[-2000:]
        lines[device] = res.stdout.splitlines()
    assert len(lines['cuda']) == 40 and lines['cuda'] == lines['cpu']


@cuda
def test_a_bfloat16_run_resumes_in_float16(data_dir, tmp_path):
    # Its state holds an empty grad-scaler state (bf16 needs none); float16's scaler starts afresh from it.
    train(['--device=cuda', '--dtype=bfloat16', '--max_steps=2', '--save_interval=2'], tmp_path, data_dir)
    train(['--device=cuda', '--dtype=float16', '--max_steps=3', '--init_from=resume'], tmp_path, data_dir)
    assert [r['step'] for r in records(tmp_path, 'loss')] == [1, 2, 3]


def test_gpu_check_runs_end_to_end_in_tiny_mode_on_the_cpu(data_dir, tmp_path):
    # Its stages on the CPU, tiny (gpu_check.py --tiny): the one GPU call must not find it rotten.
    out = tmp_path / 'out'
    res = subprocess.run([sys.executable, 'gpu_check.py', str(out), data_dir, '--tiny'], cwd=HERE,
                         capture_output=True, text=True, timeout=170)
    report = json.loads((out / 'report.json').read_text())
    stages = {s['name']: s for s in report['stages']}
    assert {k: s['status'] for k, s in stages.items()} == dict.fromkeys(
        ['test_gpu.py', 'bench tiny 256', 'bench data 256', 'train wmt_base', 'translate beam',
         'translate greedy', 'bench tiny 128'], 'ok'), (out / 'summary.txt').read_text()
    assert res.returncode == 0 and report['data']['src'] == 'xx'  # the languages of meta.json
    assert stages['test_gpu.py']['counts']['skipped'] >= 8 and not stages['test_gpu.py']['failures']
    for name in ('bench tiny 256', 'bench data 256', 'bench tiny 128'):
        assert {r['mode'] for r in stages[name]['rows']} == {'eager'} and all(
            r['step_ms'] > 0 and r['mfu'] > 0 for r in stages[name]['rows'])
    train = stages['train wmt_base']
    assert train['steps'] == 12 and train['steps_per_s'] > 0 and train['recompiles'] == 0
    assert train['bench_row'] == 'bench data 256 eager' and train['vs_bench'] > 0
    assert all(stages[f'translate {s}']['sents_per_s'] > 0 and stages[f'translate {s}']['bleu'] >= 0
               for s in ('beam', 'greedy'))
    assert sorted(os.listdir(out)) == ['bench.log', 'report.json', 'summary.txt', 'tests.log', 'train.log',
                                       'translate.log']
