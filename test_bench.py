import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import bench
import model as M
import translate as T
from test_translate import reverse, toy  # noqa: F401  (toy: a module fixture, a trained checkpoint)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models gain nothing from threads, and on a shared machine a second thread that waits for a
    # busy core makes every op slow; restored afterwards for the other test files.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def micro():
    return M.Config(vocab_size=10, n_enc_layers=1, n_dec_layers=1, d_model=8, d_ff=16, n_heads=2, dropout=0.0)


def test_flops_hand_count():
    # d=8, d_ff=16, V=10, one layer each; B=2 sentences, source padded to S=3, decoder input to T=4.
    # Every matmul (m x k) @ (k x n) costs 2*m*k*n; B*S = 6 source and B*T = 8 target positions.
    enc = (2 * 6 * 8 * 24      # QKV projection           2304
           + 2 * 6 * 8 * 8     # output projection         768
           + 2 * 6 * 8 * 16    # FFN in                   1536
           + 2 * 6 * 16 * 8    # FFN out                  1536
           + 2 * 2 * 3 * 8 * 3  # Q K^T per sentence       288
           + 2 * 2 * 3 * 3 * 8)  # attn @ V               288
    assert enc == 6720
    dec = (2 * 8 * 8 * 24 + 2 * 8 * 8 * 8 + 2 * 8 * 8 * 16 + 2 * 8 * 16 * 8  # self-attn proj, FFN: 8192
           + 2 * 2 * 4 * 8 * 4 + 2 * 2 * 4 * 4 * 8   # self-attn scores, values (full 4x4): 1024
           + 2 * 8 * 8 * 8 + 2 * 8 * 8 * 8           # cross Q and output projection over T: 2048
           + 2 * 6 * 8 * 16                          # cross K, V over the 6 source positions: 1536
           + 2 * 2 * 4 * 8 * 3 + 2 * 2 * 4 * 3 * 8)  # cross scores, values (4x3): 768
    assert dec == 13568
    logits = 2 * 8 * 8 * 10  # 1280
    assert bench.flops_per_step(micro(), B=2, S=3, T=4) == 3 * (6720 + 13568 + 1280) == 64704


@pytest.mark.parametrize('cls', [M.Transformer, bench.Builtin])
def test_flops_match_torch_flop_counter(cls):
    # Independent check: PyTorch's FlopCounterMode over a real forward + backward. The math attention
    # kernel is forced because the counter does not see the fused CPU kernel; its backward happens to
    # be exactly 2x forward, like the formula. Both implementations do the same matmul work.
    torch.manual_seed(0)
    cfg = M.Config(vocab_size=50, n_enc_layers=2, n_dec_layers=1, d_model=16, d_ff=24, n_heads=4, dropout=0.0)
    model = cls(cfg).train()  # train(): torch.nn.Transformer's inference fast path would hide matmuls
    src = torch.tensor([[5, 6, 7, 8, 2], [5, 6, 2, 0, 0], [9, 2, 0, 0, 0]])
    tgt = torch.tensor([[1, 5, 6, 7, 8, 9], [1, 5, 6, 0, 0, 0], [1, 4, 0, 0, 0, 0]])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(src, tgt).sum().backward()
    assert counter.get_total_flops() == bench.flops_per_step(cfg, 3, 5, 6)


def test_builtin_matches_ours_in_size():
    cfg = M.Config(**bench.CONFIGS['tiny'])
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(bench.Builtin(cfg)) == count(M.Transformer(cfg))
    pre = M.Config(**bench.CONFIGS['tiny'], pre_norm=True)
    assert count(bench.Builtin(pre)) == count(M.Transformer(pre))


def test_batches_respect_token_budget():
    cfg = M.Config(**bench.CONFIGS['tiny'])
    rng = np.random.default_rng(0)
    pairs = bench.synthetic_pairs(2000, cfg.vocab_size, rng)
    batches = bench.make_batches(pairs, 1024, cfg, rng, 10, 'cpu')
    assert len(batches) == 10
    for b in batches:
        assert b['src'].numel() <= 1024 and b['tgt_in'].numel() <= 1024
        assert b['n_src'] == int((b['src'] != cfg.pad_id).sum())
        assert b['n_tgt'] == int((b['tgt_in'] != cfg.pad_id).sum())
        assert (b['src'] == cfg.eos_id).sum() == b['src'].size(0)
        assert (b['tgt_in'][:, 0] == cfg.bos_id).all()
        shifted = b['tgt_out'][:, :-1]  # the decoder input is the target shifted right, BOS in front
        torch.testing.assert_close(b['tgt_in'][:, 1:], shifted.masked_fill(shifted == cfg.eos_id, cfg.pad_id))


def test_a_budget_below_the_longest_pairs_leaves_them_out_as_training_does():
    cfg = M.Config(**bench.CONFIGS['tiny'])
    rng = np.random.default_rng(0)
    pairs = bench.synthetic_pairs(2000, cfg.vocab_size, rng)
    assert max(max(len(s), len(t)) + 1 for s, t in pairs) > 40
    for b in bench.make_batches(pairs, 40, cfg, rng, 10 ** 6, 'cpu'):
        assert b['src'].numel() <= 40 and b['tgt_in'].numel() <= 40


def test_recompute_decoding_matches_kv_cache():
    torch.manual_seed(0)
    cfg = M.Config(**bench.CONFIGS['tiny'], dropout=0.0)
    model = M.Transformer(cfg).eval()
    src = bench.collate(bench.synthetic_pairs(6, cfg.vocab_size, np.random.default_rng(1)), cfg, 'cpu')['src']
    cached = M.greedy_decode(model, src, 1.0, 0)
    full = bench.greedy_recompute(model, src, 1.0, 0)
    assert [h[0][0] for h in full] == [h[0][0] for h in cached]


def test_end_to_end_json():
    cmd = [sys.executable, 'bench.py', '--config', 'tiny', '--compile', 'off', '--warmup', '1', '--steps', '2',
           '--batch-tokens', '256', '--decode-sents', '4', '--json', '--profile']
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}  # see one_thread; this is a smoke test, not a measurement
    res = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(res.stdout)  # stdout holds exactly one JSON record; --profile's table goes to stderr
    assert 'aten::mm' in res.stderr and 'Self CPU time total' in res.stderr
    assert {'device', 'torch', 'model_cfg', 'params', 'peak_flops', 'gemm_flops', 'train', 'ratios', 'decode',
            'kv_cache_speedup'} <= set(r)
    dtypes = ['float32'] + (['bfloat16'] if T.fast_dtype('cpu') == 'bfloat16' else [])  # emulated bf16 skipped
    assert [(t['impl'], t['mode'], t['dtype']) for t in r['train']] == (
        [('ours', 'eager', d) for d in dtypes] + [('torch.nn.Transformer', 'eager', d) for d in dtypes])
    for t in r['train']:
        for k in ('step_ms', 'tokens_per_s', 'tgt_tokens_per_s', 'flops_per_s', 'mfu', 'of_gemm', 'peak_mem_bytes'):
            assert t[k] > 0, k
        assert t['of_gemm'] == pytest.approx(t['flops_per_s'] / r['gemm_flops'][t['dtype']])
        assert t['tokens_per_s'] > t['tgt_tokens_per_s']
    assert [(d['search'], d['impl']) for d in r['decode']][:3] == [
        ('greedy', 'model.py'), ('greedy', 'recompute'), ('beam 4', 'model.py')]
    if importlib.util.find_spec('ctranslate2'):  # the same weights through CTranslate2, side by side
        assert [(d['search'], d['impl']) for d in r['decode']][3:] == [
            ('greedy', 'CT2 float32'), ('beam 4', 'CT2 float32'), ('greedy', 'CT2 int8'), ('beam 4', 'CT2 int8')]
    assert all(d['sents_per_s'] > 0 and d['tgt_tokens_per_s'] > 0 for d in r['decode'])
    assert all(v > 0 for v in r['peak_flops'].values()) and all(v > 0 for v in r['ratios'].values())
    assert 'ours/built-in float32' in r['ratios']


def test_real_data_batches(tmp_path):
    # A two-language data/NAME directory in the layout of the README's Formats section, written by hand.
    src_sents, tgt_sents = [[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15, 16], [17]]
    for code, sents in (('de', src_sents), ('en', tgt_sents)):
        np.array([t for s in sents for t in s], dtype=np.uint16).tofile(tmp_path / f'train.{code}.bin')
        np.cumsum([0] + [len(s) for s in sents]).astype(np.int64).tofile(tmp_path / f'train.{code}.idx')
    meta = dict(name='toy', src='de', tgt='en', vocab_size=20, pad_id=0, bos_id=1, eos_id=2, dtype='uint16')
    (tmp_path / 'meta.json').write_text(json.dumps(meta))
    pairs, got = bench.real_pairs(str(tmp_path), 50, np.random.default_rng(0), cap=100)
    assert got['vocab_size'] == 20 and len(pairs) == 50
    assert {(tuple(s), tuple(t)) for s, t in pairs} == {(tuple(s), tuple(t)) for s, t in zip(src_sents, tgt_sents)}
    cfg = M.Config(**{**bench.CONFIGS['tiny'], 'vocab_size': 20})
    (b,) = bench.make_batches(pairs[:3], 1000, cfg, np.random.default_rng(0), 1, 'cpu')
    assert b['n_src'] == sum(len(s) + 1 for s, _ in pairs[:3]) and b['n_tgt'] == sum(len(t) + 1 for _, t in pairs[:3])


def test_translate_rows_decode_the_same_lines_with_model_py_and_its_exports(toy, tmp_path, monkeypatch):
    monkeypatch.setenv('OMP_NUM_THREADS', '1')  # see one_thread: each row is a translate.py process
    ref = tmp_path / 'ref.txt'
    ref.write_text(''.join(reverse(line) + '\n' for line in toy['lines']))
    r = bench.main(['--translate', toy['ckpt'], '--input', toy['src'], '--ref', str(ref), '--rounds', '2',
                    '--device', 'cpu', '--json'])
    n = len(toy['lines'])
    impls = ['model.py', 'model.py --early-stop']
    impls += ['CTranslate2 float32', 'CTranslate2 int8'] if importlib.util.find_spec('ctranslate2') else []
    assert [(x['search'], x['impl']) for x in r['rows']] == (
        [('beam 4', i) for i in impls] + [('greedy', i) for i in impls if i != 'model.py --early-stop'])
    assert r['sentences'] == n and all(len(x['sents_per_s']) == 2 and min(x['sents_per_s']) > 0 for x in r['rows'])
    own = {x['search']: x for x in r['rows'] if x['impl'] == 'model.py'}
    assert all(x['same_as_model_py'] == n and x['vs_model_py'] == 1 and x['dtype'] == 'float32' for x in own.values())
    assert own['beam 4']['bleu'] > 90  # the toy reverses word order: its BLEU against the reversal is high
    if 'CTranslate2 float32' in impls:  # the float32 export's greedy output is model.py's (test_export)
        assert next(x for x in r['rows'] if x['impl'] == 'CTranslate2 float32' and x['search'] == 'greedy')[
            'same_as_model_py'] == n


def test_translate_with_a_missing_input_or_ref_says_so_before_exporting(toy, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, 'run_checked', lambda cmd: pytest.fail(f'ran {cmd[1]}'))
    for flag in ('--input', '--ref'):
        files = {'--input': toy['src'], '--ref': toy['src'], flag: str(tmp_path / 'missing.txt')}
        with pytest.raises(SystemExit) as e:
            bench.main(['--translate', toy['ckpt'], *[x for kv in files.items() for x in kv]])
        assert str(e.value) == f'bench.py: {flag} {tmp_path / "missing.txt"}: no such file'


def test_translate_of_a_missing_checkpoint_a_folder_or_an_empty_input_is_a_one_line_error(tmp_path):
    src = tmp_path / 'src.txt'
    src.write_text('alpha beta\n')
    with pytest.raises(SystemExit) as e:
        bench.main(['--translate', str(tmp_path / 'nope.pt'), '--input', str(src), '--rounds', '1'])
    assert 'nope.pt' in str(e.value) and 'Traceback' not in str(e.value) and '\n' not in str(e.value)
    with pytest.raises(SystemExit) as e:  # translate.py's advice for a folder names its own --average-last
        bench.main(['--translate', str(tmp_path), '--input', str(src)])
    assert 'is a folder' in str(e.value) and 'average-last' not in str(e.value)
    empty = tmp_path / 'empty.txt'
    empty.write_text('')
    with pytest.raises(SystemExit) as e:
        bench.main(['--translate', 'ckpt.pt', '--input', str(empty)])
    assert 'is empty' in str(e.value) and '\n' not in str(e.value)
    for mixed in (['--translate', 'ckpt.pt', '--input', str(src), '--dtype', 'float32'], ['--rounds', '2']):
        with pytest.raises(SystemExit) as e:
            bench.main(mixed)  # an option the run would ignore is an argparse error
        assert e.value.code == 2


@pytest.mark.parametrize('argv, named', [(['--steps', '0'], '--steps'), (['--warmup', '-1'], '--warmup'),
                                         (['--batch-tokens', '0'], '--batch-tokens'),
                                         (['--decode-sents', '0'], '--decode-sents'), (['--device', 'foo'], '--device foo'),
                                         (['--decode-len', '0'], '--decode-len'), (['--decode-len', '1023'], '--decode-len'),
                                         (['--seed', '-1'], '--seed'),
                                         (['--device', 'cuda'], '--device cuda')])
def test_bad_arguments_are_a_usage_error_naming_the_flag(capsys, argv, named):
    if argv == ['--device', 'cuda'] and torch.cuda.is_available():
        pytest.skip('a GPU is there')
    with pytest.raises(SystemExit) as e:
        bench.parse_args(['--config', 'tiny'] + argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_too_few_batches_advise_a_larger_budget():
    with pytest.raises(SystemExit) as e:  # 6 sentences drawn for 2 + 5 batches of at most 10 tokens
        bench.main(['--config', 'tiny', '--warmup', '2', '--steps', '5', '--batch-tokens', '10'])
    assert 'raise --batch-tokens' in str(e.value)
