"""
Tests for translate.py. conftest.py's `toy` trains a tiny model.Transformer (train_reversal,
below) to reverse the word order of sentences over a 12-word vocabulary (through a small BPE
tokenizer) and saves it as train.py saves checkpoints; translate.py runs on it in-process, and as a
script where stdin or a terminal matters.
"""
import functools
import json
import os
import pty
import random
import select
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import sacrebleu
import torch
import torch.nn.functional as F

import checkpoint
import data_prep
import dataset
import decode
import model as M
import speed
import translate as T
from test_model import tiny

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the root: the scripts
WORDS = 'alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron'.split()
# Two shared cores: one thread per process is faster than oversubscribed ones, in the fixture and
# the scripts.
ENV = {**os.environ, 'OMP_NUM_THREADS': '1'}


def sentence(rng):
    # Distinct words: reversal is quick to learn.
    return ' '.join(rng.sample(WORDS, rng.randint(1, 9)))


def reverse(s):
    return ' '.join(s.split()[::-1])


def train_reversal(steps=250, **overrides):
    """A tiny model trained to reverse word order -> (model in eval mode, tokenizer dict, Encoding,
    Config). Also used by test_export.py."""
    rng = random.Random(0)
    d = data_prep.train_tokenizer(iter([sentence(rng) for _ in range(3000)]), 400, 'toy')
    enc, sp = dataset.load_tokenizer(d), d['special_tokens']
    settings = dict(vocab_size=enc.n_vocab, tokenizer_size=enc.n_vocab, n_enc_layers=2,
                    n_dec_layers=2, d_model=64, d_ff=128, n_heads=4, dropout=0.0, max_len=80,
                    pad_id=sp['<pad>'], bos_id=sp['<s>'], eos_id=sp['</s>'])
    cfg = M.Config(**{**settings, **overrides})
    torch.manual_seed(0)
    model = M.Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def pad(seqs):
        return torch.tensor([s + [cfg.pad_id] * (max(map(len, seqs)) - len(s)) for s in seqs])

    for _ in range(steps):
        batch = [sentence(rng) for _ in range(64)]
        src = pad([enc.encode_ordinary(s) + [cfg.eos_id] for s in batch])
        tgt = [enc.encode_ordinary(reverse(s)) for s in batch]
        tgt_out = pad([t + [cfg.eos_id] for t in tgt]).flatten()
        rows = (tgt_out != cfg.pad_id).nonzero().squeeze(1)
        x = model(src, pad([[cfg.bos_id] + t for t in tgt]), rows)
        loss, _ = M.label_smoothed_loss(x, model.embed.weight, tgt_out[rows], 0.0)
        opt.zero_grad()
        (loss / len(rows)).backward()
        opt.step()
    return model.eval(), d, enc, cfg


def own_decode(toy, line, greedy=False, nbest=1, exact=False):
    """The model's own hypotheses for one sentence alone (no batching, no padding)
    -> [(text, score)]."""
    src = torch.tensor([toy['enc'].encode_ordinary(line) + [toy['cfg'].eos_id]])
    if greedy:
        hyps = decode.greedy_decode(toy['model'], src, 1, 50)[0]
    else:
        hyps = decode.beam_search(toy['model'], src, 4, 0.6, 1, 50, nbest, exact)[0]
    return [(toy['enc'].decode(t), s) for t, s in hyps]


def translate(toy, folder, *flags, ckpt=None, src=None):
    """translate.py's main in-process, --output folder/hyp -> the lines written."""
    T.main(['--ckpt', ckpt or toy['ckpt'], '--input', src or toy['src'],
            '--output', str(folder / 'hyp'), *flags])
    return (folder / 'hyp').read_text(encoding='utf-8').splitlines()


def write_lines(path, lines):
    path.write_text(''.join(line + '\n' for line in lines))
    return str(path)


def script(args, **kw):
    command = [sys.executable, os.path.join(HERE, 'translate.py'), *args]
    return subprocess.Popen(command, env=ENV, cwd=HERE, stdout=subprocess.PIPE, **kw)


def test_file_translation_is_each_sentences_own_beam_search_in_input_order(toy, tmp_path, capsys):
    lens = [len(toy['enc'].encode_ordinary(line)) for line in toy['lines']]
    assert lens != sorted(lens) and lens != sorted(lens, reverse=True)
    hyps = translate(toy, tmp_path, '--max-tokens', '40')  # several batches, each sorted by length
    expected = [own_decode(toy, line)[0][0] for line in toy['lines']]
    assert hyps == expected and (tmp_path / 'hyp').read_bytes().endswith(b'\n')
    # The comparison means something only if outputs differ by input: the model has learnt the task.
    assert sum(h == reverse(line) for h, line in zip(expected, toy['lines'])) >= 0.8 * len(expected)
    err = capsys.readouterr().err
    # The default rule is not the exact one.
    assert 'sentences/s' in err and 'beam 4, lenpen 0.6)' in err


def test_nbest_lists_are_the_models_own_under_the_early_and_the_exact_stopping_rule(
        toy, tmp_path, capsys):
    # 4-best lists: the toy's best hypotheses are the same under both stopping rules, its 4-best
    # lists not.
    own = {exact: [h for line in toy['lines'] for h in own_decode(toy, line, nbest=4, exact=exact)]
           for exact in (False, True)}
    assert [h for h, _ in own[False]] != [h for h, _ in own[True]]
    # --early-stop: the default, accepted.
    for flag, exact in (('--exact', True), ('--early-stop', False)):
        rows = [row.split('\t') for row in translate(toy, tmp_path, '--nbest', '4', flag)]
        assert [h for _, h in rows] == [h for h, _ in own[exact]], flag
        scores = [float(s) for s, _ in rows]
        assert scores == pytest.approx([s for _, s in own[exact]], abs=2e-4)
        # Best first, within each input's 4 lines.
        assert all(scores[i] >= scores[i + 1] for i in range(len(scores) - 1) if i % 4 != 3)
        # The summary line says which rule ran.
        assert (', exact)' in capsys.readouterr().err) == exact


def test_greedy_from_stdin_to_stdout_is_the_models_greedy_decode(toy):
    with open(toy['src'], 'rb') as f:
        p = script(['--ckpt', toy['ckpt'], '--greedy', '--max-tokens', '30'], stdin=f,
                   stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()
    expected = [own_decode(toy, line, greedy=True)[0][0] for line in toy['lines']]
    assert out.decode().split('\n') == expected + ['']


def test_translate_lines_streams_in_input_order_and_leaves_caller_state_alone(toy, monkeypatch):
    model, real = toy['model'], decode.greedy_decode
    seen = []  # the state each batch decodes in

    def greedy_decode(*a):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled('cpu'), model.training))
        return real(*a)
    monkeypatch.setattr(decode, 'greedy_decode', greedy_decode)
    lines = [' '.join(WORDS[:9])] + toy['lines']  # the longest first: decoded first
    gen = T.translate_lines(model.train(), toy['enc'], lines, greedy=True, max_tokens=30)
    hyps = [next(gen)]
    # Streamed after the first batch; no_grad inside.
    assert len(seen) == 1 and torch.is_grad_enabled()
    hyps += list(gen)
    # Eval mode inside, train mode restored.
    assert len(seen) > 3 and model.training and not any(map(any, seen))
    # dtype float32: autocast off inside, on outside.
    with torch.autocast('cpu', dtype=torch.bfloat16):
        next(T.translate_lines(model, toy['enc'], ['alpha'], greedy=True, dtype=torch.float32))
        assert torch.is_autocast_enabled('cpu') and not seen[-1][1]
    next(T.translate_lines(model.eval(), toy['enc'], ['alpha'], greedy=True, dtype=torch.bfloat16))
    assert seen[-1][1] and not torch.is_autocast_enabled('cpu') and not model.training
    assert hyps == [own_decode(toy, line, greedy=True)[0][0] for line in lines]


def test_lenpen_defaults_to_the_one_the_checkpoint_was_validated_with(toy, tmp_path):
    # train.py keeps bleu_lenpen in the checkpoint's config; translate.py decodes with it unless
    # --lenpen says otherwise, and with the paper's 0.6 where the config has none. nbest scores show
    # the alpha used.
    tuned, src = tmp_path / 'tuned.pt', write_lines(tmp_path / 'src', toy['lines'][:6])
    base = torch.load(toy['ckpt'], weights_only=True)
    torch.save({**base, 'config': {'bleu_lenpen': 1.5}}, tuned)

    def scores(ckpt, *flags):
        return translate(toy, tmp_path, '--nbest', '2', *flags, ckpt=str(ckpt), src=src)
    assert scores(tuned) == scores(toy['ckpt'], '--lenpen', '1.5') != scores(toy['ckpt'])
    assert scores(toy['ckpt']) == scores(tuned, '--lenpen', '0.6')


def test_compiled_decoding_gives_the_eager_output(toy, tmp_path, monkeypatch):
    # Dynamo's capture of decode and output (the KV cache's mutations, extend's compile-only path),
    # with the eager backend: inductor's C++ build of their graphs took 30-60 s on two shared cores.
    import torch._inductor.config as inductor
    # --compile sets it for the whole process.
    monkeypatch.setattr(inductor, 'freezing', inductor.freezing)
    monkeypatch.setattr(torch, 'compile', functools.partial(torch.compile, backend='eager'))
    # One line: each batch size is another graph.
    src = write_lines(tmp_path / 'src', toy['lines'][1:2])
    assert translate(toy, tmp_path, '--compile', src=src) == translate(toy, tmp_path, src=src)


def test_bad_input_or_output_gives_exactly_one_output_line_per_input_line(
        toy, tmp_path, capsys, monkeypatch):
    raw = [b'alpha beta gamma\r\n', b'\n', b'   \n',
           ' '.join(WORDS * 7).encode() + b'\n',  # 84 tokens > 80
           b'beta \xff\xfe delta\n', b'alpha\rbeta\n', 'eta\u2028theta'.encode() + b'\n',
           b'</s> <pad> kappa\r\n', b'\r\n', b'alpha beta gamma']  # the last line has no newline
    (tmp_path / 'bad.src').write_bytes(b''.join(raw))
    translate(toy, tmp_path, src=str(tmp_path / 'bad.src'))
    hyps = (tmp_path / 'hyp').read_bytes().decode('utf-8').split('\n')
    assert len(hyps) == len(raw) + 1 and hyps[-1] == ''
    assert hyps[1] == hyps[2] == hyps[8] == '' and all(hyps[i] for i in (3, 4, 5, 6, 7))
    assert hyps[0] == hyps[9] == own_decode(toy, 'alpha beta gamma')[0][0]
    err = capsys.readouterr().err
    assert 'line 4:' in err and 'truncated' in err and 'line 5:' in err and 'UTF-8' in err
    # A model may well generate a line break; written out as is, it would shift every later line.
    fake = [(toy['enc'].encode_ordinary('a\nb\r\nc\u2028d\x0be'), -1.0)]
    monkeypatch.setattr(decode, 'beam_search', lambda model, src, *a: [fake] * len(src))
    assert list(T.translate_lines(toy['model'], toy['enc'], ['alpha', ''])) == ['a b  c d e', '']


def test_outputs_stop_at_the_positional_table_with_a_warning_whatever_the_cap(toy, capsys):
    # A decoder that never ends: its last layer's output is the constant 1, and EOS has the lowest
    # logit.
    model, cfg, enc = M.Transformer(toy['cfg']).eval(), toy['cfg'], toy['enc']
    model.load_state_dict(toy['model'].state_dict())
    with torch.no_grad():
        model.decoder[-1].norm3.weight.zero_()
        model.decoder[-1].norm3.bias.fill_(1.0)
        model.embed.weight[cfg.eos_id] = -1.0
        model.embed.weight[enc.encode_ordinary('alpha')[0]] = 1.0
    # Caps 3 + 50 and 49 + 50 > the table's 79; the source fits.
    lines = ['alpha beta', ' '.join(WORDS * 4)]
    # A cap far past the table is the table.
    for a, b, short in ((1, 50, 52), (1e30, 50, 78), (1, 10 ** 20, 78)):
        stats = {}
        out = list(T.translate_lines(model, enc, lines, greedy=True, max_len_a=a, max_len_b=b,
                                     first_line=7, stats=stats))
        err = capsys.readouterr().err
        assert len(out) == 2 and stats['tgt_tokens'] == short + cfg.max_len - 2, (a, b)
        assert 'line 8:' in err and f'max_len {cfg.max_len}' in err, (a, b)
        assert 'truncated' not in err, (a, b)
        assert ('line 7:' in err) == (short == cfg.max_len - 2), (a, b)


def test_ref_with_the_reference_as_hypothesis_gives_bleu_100(toy, tmp_path, capsys):
    ref = write_lines(tmp_path / 'ref', translate(toy, tmp_path))
    translate(toy, tmp_path, '--ref', ref, '--paper-bleu')
    err = capsys.readouterr().err
    assert 'sacreBLEU: BLEU = 100.00' in err and 'chrF2 = 100.00' in err
    assert 'paper BLEU' in err and err.count('BLEU = 100.00') == 2


def test_validation_bleu_is_translate_pys_bleu_of_the_same_model_and_sentences(toy):
    # train.py's (decode.corpus_bleu, on prepared ids; a sentence too long for the model gives '')
    # and translate.py's (on text lines; too long: truncated); the references half reversed.
    enc, model = toy['enc'], toy['model']
    lines = toy['lines'] + ['w1 ' * model.cfg.max_len]
    ids = [enc.encode_ordinary(line.strip()) for line in lines]
    tok = np.array([t for x in ids for t in x])
    idx = np.cumsum([0] + [len(x) for x in ids])
    refs = [reverse(line) for line in lines[:12]] + lines[12:]
    hyps = list(T.translate_lines(model, enc, lines[:-1])) + ['']
    score = decode.corpus_bleu(model, (tok, idx), refs, enc, beam=4, alpha=0.6)
    assert score == T.bleu(hyps, refs).score
    assert 20 < score < 80


def test_bleu_and_paper_bleu_are_sacrebleus_the_latter_with_compounds_split():
    hyps, refs = ['the cat sat on the mat'], ['the cat sat on a mat']
    assert T.bleu(hyps, refs).score == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    # Precisions 5/6, 3/5, 2/4, 1/3; equal lengths, so no brevity penalty.
    assert T.bleu(hyps, refs).score == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)
    hyps, refs = ['Das Software-Update ist da.'], ['Das Software-Paket ist "da".']
    want = sacrebleu.metrics.BLEU(tokenize='none').corpus_score(
        ['Das Software ##AT##-##AT## Update ist da .'],
        [['Das Software ##AT##-##AT## Paket ist " da " .']])
    assert T.paper_bleu(hyps, refs).score == pytest.approx(want.score)
    assert want.score > T.bleu(hyps, refs).score


def test_output_file_appears_only_when_complete(toy, tmp_path, monkeypatch):
    out = tmp_path / 'hyp'
    out.write_text('the previous translation\n')
    out.chmod(0o600)

    def stopped(model, enc, lines, **kw):  # one line out, then the run dies
        yield 'first'
        raise KeyboardInterrupt
    monkeypatch.setattr(T, 'translate_lines', stopped)
    with pytest.raises(KeyboardInterrupt):
        translate(toy, tmp_path)
    # The old file stands, and the stopped run's part is gone (not left to look like a result).
    assert out.read_text() == 'the previous translation\n' and os.listdir(tmp_path) == ['hyp']
    monkeypatch.undo()
    assert len(translate(toy, tmp_path, '--greedy')) == len(toy['lines'])
    assert os.listdir(tmp_path) == ['hyp']
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600  # the replaced file's permissions


def test_a_device_or_fifo_output_is_written_in_place_and_a_missing_folder_is_one_line(
        toy, tmp_path):
    fifo, got = tmp_path / 'fifo', []
    # As /dev/null or /dev/stdout: renaming a finished file over it would replace it.
    os.mkfifo(fifo)

    def read():
        with open(fifo, encoding='utf-8') as f:
            got.append(f.read())
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    T.main(['--ckpt', toy['ckpt'], '--input', toy['src'], '--output', str(fifo), '--greedy'])
    reader.join(timeout=60)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert got and len(got[0].splitlines()) == len(toy['lines'])
    with pytest.raises(SystemExit) as e:
        T.main(['--ckpt', toy['ckpt'], '--input', toy['src'],
                '--output', str(tmp_path / 'no' / 'hyp')])
    assert str(tmp_path / 'no' / 'hyp') in str(e.value.code) and '\n' not in str(e.value.code)


def test_an_output_that_is_an_input_or_a_folder_is_refused(toy, tmp_path, capsys):
    src = write_lines(tmp_path / 'src', ['alpha beta'])
    ckpt = tmp_path / 'ckpt.pt'
    folder = tmp_path / 'sub'
    ckpt.write_bytes(open(toy['ckpt'], 'rb').read())
    folder.mkdir()
    # A trailing slash names a folder; the file would be written without it, over an input.
    for flags in (['--output', src], ['--output', str(ckpt)], ['--output', src + '/'],
                  ['--ref', toy['src'], '--output', toy['src']], ['--output', str(folder)],
                  ['--output', str(ckpt) + '/'], ['--output', str(tmp_path / 'new') + '/'],
                  ['--average-last', '1', '--save-average', str(ckpt)],
                  ['--average-last', '1', '--save-average', str(folder)],
                  ['--average-last', '1', '--save-average', str(ckpt) + '/']):
        with pytest.raises(SystemExit) as e:
            T.main(['--ckpt', str(ckpt), '--input', src, *flags])
        assert e.value.code == 2 and f'{flags[-2]} {flags[-1]}' in capsys.readouterr().err, flags
    avg = str(tmp_path / 'avg.pt')
    with pytest.raises(SystemExit) as e:
        T.main(['--ckpt', str(tmp_path), '--input', src, '--average-last', '1',
                '--save-average', avg, '--output', avg])
    assert e.value.code == 2 and 'name one file' in capsys.readouterr().err
    assert open(src).read() == 'alpha beta\n' and checkpoint.read_checkpoint(str(ckpt))
    assert not os.listdir(folder) and sorted(os.listdir(tmp_path)) == ['ckpt.pt', 'src', 'sub']
    snapshot = tmp_path / 'ckpt_0000001.pt'
    snapshot.write_bytes(ckpt.read_bytes())
    missing = str(tmp_path / 'no' / 'avg.pt')
    with pytest.raises(SystemExit) as e:
        T.main(['--ckpt', str(snapshot), '--input', src, '--average-last', '1',
                '--save-average', missing])
    assert missing in str(e.value.code) and '\n' not in str(e.value.code)


def test_save_average_never_overwrites_a_file(toy, tmp_path, capsys):
    # A run's own ckpt.pt (train.py's average) or ckpt_best.pt, say.
    run = tmp_path / 'run'
    run.mkdir()
    for name in ('ckpt_0000001.pt', 'ckpt.pt'):
        (run / name).write_bytes(open(toy['ckpt'], 'rb').read())
    (run / 'ckpt.pt').write_bytes((run / 'ckpt.pt').read_bytes() + b'x')
    before = (run / 'ckpt.pt').read_bytes()
    src = write_lines(tmp_path / 'src', ['alpha beta'])
    with pytest.raises(SystemExit) as e:
        T.main(['--ckpt', str(run), '--input', str(src), '--average-last', '1',
                '--save-average', str(run / 'ckpt.pt')])
    assert e.value.code == 2
    assert f"--save-average {run / 'ckpt.pt'} exists" in capsys.readouterr().err
    assert (run / 'ckpt.pt').read_bytes() == before


def reading(fifo, proc):
    """Waits until proc opens fifo and one of its threads waits in a read of it -> the write end,
    left open. A signal that came before that read would not interrupt it."""
    deadline = time.time() + 60
    writer = None
    while writer is None:
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader yet
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
    while not in_pipe_read(proc.pid):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    return writer


def in_pipe_read(pid):
    for task in os.listdir(f'/proc/{pid}/task'):
        try:
            with open(f'/proc/{pid}/task/{task}/wchan') as f:
                if 'pipe' in f.read():  # the kernel's pipe_read, anon_pipe_read, pipe_wait
                    return True
        except FileNotFoundError:  # a thread that ended
            continue
    return False


def test_a_signal_ignored_from_the_start_stays_ignored():
    # nohup starts a command with SIGHUP ignored: closing the terminal must not stop it.
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGTERM)}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        checkpoint.stop_on_signals()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.default_int_handler
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_sigterm_stops_translation_as_ctrl_c_does_in_one_line(toy, tmp_path):
    # kill or timeout while translate.py waits for its input on a pipe
    proc = script(['--ckpt', toy['ckpt'], '--output', str(tmp_path / 'hyp')],
                  stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not in_pipe_read(proc.pid):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and err.decode().strip() == 'translate.py: interrupted'
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_older_than_tokenizer_size_takes_it_from_its_tokenizer(toy, tmp_path):
    # Its model_cfg lacks the field: loading sets it from the embedded tokenizer, and it averages
    # with the newer snapshots of its run (one resumed across versions).
    base = torch.load(toy['ckpt'], weights_only=True)
    old_cfg = {k: v for k, v in base['model_cfg'].items() if k != 'tokenizer_size'}
    torch.save({**base, 'model_cfg': old_cfg}, tmp_path / 'old.pt')
    model = checkpoint.load_checkpoint(str(tmp_path / 'old.pt'))[0]
    assert model.cfg.tokenizer_size == toy['enc'].n_vocab
    averaged = checkpoint.average_checkpoints([toy['ckpt'], str(tmp_path / 'old.pt')])
    assert averaged.keys() == base['model'].keys()


def test_averaging_is_the_mean_of_the_newest_by_step_of_one_run_saved_loadable_anywhere(
        toy, tmp_path):
    base = torch.load(toy['ckpt'], weights_only=True)
    # The checkpoints name their tokenizer by a relative path.
    (tmp_path / 'tokenizer.json').write_text(json.dumps(base['tokenizer']))
    states = {}
    for step in (90, 100, 1000):  # by name, ckpt_90.pt would sort last
        g = torch.Generator().manual_seed(step)
        states[step] = {k: v + torch.randn(v.shape, generator=g) for k, v in base['model'].items()}
        code = {'model.py': f'digest {step}'}  # loading it warns: this model.py is not that
        torch.save({**base, 'model': states[step], 'step': step, 'tokenizer': 'tokenizer.json',
                    'code': code}, tmp_path / f'ckpt_{step}.pt')
    torch.save({**base, 'model': states[90]}, tmp_path / 'ckpt_best.pt')  # not a ckpt_STEP.pt
    avg = tmp_path / 'elsewhere' / 'avg.pt'
    avg.parent.mkdir()
    assert translate(toy, avg.parent, '--average-last', '2', '--save-average', str(avg), '--greedy',
                     ckpt=str(tmp_path), src=write_lines(tmp_path / 'src', ['alpha beta'])) != []
    # Its tokenizer embedded: the relative path does not resolve there.
    saved = checkpoint.load_checkpoint(str(avg))[2]
    assert saved['averaged'] == ['ckpt_100.pt', 'ckpt_1000.pt'] and saved['step'] == 1000
    assert saved['code'] == {'model.py': 'digest 1000'}  # the newest's, as its step
    for k, v in saved['model'].items():
        torch.testing.assert_close(v, (states[100][k] + states[1000][k]) / 2)
    tok = {**base['tokenizer'], 'pattern': base['tokenizer']['pattern'] + '|x'}
    # Checkpoints of another run: refused.
    for name, other in (('tokenizer', {**base, 'tokenizer': tok}),
                        ('eos_id', {**base, 'model_cfg': {**base['model_cfg'], 'eos_id': 5}})):
        torch.save(other, tmp_path / f'{name}.pt')
        with pytest.raises(SystemExit) as e:
            checkpoint.average_checkpoints([toy['ckpt'], str(tmp_path / f'{name}.pt')])
        assert f'{name}.pt' in str(e.value) and name in str(e.value).replace(f'{name}.pt', '')


def test_bad_checkpoints_are_one_line_errors_naming_the_file(toy, tmp_path):
    base = torch.load(toy['ckpt'], weights_only=True)
    cfg = base['model_cfg']
    (tmp_path / 'notes.pt').write_text('some text, not a checkpoint\n')
    (tmp_path / 'folder').mkdir()
    cases = {'missing.pt': None, 'notes.pt': None, 'folder': None,
             'no_tokenizer.pt': {k: v for k, v in base.items() if k != 'tokenizer'},
             'small_vocab.pt': {**base, 'model_cfg': {**cfg, 'vocab_size': 100}},
             'other_eos.pt': {**base, 'model_cfg': {**cfg, 'eos_id': 5}},
             'layers.pt': {**base, 'model_cfg': {**cfg, 'n_dec_layers': 3}},
             'weights.pt': {**base, 'model': {'w': torch.zeros(3)}},
             'heads.pt': {**base, 'model_cfg': {**cfg, 'n_heads': 3}},
             'lenpen.pt': {**base, 'config': {'bleu_lenpen': '1.2'}}}
    for name, ckpt in cases.items():
        if ckpt is not None:
            torch.save(ckpt, tmp_path / name)
        with pytest.raises(SystemExit) as e:
            translate(toy, tmp_path, '--greedy', ckpt=str(tmp_path / name))
        msg = str(e.value.code)  # what Python prints of a SystemExit: no traceback
        assert str(tmp_path / name) in msg and '\n' not in msg, name
    assert not (tmp_path / 'hyp').exists()


def test_a_checkpoint_trained_under_another_model_py_is_translated_with_a_warning(toy, tmp_path,
                                                                                   capsys):
    # A reader who edits model.py and translates an older checkpoint gets other outputs: said.
    base = torch.load(toy['ckpt'], weights_only=True)
    now = checkpoint.code_digests()['model.py']
    for digest, warned in ((now, False), ('another', True)):
        torch.save({**base, 'code': {'model.py': digest}}, tmp_path / 'ckpt.pt')
        capsys.readouterr()
        assert translate(toy, tmp_path, '--greedy', ckpt=str(tmp_path / 'ckpt.pt'))
        err = capsys.readouterr().err
        assert ('warning: model.py has changed since' in err) == warned


def test_a_serving_copy_without_train_py_loads_checkpoints(toy, tmp_path, monkeypatch, capsys):
    # A fork serves with translate.py and the modules it imports: the digests of the files left out
    # are not compared.
    base = torch.load(toy['ckpt'], weights_only=True)
    torch.save({**base, 'code': checkpoint.code_digests()}, tmp_path / 'ckpt.pt')
    monkeypatch.setattr(checkpoint, 'CODE_FILES', ('model.py', 'left_out.py'))
    assert set(checkpoint.code_digests()) == {'model.py'}
    capsys.readouterr()
    checkpoint.load_checkpoint(str(tmp_path / 'ckpt.pt'))
    assert 'warning' not in capsys.readouterr().err


def test_interactive_terminal_translates_each_line_as_typed(toy):
    master, slave = pty.openpty()
    p = script(['--ckpt', toy['ckpt']], stdin=slave, stderr=subprocess.DEVNULL)
    os.close(slave)
    try:
        for line in toy['lines'][:2]:
            os.write(master, line.encode() + b'\n')
            # The answer must come while stdin is still open: line by line, not at end of input.
            assert select.select([p.stdout], [], [], 60)[0], "no output within 60 s"
            assert p.stdout.readline().decode().rstrip('\n') == own_decode(toy, line)[0][0]
        os.write(master, b'\x04')  # Ctrl-D
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        os.close(master)


@pytest.mark.skipif(speed.fast_dtype('cpu') != 'bfloat16', reason='this CPU emulates bf16 (slow)')
def test_bfloat16_autocast_decoding_on_cpu_mostly_agrees_with_float32(toy):
    fp32 = list(T.translate_lines(toy['model'], toy['enc'], toy['lines']))
    bf16 = list(T.translate_lines(toy['model'], toy['enc'], toy['lines'], dtype=torch.bfloat16))
    assert len(bf16) == len(fp32) and sum(a == b for a, b in zip(fp32, bf16)) >= 0.8 * len(fp32)


needs_packing = pytest.mark.skipif(not hasattr(torch.ops.mkldnn, '_reorder_linear_weight'),
                                   reason='this PyTorch build cannot prepack weights for oneDNN')


def patched(model):
    """What packed_weights sets: instance attributes over the classes' forward and output."""
    found = [m for m in model.modules() if 'forward' in vars(m)]
    if 'output' in vars(model):
        found.append(model)
    return found


@needs_packing
def test_packed_weights_decode_as_the_plain_model_and_are_removed_on_exit(toy, monkeypatch):
    model, real, seen = toy['model'], decode.beam_search, []

    def beam_search(m, *a):
        seen.append(len(patched(m)))
        return real(m, *a)
    monkeypatch.setattr(decode, 'beam_search', beam_search)
    packed = list(T.translate_lines(model, toy['enc'], toy['lines']))
    # Every batch took the packed path; then it is gone.
    assert seen and all(seen) and not patched(model)
    n = len(seen)
    assert packed == list(T.translate_lines(model, toy['enc'], toy['lines'], pack=False))
    assert not any(seen[n:])
    with torch.no_grad(), pytest.raises(KeyError), speed.packed_weights(model):
        assert patched(model)
        raise KeyError  # gone after an error too
    assert not patched(model)
    with speed.packed_weights(model):  # autograd (training) never takes the packed path
        assert not patched(model)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16), speed.packed_weights(model):
        assert not patched(model)  # nor autocast


@needs_packing
def test_packed_weights_follow_an_edited_feed_forward_and_output(monkeypatch):
    # A reader who changes the FFN's activation or the output projection decodes what they wrote.
    m = tiny(n_enc_layers=1, n_dec_layers=1)
    calls = []

    def gelu_ffn(self, x):
        calls.append(x.shape)
        return self.w2(F.gelu(self.w1(x)))
    monkeypatch.setattr(M.FeedForward, 'forward', gelu_ffn)
    monkeypatch.setattr(M.Transformer, 'output', lambda self, x: F.linear(x, self.embed.weight) / 2)
    src, tgt = torch.tensor([[5, 6, 7, 8, 2]]), torch.tensor([[1, 9, 10, 11]])
    reuse = {}
    with torch.no_grad():
        plain = m(src, tgt)
        with speed.packed_weights(m, reuse):
            packed = m(src, tgt)
            assert patched(m)  # the Linear layers are still packed
        checks = len(calls) - 4  # plain's and packed's 2 FFNs each: the rest checked the FFNs
        with speed.packed_weights(m, reuse):
            assert len(calls) == 4 + checks  # checked once, as the copies are kept
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=0)
    assert checks == 2


@needs_packing
def test_packed_weights_are_reused_until_a_weight_changes(monkeypatch):
    # translate_lines keeps the copies across its batches; a caller may train the model between two
    # lines.
    m = tiny(n_enc_layers=1, n_dec_layers=1)
    real, packs, reuse = torch.ops.mkldnn._reorder_linear_weight, [], {}

    def reorder(w):
        packs.append(id(w))
        return real(w)
    monkeypatch.setattr(torch.ops.mkldnn, '_reorder_linear_weight', reorder)
    memory, src_mask = m.encode(torch.tensor([[5, 6, 7, 8, 2]]))
    tgt, w1 = torch.randint(3, 24, (1, 4)), m.decoder[0].ffn.w1.weight
    with torch.no_grad():
        for _ in range(2):
            with speed.packed_weights(m, reuse):
                pass
        n = len(packs)  # each packed once: the Linear layers' weights and the output matrix
        assert n == len(set(packs)) == sum(isinstance(x, torch.nn.Linear) for x in m.modules()) + 1
        w1.mul_(2)  # in place, as an optimizer step
        plain = m.output(m.decode(tgt, memory, src_mask))
        with speed.packed_weights(m, reuse):
            assert packs[n:] == [id(w1)]  # that weight alone packed again, and used
            packed = m.output(m.decode(tgt, memory, src_mask))
            torch.testing.assert_close(packed, plain, atol=1e-5, rtol=0)


def test_keep_freed_memory_sets_the_glibc_options_it_names(monkeypatch):
    # Its promise is the options it sets (numbered as in glibc's malloc.h), not what the heap does
    # next: that depends on the machine's memory state, transparent huge pages and GLIBC_TUNABLES.
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
    calls = []

    class Libc:
        accepts = 1  # what mallopt returns: 1 set, 0 refused

        def mallopt(self, option, value):
            calls.append((option, value))
            return self.accepts
    libc = Libc()
    monkeypatch.setattr(speed.ctypes, 'CDLL', lambda name: libc if name == 'libc.so.6' else None)
    # Kept: no block mapped apart, the heap trimmed above 1 GB.
    assert speed.keep_freed_memory() is True
    assert calls == [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2 ** 30)]
    calls.clear()
    # Blocks of 8 MB or more mapped apart: given back.
    assert speed.keep_freed_memory(keep=False) is True
    assert calls == [(M_MMAP_THRESHOLD, 8 << 20)]
    libc.accepts = 0
    assert speed.keep_freed_memory() is False

    def no_glibc(name):  # musl, macOS
        raise OSError(name)
    monkeypatch.setattr(speed.ctypes, 'CDLL', no_glibc)
    assert speed.keep_freed_memory() is False


def test_fast_dtype_is_bfloat16_only_where_it_is_native(monkeypatch):
    for isa in ('avx512_bf16', 'amx_tile'):
        monkeypatch.setattr(torch.cpu, f'_is_{isa}_supported', lambda: False, raising=False)
    assert speed.fast_dtype('cpu') == 'float32'
    monkeypatch.setattr(torch.cpu, '_is_amx_tile_supported', lambda: True, raising=False)
    assert speed.fast_dtype('cpu') == 'bfloat16'
    for native in (False, True):  # a GPU: bf16 from Ampere on, not on a V100 or a T4
        monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda *a, **k: native)
        assert speed.fast_dtype('cuda') == ('bfloat16' if native else 'float32')


def test_a_folder_for_a_checkpoint_names_average_last_only_where_the_script_has_it(toy, tmp_path):
    import export_ct2
    folder = os.path.dirname(toy['ckpt'])
    for main, args in ((T.main, ['--input', toy['src']]),
                       (export_ct2.main, ['--out', str(tmp_path / 'ct2')])):
        with pytest.raises(SystemExit) as e:
            main(['--ckpt', folder, *args])
        assert f'--ckpt {folder} is a folder' in str(e.value) and '--average-last N' in str(e.value)
    with pytest.raises(SystemExit) as e:  # as train.py's init_from reads it
        checkpoint.read_checkpoint(folder)
    assert f'{folder} is a folder' in str(e.value) and 'average-last' not in str(e.value)
