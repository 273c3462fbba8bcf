"""
Tests for translate.py. A module fixture trains a tiny model.Transformer to reverse the word order of
sentences over a 12-word vocabulary (through a small BPE tokenizer), saves it in the checkpoint format
of the README's Formats section, and translate.py then runs on it as a library, in-process (main) and as a script.
"""
import json
import os
import pty
import random
import select
import subprocess
import sys
from dataclasses import asdict

import pytest
import sacrebleu
import torch

import data_prep
import model as M
import translate as T

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = 'alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron'.split()
# Two shared cores: one thread per process is faster than oversubscribed ones, in the fixture and scripts.
ENV = {**os.environ, 'OMP_NUM_THREADS': '1'}


def sentence(rng):
    return ' '.join(rng.sample(WORDS, rng.randint(1, 9)))  # distinct words: reversal is quick to learn


def reverse(s):
    return ' '.join(s.split()[::-1])


def make_tokenizer(corpus):
    d = data_prep.train_tokenizer(iter(corpus), 400, 'toy')
    return d, data_prep.load_tokenizer(d)


def train_reversal(steps=250, **overrides):
    """A tiny model trained to reverse word order -> (model in eval mode, tokenizer dict, Encoding, Config).
    Also used by test_export.py."""
    rng = random.Random(0)
    d, enc = make_tokenizer([sentence(rng) for _ in range(3000)])
    sp = d['special_tokens']
    cfg = M.Config(**{**dict(vocab_size=enc.n_vocab, n_enc_layers=2, n_dec_layers=2, d_model=64, d_ff=128,
                             n_heads=4, dropout=0.0, max_len=80, pad_id=sp['<pad>'], bos_id=sp['<s>'],
                             eos_id=sp['</s>']), **overrides})
    torch.manual_seed(0)
    model = M.Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def pad(seqs):
        return torch.tensor([s + [cfg.pad_id] * (max(map(len, seqs)) - len(s)) for s in seqs])

    for _ in range(steps):
        batch = [sentence(rng) for _ in range(64)]
        src = pad([enc.encode_ordinary(s) + [cfg.eos_id] for s in batch])
        tgt = [enc.encode_ordinary(reverse(s)) for s in batch]
        loss, _, n = M.label_smoothed_loss(model(src, pad([[cfg.bos_id] + t for t in tgt])),
                                           pad([t + [cfg.eos_id] for t in tgt]), 0.0, cfg.pad_id)
        opt.zero_grad()
        (loss / n).backward()
        opt.step()
    return model.eval(), d, enc, cfg


@pytest.fixture(scope='module')
def toy(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, d, enc, cfg = train_reversal()
    folder = tmp_path_factory.mktemp('toy')
    ckpt = folder / 'ckpt.pt'
    torch.save({'model': model.state_dict(), 'model_cfg': asdict(cfg), 'tokenizer': d, 'step': 250,
                'config': {}}, ckpt)
    # Lengths deliberately out of order, so that length-sorted batches would scramble a naive writer.
    lines = [sentence(random.Random(i)) for i in range(24)]
    src_file = folder / 'test.src'
    src_file.write_text(''.join(line + '\n' for line in lines))
    yield dict(folder=folder, ckpt=str(ckpt), model=model, enc=enc, cfg=cfg, lines=lines, src=str(src_file))
    torch.set_num_threads(threads)


def own_decode(toy, line, greedy=False, nbest=1, early_stop=False):
    """The model's own output for one sentence alone (no batching, no padding)."""
    src = torch.tensor([toy['enc'].encode_ordinary(line) + [toy['cfg'].eos_id]])
    if greedy:
        return M.greedy_decode(toy['model'], src, 1, 50)[0]
    return M.beam_search(toy['model'], src, 4, 0.6, 1, 50, nbest, early_stop)[0]


def run(args, **kw):
    return subprocess.run([sys.executable, os.path.join(HERE, 'translate.py'), *args], capture_output=True,
                          env=ENV, cwd=HERE, timeout=120, **kw)


def test_file_translation_matches_model_beam_in_input_order(toy, tmp_path):
    lens = [len(toy['enc'].encode_ordinary(line)) for line in toy['lines']]
    assert lens != sorted(lens) and lens != sorted(lens, reverse=True)
    out = tmp_path / 'hyp'
    r = run(['--ckpt', toy['ckpt'], '--input', toy['src'], '--output', str(out), '--max-tokens', '40'])
    assert r.returncode == 0, r.stderr.decode()
    hyps = out.read_text(encoding='utf-8').split('\n')
    assert hyps[-1] == '' and len(hyps) == len(toy['lines']) + 1
    expected = [toy['enc'].decode(own_decode(toy, line)[0][0]) for line in toy['lines']]
    assert hyps[:-1] == expected
    # The comparison means something only if outputs differ by input: the model has learnt the task.
    assert sum(h == reverse(line) for h, line in zip(expected, toy['lines'])) >= 0.8 * len(expected)
    assert b'sentences/s' in r.stderr and b'target tokens/s' in r.stderr


def test_early_stop_flag_decodes_with_model_early_stop(toy, tmp_path, capsys):
    # 4-best lists: the toy's best hypotheses are the same under both stopping rules, its 4-best lists not.
    out = tmp_path / 'nbest'
    T.main(['--ckpt', toy['ckpt'], '--input', toy['src'], '--output', str(out), '--nbest', '4', '--early-stop'])
    assert 'early stop)' in capsys.readouterr().err  # the summary line says which rule ran
    hyps = [row.split('\t')[1] for row in out.read_text(encoding='utf-8').splitlines()]
    expected = [[toy['enc'].decode(t) for t, _ in own_decode(toy, line, nbest=4, early_stop=e)] for e in (True, False)
                for line in toy['lines']]
    n = len(toy['lines'])
    assert hyps == [h for group in expected[:n] for h in group] and expected[:n] != expected[n:]


def test_greedy_from_stdin_to_stdout_matches_model_greedy_decode(toy):
    with open(toy['src'], 'rb') as f:
        r = run(['--ckpt', toy['ckpt'], '--greedy', '--max-tokens', '30'], stdin=f)
    assert r.returncode == 0, r.stderr.decode()
    expected = [toy['enc'].decode(own_decode(toy, line, greedy=True)[0][0]) for line in toy['lines']]
    assert r.stdout.decode('utf-8').split('\n') == expected + ['']


def test_translate_lines_streams_in_input_order_and_leaves_caller_state_alone(toy, monkeypatch):
    calls = []
    real = M.greedy_decode
    monkeypatch.setattr(M, 'greedy_decode', lambda *a: calls.append(1) or real(*a))
    model, lines = toy['model'], [' '.join(WORDS[:9])] + toy['lines']  # the longest first: decoded first
    model.train()
    stats = {}
    gen = T.translate_lines(model, toy['enc'], lines, greedy=True, max_tokens=30, stats=stats)
    first = next(gen)
    assert len(calls) == 1  # streamed after the first batch, not after all of them
    assert torch.is_grad_enabled() and not model.training  # no_grad does not leak out of the generator
    hyps = [first] + list(gen)
    assert len(calls) > 3 and model.training  # several batches; the caller's train mode restored
    model.eval()
    assert hyps == [toy['enc'].decode(own_decode(toy, line, greedy=True)[0][0]) for line in lines]
    assert stats['sentences'] == len(lines) and stats['tgt_tokens'] > len(lines)


def test_nbest_lists_n_hypotheses_per_line_sorted_by_score(toy, tmp_path):
    out = tmp_path / 'nbest'
    T.main(['--ckpt', toy['ckpt'], '--input', toy['src'], '--output', str(out), '--nbest', '3'])
    rows = [row.split('\t') for row in out.read_text(encoding='utf-8').splitlines()]
    assert len(rows) == 3 * len(toy['lines'])
    for i, line in enumerate(toy['lines']):
        group = rows[3 * i:3 * i + 3]
        scores = [float(s) for s, _ in group]
        assert scores == sorted(scores, reverse=True) and len({h for _, h in group}) == 3
        own = own_decode(toy, line, nbest=3)
        assert [h for _, h in group] == [toy['enc'].decode(t) for t, _ in own]
        assert scores == pytest.approx([s for _, s in own], abs=2e-4)


def test_lenpen_defaults_to_the_one_the_checkpoint_was_validated_with(toy, tmp_path):
    # train.py keeps bleu_lenpen in the checkpoint's config; translate.py decodes with it unless --lenpen
    # says otherwise, and with the paper's 0.6 where the config has none. nbest scores show the alpha used.
    tuned = tmp_path / 'tuned.pt'
    torch.save({**torch.load(toy['ckpt'], weights_only=True), 'config': {'bleu_lenpen': 1.5}}, tuned)

    def scores(ckpt, *extra):
        out = tmp_path / 'nbest'
        T.main(['--ckpt', str(ckpt), '--input', toy['src'], '--output', str(out), '--nbest', '2', *extra])
        return out.read_text(encoding='utf-8')
    assert scores(tuned) == scores(toy['ckpt'], '--lenpen', '1.5') != scores(toy['ckpt'])
    assert scores(toy['ckpt']) == scores(tuned, '--lenpen', '0.6')


def test_compiled_decoding_gives_the_eager_output(toy, tmp_path, monkeypatch):
    import torch._inductor.config as inductor
    monkeypatch.setattr(inductor, 'freezing', inductor.freezing)  # --compile sets it for the whole process
    out = {}
    for flags in ([], ['--compile']):
        out[bool(flags)] = tmp_path / f'hyp{len(flags)}'
        T.main(['--ckpt', toy['ckpt'], '--input', toy['src'], '--output', str(out[bool(flags)]), *flags])
    assert out[True].read_text(encoding='utf-8') == out[False].read_text(encoding='utf-8')


def test_bad_input_gives_exactly_one_output_line_per_input_line(toy, tmp_path):
    long_line = ' '.join(WORDS * 7)  # 84 tokens: more than the toy model's max_len 80 holds
    raw = [b'alpha beta gamma\r\n', b'\n', b'   \n', long_line.encode() + b'\n', b'beta \xff\xfe delta\n',
           b'alpha\rbeta\n', 'eta\u2028theta'.encode() + b'\n', b'</s> <pad> kappa\r\n', b'\r\n',
           b'alpha beta gamma']  # the last line has no newline
    src = tmp_path / 'bad.src'
    src.write_bytes(b''.join(raw))
    out = tmp_path / 'bad.hyp'
    r = run(['--ckpt', toy['ckpt'], '--input', str(src), '--output', str(out)])
    assert r.returncode == 0, r.stderr.decode()
    text = out.read_bytes().decode('utf-8')
    hyps = text.split('\n')
    assert len(hyps) == len(raw) + 1 and hyps[-1] == '' and text.splitlines() == hyps[:-1]  # no stray breaks
    assert hyps[1] == hyps[2] == hyps[8] == ''
    assert hyps[0] == hyps[9] == toy['enc'].decode(own_decode(toy, 'alpha beta gamma')[0][0])
    err = r.stderr.decode()
    assert 'line 4:' in err and 'truncated' in err and 'line 5:' in err and 'UTF-8' in err


def test_a_source_that_fits_the_positional_table_is_translated_whole(toy, capsys):
    # As fairseq: the table cuts the source, and lowers the output cap a * |src| + b where it must. A 48-token
    # line under max_len 80 was cut to 28 tokens to leave the +50 room, and at b = 78 one token longer
    # than b = 77 allowed moved the cut from 1 token to the whole table.
    line = ' '.join(WORDS * 4)
    for b in (50, 77, 78):
        out = list(T.translate_lines(toy['model'], toy['enc'], [line], greedy=True, max_len_b=b))
        assert 'truncated' not in capsys.readouterr().err
        assert out == [toy['enc'].decode(M.greedy_decode(toy['model'], torch.tensor(
            [toy['enc'].encode_ordinary(line) + [toy['cfg'].eos_id]]), 1, b)[0][0][0])]


def test_a_translation_that_reaches_the_positional_table_is_named(toy, capsys):
    # A decoder that never ends: its last layer's output is the constant 1, and EOS has the lowest logit.
    model, cfg = M.Transformer(toy['cfg']).eval(), toy['cfg']
    model.load_state_dict(toy['model'].state_dict())
    with torch.no_grad():
        model.decoder[-1].norm3.weight.zero_(), model.decoder[-1].norm3.bias.fill_(1.0)
        model.embed.weight[cfg.eos_id] = -1.0
        model.embed.weight[toy['enc'].encode_ordinary('alpha')[0]] = 1.0
    short, long = 'alpha beta', ' '.join(WORDS * 4)  # caps 3 + 50 and 49 + 50 > the table's 79
    out = list(T.translate_lines(model, toy['enc'], [short, long], greedy=True, first_line=7))
    err = capsys.readouterr().err
    assert len(toy['enc'].encode_ordinary(out[1])) >= cfg.max_len - 2
    assert 'line 8:' in err and f'max_len {cfg.max_len}' in err and 'line 7:' not in err


def test_an_output_cap_far_past_the_table_is_the_table_not_an_empty_translation(toy):
    lines = toy['lines'][:4]
    table = list(T.translate_lines(toy['model'], toy['enc'], lines, greedy=True, max_len_a=toy['cfg'].max_len))
    assert all(table) and table == list(T.translate_lines(toy['model'], toy['enc'], lines, greedy=True, max_len_a=1e30))
    assert table == list(T.translate_lines(toy['model'], toy['enc'], lines, greedy=True, max_len_b=10 ** 20))


def test_hypotheses_never_contain_line_breaks(toy, monkeypatch):
    # A model may well generate a newline token; written out as is, it would shift every later line.
    enc = toy['enc']
    fake = [(enc.encode_ordinary('a\nb\r\nc\u2028d\x0be'), -1.0)]
    monkeypatch.setattr(M, 'beam_search', lambda model, src, *a: [fake] * len(src))
    hyps = list(T.translate_lines(toy['model'], enc, ['alpha', '', 'beta gamma']))
    assert hyps == ['a b  c d e', '', 'a b  c d e']


def test_ref_with_the_reference_as_hypothesis_gives_bleu_100(toy, tmp_path):
    hyp = tmp_path / 'hyp'
    T.main(['--ckpt', toy['ckpt'], '--input', toy['src'], '--output', str(hyp)])
    r = run(['--ckpt', toy['ckpt'], '--input', toy['src'], '--output', str(tmp_path / 'hyp2'),
             '--ref', str(hyp), '--paper-bleu'])
    assert r.returncode == 0, r.stderr.decode()
    err = r.stderr.decode()
    assert 'sacreBLEU: BLEU = 100.00' in err and 'nrefs:1|case:mixed|eff:no|tok:13a' in err
    assert 'chrF2 = 100.00' in err and 'paper BLEU' in err and err.count('BLEU = 100.00') == 2


def test_ref_of_an_empty_input_or_of_typed_lines_is_a_clear_message(toy, tmp_path, capsys, monkeypatch):
    (tmp_path / 'empty').write_text('')
    T.main(['--ckpt', toy['ckpt'], '--input', str(tmp_path / 'empty'), '--ref', str(tmp_path / 'empty')])
    assert 'is empty: nothing to score' in capsys.readouterr().err
    monkeypatch.setattr(sys, 'stdin', type('Terminal', (), {'isatty': lambda self: True})())
    with pytest.raises(SystemExit):
        T.main(['--ckpt', toy['ckpt'], '--ref', toy['src']])
    assert '--ref scores a whole --input' in capsys.readouterr().err


def test_negative_output_length_settings_are_refused(capsys):
    for flag in ('--max-len-a=-1', '--max-len-b=-5'):
        with pytest.raises(SystemExit):  # they would cap every output at 1 token, silently
            T.main(['--ckpt', 'unused.pt', flag])
        assert '--max-len-a and --max-len-b must be at least 0' in capsys.readouterr().err


def test_output_file_appears_only_when_complete(toy, tmp_path, monkeypatch):
    out = tmp_path / 'hyp'
    out.write_text('the previous translation\n')

    def stopped(model, enc, lines, **kw):  # one line out, then the run dies
        yield 'first'
        raise KeyboardInterrupt
    monkeypatch.setattr(T, 'translate_lines', stopped)
    with pytest.raises(KeyboardInterrupt):
        T.main(['--ckpt', toy['ckpt'], '--input', toy['src'], '--output', str(out)])
    # The old file stands, and the stopped run's part is gone (not left to look like a result).
    assert out.read_text() == 'the previous translation\n' and sorted(os.listdir(tmp_path)) == ['hyp']
    monkeypatch.undo()
    T.main(['--ckpt', toy['ckpt'], '--input', toy['src'], '--output', str(out)])
    assert len(out.read_text().splitlines()) == len(toy['lines']) and sorted(os.listdir(tmp_path)) == ['hyp']
    with pytest.raises(SystemExit) as e:  # before the model loads
        T.main(['--ckpt', str(tmp_path / 'missing.pt'), '--input', toy['src'], '--output', str(tmp_path / 'no' / 'hyp')])
    assert f"--output {tmp_path / 'no' / 'hyp'}: No such file or directory" in str(e.value)
    with pytest.raises(SystemExit) as e:
        T.main(['--ckpt', str(tmp_path / 'missing.pt'), '--average-last', '2', '--save-average', str(tmp_path / 'no' / 'a.pt')])
    assert f"--save-average {tmp_path / 'no' / 'a.pt'}: No such file or directory" in str(e.value)
    with pytest.raises(SystemExit) as e:  # a folder without --average-last
        T.main(['--ckpt', str(tmp_path), '--input', toy['src']])
    assert f'{tmp_path} is a folder' in str(e.value) and '--average-last' in str(e.value)


def test_an_output_is_never_an_input_a_folder_or_another_runs_temporary_file(toy, tmp_path):
    theirs = tmp_path / 'hyp.tmp'  # another run's, or the user's
    theirs.write_text('not ours\n')
    with pytest.raises(SystemExit):
        T.main(['--ckpt', str(tmp_path / 'missing.pt'), '--input', toy['src'], '--output', str(tmp_path / 'hyp')])
    T.main(['--ckpt', toy['ckpt'], '--input', toy['src'], '--output', str(tmp_path / 'hyp')])
    assert theirs.read_text() == 'not ours\n' and len((tmp_path / 'hyp').read_text().splitlines()) == len(toy['lines'])
    src, ckpt = tmp_path / 'src', tmp_path / 'ckpt.pt'
    src.write_text('alpha beta\n')
    ckpt.write_bytes(open(toy['ckpt'], 'rb').read())
    for args in (['--input', str(src), '--output', str(src)], ['--input', str(src), '--output', str(ckpt)],
                 ['--input', toy['src'], '--ref', str(src), '--output', str(src)]):
        with pytest.raises(SystemExit) as e:
            T.main(['--ckpt', str(ckpt), *args])
        assert 'would overwrite' in str(e.value)
    assert src.read_text() == 'alpha beta\n' and T.read_checkpoint(str(ckpt))
    (tmp_path / 'sub').mkdir()
    with pytest.raises(SystemExit) as e:  # before the model loads, not in the rename at the end
        T.main(['--ckpt', str(tmp_path / 'missing.pt'), '--input', str(src), '--output', str(tmp_path / 'sub')])
    assert f"--output {tmp_path / 'sub'} is a folder" in str(e.value)
    (tmp_path / 'real').write_text('old\n')
    (tmp_path / 'link').symlink_to(tmp_path / 'real')
    T.main(['--ckpt', str(ckpt), '--input', str(src), '--output', str(tmp_path / 'link')])
    assert (tmp_path / 'link').is_symlink() and (tmp_path / 'real').read_text() != 'old\n'
    assert not list(tmp_path.glob('*.tmp')) or list(tmp_path.glob('*.tmp')) == [theirs]


def test_averaging_refuses_to_overwrite_its_inputs_or_mix_runs(toy, tmp_path):
    folder = tmp_path / 'run'
    folder.mkdir()
    ckpt = torch.load(toy['ckpt'], weights_only=True)
    for step in (1, 2):
        torch.save(ckpt, folder / f'ckpt_{step:07d}.pt')
    with pytest.raises(SystemExit) as e:
        T.main(['--ckpt', str(folder), '--average-last', '2', '--input', toy['src'],
                '--save-average', str(folder / 'ckpt_0000002.pt')])
    assert 'would overwrite' in str(e.value)
    with pytest.raises(SystemExit) as e:  # one new file for both outputs: the translations would replace the average
        T.main(['--ckpt', str(folder), '--average-last', '2', '--input', toy['src'], '--output', str(tmp_path / 'x'),
                '--save-average', str(tmp_path / 'x')])
    assert '--save-average' in str(e.value) and 'is also --output' in str(e.value) and not (tmp_path / 'x').exists()
    with pytest.raises(SystemExit) as e:  # a missing --ckpt is not its folder
        T.main(['--ckpt', str(folder / 'nope.pt'), '--average-last', '2', '--input', toy['src']])
    assert 'nope.pt' in str(e.value) and 'not found' in str(e.value)
    other = {**ckpt, 'tokenizer': {**ckpt['tokenizer'], 'pattern': ckpt['tokenizer']['pattern'] + '|x'}}
    torch.save(other, folder / 'ckpt_0000003.pt')
    with pytest.raises(SystemExit) as e:
        T.average_checkpoints([str(folder / 'ckpt_0000002.pt'), str(folder / 'ckpt_0000003.pt')])
    assert 'ckpt_0000003.pt' in str(e.value) and 'tokenizer' in str(e.value)
    torch.save({**ckpt, 'model_cfg': {**ckpt['model_cfg'], 'eos_id': 5}}, folder / 'ckpt_0000004.pt')
    with pytest.raises(SystemExit) as e:
        T.average_checkpoints([str(folder / 'ckpt_0000002.pt'), str(folder / 'ckpt_0000004.pt')])
    assert 'ckpt_0000004.pt' in str(e.value) and 'eos_id' in str(e.value)


def test_an_output_never_overwrites_an_averaged_checkpoint_or_an_exports_file(toy, tmp_path):
    run_dir, export = tmp_path / 'run', tmp_path / 'ct2'
    run_dir.mkdir()
    export.mkdir()
    for step in (1, 2):
        (run_dir / f'ckpt_{step:07d}.pt').write_bytes(open(toy['ckpt'], 'rb').read())
    (export / T.CT2_MARKER).write_text('{}')  # refused before it loads: what is in the files does not matter
    (export / 'model.bin').write_text('weights')
    for args in (['--ckpt', str(run_dir), '--average-last', '2', '--output', str(run_dir / 'ckpt_0000002.pt')],
                 ['--ckpt', str(run_dir / 'ckpt_0000001.pt'), '--average-last', '2',
                  '--output', str(run_dir / 'ckpt_0000002.pt')],
                 ['--ckpt', str(export), '--output', str(export / 'model.bin')]):
        with pytest.raises(SystemExit) as e:
            T.main([*args, '--input', toy['src'], '--greedy'])
        assert 'would overwrite' in str(e.value), args
    assert T.read_checkpoint(str(run_dir / 'ckpt_0000002.pt')) and (export / 'model.bin').read_text() == 'weights'


def test_an_output_is_never_the_file_standard_input_reads(toy, tmp_path):
    src = tmp_path / 'src'
    src.write_text('alpha beta\n')
    with open(src) as f:  # `translate.py --output src < src`
        r = run(['--ckpt', toy['ckpt'], '--greedy', '--output', str(src)], stdin=f)
    assert r.returncode == 1 and b'would overwrite' in r.stderr and src.read_text() == 'alpha beta\n'
    r = run(['--ckpt', toy['ckpt'], '--greedy', '--output', str(src)], input=b'beta alpha\n')  # a pipe is no file
    assert r.returncode == 0 and src.read_text().count('\n') == 1


def test_an_output_stream_that_is_an_input_file_is_refused(toy, tmp_path):
    src = tmp_path / 'src'
    src.write_text('alpha beta\n')
    with open(src) as f:  # `translate.py --output /dev/fd/0 < src`: the shell's file, opened again to write
        r = run(['--ckpt', toy['ckpt'], '--greedy', '--output', '/dev/fd/0'], stdin=f)
    assert r.returncode == 1 and b'would overwrite' in r.stderr and src.read_text() == 'alpha beta\n', r.stderr
    with open(src, 'a') as f:  # `translate.py --input src --output /dev/stdout >> src`
        r = subprocess.run([sys.executable, os.path.join(HERE, 'translate.py'), '--ckpt', toy['ckpt'], '--greedy',
                            '--input', str(src), '--output', '/dev/stdout'], stdout=f, stderr=subprocess.PIPE, env=ENV)
    assert r.returncode == 1 and b'would overwrite' in r.stderr and src.read_text() == 'alpha beta\n', r.stderr


def test_output_to_dev_stdout_appends_to_a_redirected_file_and_writes_to_a_pipe(toy, tmp_path):
    log = tmp_path / 'log.txt'
    log.write_text('KEEP ME\n')
    args = ['--ckpt', toy['ckpt'], '--input', toy['src'], '--greedy', '--output', '/dev/stdout']
    with open(log, 'a') as f:  # `>> log.txt`: resolved, /dev/stdout is log.txt, which a rename would replace
        subprocess.run([sys.executable, os.path.join(HERE, 'translate.py'), *args], stdout=f, env=ENV, check=True)
    assert log.read_text().splitlines()[0] == 'KEEP ME' and len(log.read_text().splitlines()) == len(toy['lines']) + 1
    res = run(args)  # a pipe: /proc/PID/fd/pipe:[N] is no path to make a temporary file beside
    assert res.returncode == 0 and len(res.stdout.decode().splitlines()) == len(toy['lines']), res.stderr


def test_an_output_stream_that_is_not_open_is_a_one_line_error_before_any_work(toy, tmp_path):
    with pytest.raises(SystemExit) as e:
        T.main(['--ckpt', str(tmp_path / 'missing.pt'), '--input', toy['src'], '--output', '/dev/fd/987'])
    assert '--output /dev/fd/987: No such file or directory' in str(e.value)


def test_a_file_under_dev_is_replaced_not_appended_to(toy):
    if not os.path.isdir('/dev/shm'):
        pytest.skip('no /dev/shm')
    assert T.is_stream('/dev/stdout') and T.is_stream('/dev/fd/1') and T.is_stream('/dev/null')
    out = f'/dev/shm/test_translate_{os.getpid()}.txt'
    try:
        with open(out, 'w') as f:
            f.write('old\n')
        assert not T.is_stream(out)
        T.main(['--ckpt', toy['ckpt'], '--input', toy['src'], '--greedy', '--output', out])
        assert 'old' not in open(out).read().splitlines() and len(open(out).read().splitlines()) == len(toy['lines'])
    finally:
        os.remove(out)


def test_written_files_are_as_readable_as_the_umask_allows(tmp_path):
    old = os.umask(0o022)
    try:
        T.save_atomic({'step': 1}, str(tmp_path / 'ckpt.pt'))  # mkstemp's temporary file is 0600
    finally:
        os.umask(old)
    assert os.stat(tmp_path / 'ckpt.pt').st_mode & 0o777 == 0o644


def test_non_finite_settings_and_unknown_devices_are_one_line_errors(toy, capsys):
    for flags in (['--max-len-a', 'nan'], ['--max-len-a', 'inf'], ['--lenpen', 'nan'], ['--device', 'foo'],
                  ['--device', 'meta']):
        with pytest.raises(SystemExit) as e:
            T.main(['--ckpt', toy['ckpt'], '--input', toy['src'], *flags])
        assert e.value.code == 2 and flags[0] in capsys.readouterr().err


def test_closed_standard_input_is_a_one_line_error(toy):
    r = subprocess.run([sys.executable, os.path.join(HERE, 'translate.py'), '--ckpt', toy['ckpt']], capture_output=True,
                       env=ENV, cwd=HERE, timeout=120, stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(0))
    assert r.returncode == 2 and b'--input' in r.stderr and b'Traceback' not in r.stderr


def test_a_checkpoint_with_settings_no_model_has_is_a_one_line_error_naming_it(toy, tmp_path):
    ckpt = torch.load(toy['ckpt'], weights_only=False)
    cfg = ckpt['model_cfg']
    for name, damage in [('heads', {'model_cfg': {**cfg, 'n_heads': 3}}), ('text', {'model_cfg': {**cfg, 'n_heads': 'four'}}),
                         ('layers', {'model_cfg': {**cfg, 'n_enc_layers': 0}}), ('eos', {'model_cfg': {**cfg, 'eos_id': -1}}),
                         ('weights', {'model': torch.zeros(3)}),
                         ('lenpen', {'config': {'bleu_lenpen': '1.2'}}), ('negative', {'config': {'bleu_lenpen': -1.0}})]:
        path = tmp_path / f'{name}.pt'
        torch.save({**ckpt, **damage}, path)
        with pytest.raises(SystemExit) as e:
            T.main(['--ckpt', str(path), '--input', toy['src'], '--greedy', '--output', str(tmp_path / 'out')])
        assert str(path) in str(e.value) and '\n' not in str(e.value), name
    assert not (tmp_path / 'out').exists()


def test_decoding_on_a_gpu_without_bf16_defaults_to_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda *a, **k: False)  # e.g. a V100 or a T4
    assert T.default_dtype('cuda:0') == 'float32' and T.default_dtype('cpu') == 'float32'
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda *a, **k: True)
    assert T.default_dtype('cuda') == 'bfloat16' and T.default_dtype('cpu') == 'float32'


def test_closed_standard_output_without_output_is_a_one_line_error(toy):
    r = subprocess.run([sys.executable, os.path.join(HERE, 'translate.py'), '--ckpt', toy['ckpt'], '--input', toy['src']],
                       stderr=subprocess.PIPE, env=ENV, cwd=HERE, timeout=120, preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and b'--output' in r.stderr and b'Traceback' not in r.stderr, r.stderr


def test_a_full_disk_is_a_one_line_error(toy):
    with open('/dev/full', 'w') as full:
        r = subprocess.run([sys.executable, os.path.join(HERE, 'translate.py'), '--ckpt', toy['ckpt'], '--input',
                            toy['src'], '--greedy'], stdout=full, stderr=subprocess.PIPE, env=ENV, cwd=HERE, timeout=120)
    assert r.returncode == 1 and b'No space left on device' in r.stderr and b'Traceback' not in r.stderr


def test_a_reader_that_stops_early_is_no_traceback(toy, tmp_path):
    (tmp_path / 'many').write_text(''.join(line + '\n' for line in toy['lines'] * 150))  # more than a pipe holds
    cat = subprocess.Popen([sys.executable, os.path.join(HERE, 'translate.py'), '--ckpt', toy['ckpt'], '--input',
                            str(tmp_path / 'many'), '--greedy'], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=ENV, cwd=HERE)
    cat.stdout.readline()
    cat.stdout.close()  # as `| head -1` does
    assert b'Traceback' not in cat.stderr.read() and cat.wait(timeout=60) != 0


def test_bleu_of_a_known_pair_equals_sacrebleu_and_the_formula():
    hyps, refs = ['the cat sat on the mat'], ['the cat sat on a mat']
    score = T.bleu(hyps, refs).score
    assert score == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    # Precisions 5/6, 3/5, 2/4, 1/3; equal lengths, so no brevity penalty.
    assert score == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)
    with pytest.raises(ValueError):
        T.bleu(hyps, refs * 2)


def test_paper_bleu_tokenises_and_splits_hyphenated_compounds():
    hyps, refs = ['Das Software-Update ist da.'], ['Das Software-Paket ist "da".']
    want = sacrebleu.metrics.BLEU(tokenize='none').corpus_score(
        ['Das Software ##AT##-##AT## Update ist da .'], [['Das Software ##AT##-##AT## Paket ist " da " .']])
    assert T.paper_bleu(hyps, refs).score == pytest.approx(want.score)
    assert T.paper_bleu(hyps, refs).score > T.bleu(hyps, refs).score


def test_average_checkpoints_is_the_elementwise_mean_of_the_newest_by_step(toy, tmp_path):
    base = torch.load(toy['ckpt'], weights_only=True)
    states = {}
    for step in (90, 100, 1000):  # by name, ckpt_90.pt would sort last
        g = torch.Generator().manual_seed(step)
        states[step] = {k: v + torch.randn(v.shape, generator=g) for k, v in base['model'].items()}
        torch.save({**base, 'model': states[step], 'step': step}, tmp_path / f'ckpt_{step}.pt')
    torch.save({**base, 'model': states[90]}, tmp_path / 'ckpt_best.pt')
    avg = T.average_checkpoints([str(tmp_path / 'ckpt_100.pt'), str(tmp_path / 'ckpt_1000.pt')])
    for k, v in avg.items():
        torch.testing.assert_close(v, (states[100][k] + states[1000][k]) / 2)
    (tmp_path / 'in.txt').write_text('alpha beta\n')
    T.main(['--ckpt', str(tmp_path), '--average-last', '2', '--save-average', str(tmp_path / 'avg.pt'),
            '--input', str(tmp_path / 'in.txt'), '--output', str(tmp_path / 'out.txt')])
    saved = T.load_checkpoint(str(tmp_path / 'avg.pt'))[2]
    assert saved['averaged'] == ['ckpt_100.pt', 'ckpt_1000.pt'] and saved['step'] == 1000
    for k, v in avg.items():
        assert torch.equal(saved['model'][k], v)
    assert len((tmp_path / 'out.txt').read_text().splitlines()) == 1
    with pytest.raises(SystemExit) as e:  # found[-n:] with a negative n took the oldest
        T.newest_checkpoints(str(tmp_path), -2)
    assert '--average-last -2: must be at least 1' in str(e.value)
    # Low-precision weights are summed in float64 and come back in their own dtype.
    for i, w in enumerate([1.0, 2.0, 4.0]):
        torch.save({'model': {'w': torch.full((3,), w, dtype=torch.bfloat16)}}, tmp_path / f'b{i}.pt')
    w = T.average_checkpoints([str(tmp_path / f'b{i}.pt') for i in range(3)])['w']
    assert w.dtype == torch.bfloat16 and torch.equal(w, torch.full((3,), 7 / 3).bfloat16())


def test_checkpoints_naming_their_tokenizer_file_average(toy, tmp_path):
    ckpt = torch.load(toy['ckpt'], weights_only=True)
    (tmp_path / 'tokenizer.json').write_text(json.dumps(ckpt['tokenizer']))
    for step in (1, 2):  # the tokenizer as a path beside the checkpoint, which load_checkpoint reads
        torch.save({**ckpt, 'tokenizer': 'tokenizer.json'}, tmp_path / f'ckpt_{step:07d}.pt')
    out, avg = tmp_path / 'hyp', tmp_path / 'elsewhere' / 'avg.pt'
    avg.parent.mkdir()
    T.main(['--ckpt', str(tmp_path), '--average-last', '2', '--input', toy['src'], '--greedy', '--output', str(out),
            '--save-average', str(avg)])
    expected = [toy['enc'].decode(own_decode(toy, s, greedy=True)[0][0]) for s in toy['lines']]
    assert out.read_text().splitlines() == expected
    # The average, in another folder, carries its tokenizer: the relative path would not resolve there.
    T.main(['--ckpt', str(avg), '--input', toy['src'], '--greedy', '--output', str(out)])
    assert out.read_text().splitlines() == expected


def test_bad_checkpoints_are_clear_one_line_errors_naming_the_file(toy, tmp_path):
    base = torch.load(toy['ckpt'], weights_only=True)
    cases = {'missing.pt': None,
             'notok.pt': {k: v for k, v in base.items() if k != 'tokenizer'},
             'small_vocab.pt': {**base, 'model_cfg': {**base['model_cfg'], 'vocab_size': 100}},
             'other_eos.pt': {**base, 'model_cfg': {**base['model_cfg'], 'eos_id': 5}}}
    words = {'missing.pt': 'not found', 'notok.pt': 'missing tokenizer', 'small_vocab.pt': 'vocab_size',
             'other_eos.pt': '</s>'}
    for name, ckpt in cases.items():
        if ckpt is not None:
            torch.save(ckpt, tmp_path / name)
        with pytest.raises(SystemExit) as e:
            T.load_checkpoint(str(tmp_path / name))
        msg = str(e.value)
        assert str(tmp_path / name) in msg and words[name] in msg and '\n' not in msg
    r = run(['--ckpt', str(tmp_path / 'missing.pt')], stdin=subprocess.DEVNULL)
    assert r.returncode != 0 and r.stderr.decode().strip().count('\n') == 0 and b'missing.pt' in r.stderr
    (tmp_path / 'notes.pt').write_text('some text, not a checkpoint\n')
    with pytest.raises(SystemExit) as e:  # not torch's advice to load it with weights_only=False (it runs code)
        T.load_checkpoint(str(tmp_path / 'notes.pt'))
    assert 'notes.pt' in str(e.value) and 'not a checkpoint' in str(e.value) and 'weights_only' not in str(e.value)


def test_interactive_terminal_translates_each_line_as_typed(toy):
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, os.path.join(HERE, 'translate.py'), '--ckpt', toy['ckpt']],
                         stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=ENV, cwd=HERE)
    os.close(slave)
    try:
        for line in toy['lines'][:2]:
            os.write(master, line.encode() + b'\n')
            # The answer must come while stdin is still open: line by line, not at end of input.
            assert select.select([p.stdout], [], [], 60)[0], "no output within 60 s"
            got = p.stdout.readline().decode().rstrip('\n')
            assert got == toy['enc'].decode(own_decode(toy, line)[0][0])
        os.write(master, b'\x04')  # Ctrl-D
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        os.close(master)


def test_bfloat16_autocast_decoding_on_cpu_mostly_agrees_with_float32(toy):
    fp32 = list(T.translate_lines(toy['model'], toy['enc'], toy['lines']))
    bf16 = list(T.translate_lines(toy['model'], toy['enc'], toy['lines'], dtype=torch.bfloat16))
    assert len(bf16) == len(fp32) and sum(a == b for a, b in zip(fp32, bf16)) >= 0.8 * len(fp32)


def test_packed_weights_decode_as_the_plain_model_and_are_dropped_on_exit():
    torch.manual_seed(0)
    m = M.Transformer(M.Config(vocab_size=24, n_enc_layers=2, n_dec_layers=2, d_model=32, d_ff=64, n_heads=4,
                               dropout=0.0, pre_norm=True, max_len=64)).eval()
    memory, src_mask = m.encode(torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]]))
    tgt = torch.randint(3, 24, (2, 6))
    linears = [mod for mod in m.modules() if isinstance(mod, M.Linear)]
    with torch.no_grad():
        plain = m.decode(tgt, memory, src_mask)
        with T.packed_weights(m):
            if m.packed_embed is None:
                pytest.skip('this PyTorch build cannot prepack weights for oneDNN')
            torch.testing.assert_close(m.decode(tgt, memory, src_mask), plain, atol=1e-5, rtol=0)
            m.packed_embed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(m.embed.weight))
            assert m.decode(tgt, memory, src_mask).abs().max() == 0  # the packed copy is what it multiplies by
    assert m.packed_embed is None and all(mod.packed is None for mod in linears)
    with T.packed_weights(m):  # autograd (training) never takes the packed path
        assert torch.equal(m.decode(tgt, memory, src_mask), plain)
    with torch.autocast('cpu', dtype=torch.bfloat16), T.packed_weights(m):  # nor autocast: no copies made
        assert m.packed_embed is None


def test_packed_weights_are_reused_until_a_weight_changes():
    # translate_lines keeps the copies across its batches; a caller may train the model between two lines.
    torch.manual_seed(0)
    m = M.Transformer(M.Config(vocab_size=24, n_enc_layers=1, n_dec_layers=1, d_model=32, d_ff=64, n_heads=4,
                               dropout=0.0, max_len=64)).eval()
    memory, src_mask = m.encode(torch.tensor([[5, 6, 7, 8, 2]]))
    tgt, reuse = torch.randint(3, 24, (1, 4)), {}
    with torch.no_grad():
        with T.packed_weights(m, reuse):
            if m.packed_embed is None:
                pytest.skip('this PyTorch build cannot prepack weights for oneDNN')
            embed, w1 = m.packed_embed, m.decoder[0].ffn.w1.packed
        with T.packed_weights(m, reuse):
            assert m.packed_embed is embed and m.decoder[0].ffn.w1.packed is w1  # not packed again
        m.decoder[0].ffn.w1.weight.mul_(2)  # in place, as an optimizer step
        plain = m.decode(tgt, memory, src_mask)
        with T.packed_weights(m, reuse):
            assert m.packed_embed is embed and m.decoder[0].ffn.w1.packed is not w1
            torch.testing.assert_close(m.decode(tgt, memory, src_mask), plain, atol=1e-5, rtol=0)


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc malloc')
def test_keep_freed_memory_reuses_large_blocks_without_page_faults():
    # A 132 MB tensor freed, then one of 128 MB: glibc's default maps the second afresh (a page fault per
    # 4 kB page); kept in the heap, the second reuses the pages of the first.
    code = """if 1:
        import resource, sys, torch, translate as T
        if sys.argv[1] == 'keep': assert T.keep_freed_memory()
        x = torch.ones(33 << 20)
        del x
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(32 << 20)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)"""
    faults = {mode: int(subprocess.run([sys.executable, '-c', code, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ('default', 'keep')}
    assert faults['default'] > 20_000 and faults['keep'] < 1_000, faults


def test_fast_dtype_needs_native_bf16(monkeypatch):
    for isa in ('avx512_bf16', 'amx_tile'):
        monkeypatch.setattr(torch.cpu, f'_is_{isa}_supported', lambda: False, raising=False)
    assert T.fast_dtype('cpu') == 'float32'
    monkeypatch.setattr(torch.cpu, '_is_amx_tile_supported', lambda: True, raising=False)
    assert T.fast_dtype('cpu') == 'bfloat16'
