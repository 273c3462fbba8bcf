"""
Tests for export_ct2.py and translate.py's CTranslate2 path. test_translate.py's tiny word-reversal model is
trained pre-norm and post-norm, exported, and CTranslate2's output is held against model.py's own.
"""
import json
import os
import random
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

import translate as T
from test_translate import ENV, HERE, WORDS, reverse, sentence, train_reversal

ctranslate2 = pytest.importorskip('ctranslate2')
import export_ct2 as E  # noqa: E402  (needs ctranslate2)


@pytest.fixture(scope='module')
def toys(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    for pre_norm in (True, False):
        # train_reversal's 250 steps: at 200 the post-norm toy learnt too little on some CPUs for the checks below.
        model, d, enc, cfg = train_reversal(pre_norm=pre_norm)
        folder = tmp_path_factory.mktemp('pre' if pre_norm else 'post')
        torch.save({'model': model.state_dict(), 'model_cfg': asdict(cfg), 'tokenizer': d, 'step': 250},
                   folder / 'ckpt.pt')
        E.main(['--ckpt', str(folder / 'ckpt.pt'), '--out', str(folder / 'ct2')])
        out[pre_norm] = dict(folder=folder, model=model, enc=enc, d=d, ct2=str(folder / 'ct2'))
    # Lengths out of order, so batches are length-sorted and put back.
    lines = [sentence(random.Random(i)) for i in range(32)]
    yield out, lines
    torch.set_num_threads(threads)


@pytest.mark.parametrize('pre_norm', [True, False], ids=['pre_norm', 'post_norm'])
def test_float32_export_decodes_as_model_py(toys, pre_norm):
    toy, lines = toys[0][pre_norm], toys[1]
    model, enc = toy['model'], toy['enc']
    ct2, ct2_enc = T.load_ct2(toy['ct2'])
    assert isinstance(ct2, T.CT2Model) and ct2.cfg == model.cfg

    def both(**kw):
        return [list(T.translate_lines(m, enc, lines, max_tokens=60, **kw)) for m in (model, ct2)]

    ours, theirs = both(greedy=True)
    assert sum(h == reverse(s) for h, s in zip(ours, lines)) >= 0.8 * len(lines)  # learnt: outputs differ
    assert theirs == ours
    # Caps of a * |src| + b that cut most outputs short, a different cap per sentence within a batch.
    ours, theirs = both(greedy=True, max_len_a=0.5, max_len_b=1)
    assert theirs == ours and sum(len(h.split()) < len(s.split()) for h, s in zip(ours, lines)) > len(lines) / 2
    # Beam search stops by another rule (see CT2Model), so only mostly the same; scores are model.py's.
    ours, theirs = both(nbest=2)
    assert sum(a[0][1] == b[0][1] for a, b in zip(ours, theirs)) >= 0.9 * len(lines)
    for a, b in zip(ours, theirs):
        if a[0][1] == b[0][1]:
            assert b[0][0] == pytest.approx(a[0][0], abs=5e-3)
    # Under caps that cut them, the hypotheses both return score the same: EOS's log-probability counted.
    ours, theirs = both(nbest=2, max_len_a=0.5, max_len_b=1)
    same = 0
    for a, b in zip(ours, theirs):
        score = {text: s for s, text in b}
        for s, text in a:
            if text in score:
                assert score[text] == pytest.approx(s, abs=5e-3), text
                same += 1
    assert same >= len(lines)
    ours, theirs = both(nbest=2, max_len_a=0, max_len_b=1)  # room for EOS alone: its log-probability is the score
    assert [[t for _, t in a] for a in theirs] == [[t for _, t in a] for a in ours] == [['']] * len(lines)
    assert [s for a in theirs for s, _ in a] == pytest.approx([s for a in ours for s, _ in a], abs=5e-3)
    assert all(s < 0 for a in ours for s, _ in a)


def test_int8_export_translates_nearly_as_float32(toys, tmp_path):
    toy, lines = toys[0][True], toys[1]
    E.main(['--ckpt', str(toy['folder'] / 'ckpt.pt'), '--out', str(tmp_path / 'int8'), '--quantization', 'int8'])
    info = json.loads((tmp_path / 'int8' / T.CT2_MARKER).read_text())
    assert info['quantization'] == 'int8' and info['model_cfg'] == asdict(toy['model'].cfg)
    ct2, enc = T.load_ct2(str(tmp_path / 'int8'))
    assert ct2.compute_type.startswith('int8')
    assert (tmp_path / 'int8' / 'model.bin').stat().st_size < 0.5 * (toy['folder'] / 'ct2' / 'model.bin').stat().st_size
    fp32 = list(T.translate_lines(toy['model'], enc, lines))
    int8 = list(T.translate_lines(ct2, enc, lines))
    assert sum(a == b for a, b in zip(fp32, int8)) >= 0.75 * len(lines)


def test_an_existing_out_is_refused_without_force_and_replaced_whole_with_it(toys, tmp_path):
    toy = toys[0][False]
    ckpt, out = str(toy['folder'] / 'ckpt.pt'), tmp_path / 'ct2'
    E.main(['--ckpt', ckpt, '--out', str(out)])
    (out / 'source_vocabulary.json').write_text('[]')  # an older export's file, which the new one does not write
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', ckpt, '--out', str(out), '--quantization', 'int8'])
    assert str(out) in str(e.value) and '--force' in str(e.value)
    assert json.loads((out / T.CT2_MARKER).read_text())['quantization'] == 'none'
    E.main(['--ckpt', ckpt, '--out', str(out), '--quantization', 'int8', '--force'])
    assert json.loads((out / T.CT2_MARKER).read_text())['quantization'] == 'int8'
    assert not (out / 'source_vocabulary.json').exists() and sorted(os.listdir(tmp_path)) == ['ct2']  # nothing left over
    # --force replaces an export, never another folder (here: a training folder).
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', ckpt, '--out', str(toy['folder']), '--force'])
    assert 'not an export' in str(e.value) and (toy['folder'] / 'ckpt.pt').exists()


def test_ctrl_c_is_one_line_and_leaves_the_old_export_as_it_was(toys, tmp_path, monkeypatch):
    toy = toys[0][True]
    E.main(['--ckpt', str(toy['folder'] / 'ckpt.pt'), '--out', str(tmp_path / 'ct2')])
    before = {f: (tmp_path / 'ct2' / f).read_bytes() for f in os.listdir(tmp_path / 'ct2')}

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(E.ctranslate2.specs.TransformerSpec, 'save', interrupted)  # mid-write
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', str(toy['folder'] / 'ckpt.pt'), '--out', str(tmp_path / 'ct2'), '--force'])
    assert str(e.value) == 'export_ct2.py: interrupted'
    assert os.listdir(tmp_path) == ['ct2'] and before == {f: (tmp_path / 'ct2' / f).read_bytes() for f in before}


def test_force_is_advised_only_where_it_would_replace_the_out(toys, tmp_path):
    ckpt = str(toys[0][False]['folder'] / 'ckpt.pt')
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'log.jsonl').write_text('{}')
    with pytest.raises(SystemExit) as e:  # a training folder: --force would refuse it too
        E.main(['--ckpt', ckpt, '--out', str(tmp_path / 'run')])
    assert 'not an export' in str(e.value) and '--force' not in str(e.value)
    E.main(['--ckpt', ckpt, '--out', str(tmp_path / 'ct2')])
    (tmp_path / 'ct2' / 'notes.txt').write_text('mine')
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', ckpt, '--out', str(tmp_path / 'ct2')])
    assert 'notes.txt' in str(e.value) and '--force' not in str(e.value)


def test_export_of_averaged_checkpoints_equals_export_of_the_average(toys, tmp_path):
    toy = toys[0][False]
    base = torch.load(toy['folder'] / 'ckpt.pt', weights_only=True)
    for step, shift in ((10, 0.01), (20, -0.01)):
        torch.save({**base, 'model': {k: v + shift for k, v in base['model'].items()}, 'step': step},
                   tmp_path / f'ckpt_{step}.pt')
    E.main(['--ckpt', str(tmp_path), '--average-last', '2', '--out', str(tmp_path / 'avg')])
    info = json.loads((tmp_path / 'avg' / T.CT2_MARKER).read_text())
    assert [os.path.basename(p) for p in info['checkpoints']] == ['ckpt_10.pt', 'ckpt_20.pt'] and info['step'] == 20
    lines = toys[1][:8]
    ct2, enc = T.load_ct2(str(tmp_path / 'avg'))
    assert list(T.translate_lines(ct2, enc, lines, greedy=True)) == list(
        T.translate_lines(toy['model'], enc, lines, greedy=True))  # the shifts cancel (up to rounding)


def test_export_carries_the_length_penalty_the_checkpoint_was_validated_with(toys, tmp_path):
    toy = toys[0][True]
    torch.save({**torch.load(toy['folder'] / 'ckpt.pt', weights_only=True), 'config': {'bleu_lenpen': 1.5}},
               tmp_path / 'ckpt.pt')
    E.main(['--ckpt', str(tmp_path / 'ckpt.pt'), '--out', str(tmp_path / 'ct2')])
    assert T.load_ct2(str(tmp_path / 'ct2'))[0].lenpen == 1.5 and T.load_ct2(toy['ct2'])[0].lenpen == 0.6


def test_translate_cli_serves_an_export_with_the_same_line_rules_and_scores(toys, tmp_path):
    toy, lines = toys[0][True], toys[1]
    long_line = ' '.join(WORDS * 7)  # longer than max_len 80 holds: truncated, with a warning
    src = tmp_path / 'src'
    src.write_text('\n'.join(lines[:6] + ['', long_line] + lines[6:]) + '\n')
    ref = tmp_path / 'ref'
    T.main(['--ckpt', str(toy['folder'] / 'ckpt.pt'), '--greedy', '--input', str(src), '--output', str(ref)])
    r = subprocess.run([sys.executable, os.path.join(HERE, 'translate.py'), '--ckpt', toy['ct2'], '--greedy',
                        '--input', str(src), '--output', str(tmp_path / 'hyp'), '--ref', str(ref)],
                       capture_output=True, env=ENV, cwd=HERE, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert (tmp_path / 'hyp').read_text() == ref.read_text()  # line for line, the empty one too
    assert 'line 8:' in err and 'truncated' in err and 'CTranslate2 float32' in err
    assert 'sacreBLEU: BLEU = 100.00' in err and 'chrF2 = 100.00' in err


def test_bad_exports_and_options_are_one_line_errors(toys, tmp_path):
    toy = toys[0][False]
    broken = tmp_path / 'broken'
    E.main(['--ckpt', str(toy['folder'] / 'ckpt.pt'), '--out', str(broken)])
    (broken / 'model.bin').write_bytes(b'not a model')
    with pytest.raises(SystemExit) as e:
        T.load_ct2(str(broken))
    assert str(broken) in str(e.value) and '\n' not in str(e.value)
    r = subprocess.run([sys.executable, os.path.join(HERE, 'translate.py'), '--ckpt', toy['ct2'], '--dtype',
                        'bfloat16'], capture_output=True, env=ENV, cwd=HERE, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and b'--ct2-compute-type' in r.stderr and b'Traceback' not in r.stderr
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', str(tmp_path / 'missing.pt'), '--out', str(tmp_path / 'x')])
    assert 'missing.pt' in str(e.value) and not (tmp_path / 'x').exists()


def test_an_export_given_as_the_checkpoint_to_export_is_named_as_an_export(toys):
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', toys[0][True]['ct2'], '--out', toys[0][True]['ct2'] + '2'])
    assert 'is a CTranslate2 export' in str(e.value) and '--average-last' not in str(e.value)


def test_force_replaces_only_an_export_and_two_exports_never_both_win(toys, tmp_path, monkeypatch):
    ckpt = str(toys[0][False]['folder'] / 'ckpt.pt')
    out = tmp_path / 'ct2'
    E.main(['--ckpt', ckpt, '--out', str(out)])
    (out / 'notes.txt').write_text('mine')  # the user's file in the export's folder
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', ckpt, '--out', str(out), '--force'])
    assert 'notes.txt' in str(e.value) and (out / 'notes.txt').read_text() == 'mine'
    (tmp_path / 'link').symlink_to(out)
    (out / 'notes.txt').unlink()
    E.main(['--ckpt', ckpt, '--out', str(tmp_path / 'link'), '--force', '--quantization', 'int8'])
    assert (tmp_path / 'link').is_symlink() and T.load_ct2(str(out))[0].compute_type.startswith('int8')
    assert sorted(os.listdir(tmp_path)) == ['ct2', 'link']
    # Another export to the same place finishes while this one is being built: this one must not replace it.
    build = E.build_spec

    def meanwhile(model):
        monkeypatch.setattr(E, 'build_spec', build)
        E.main(['--ckpt', ckpt, '--out', str(tmp_path / 'new'), '--quantization', 'int8'])
        return build(model)
    monkeypatch.setattr(E, 'build_spec', meanwhile)
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', ckpt, '--out', str(tmp_path / 'new')])
    assert 'already exists' in str(e.value) and T.load_ct2(str(tmp_path / 'new'))[0].compute_type.startswith('int8')
    assert sorted(os.listdir(tmp_path)) == ['ct2', 'link', 'new']
    # With --force, an export that lands after this one moved the old aside wins, and nothing is left over.
    rename = os.rename

    def landing(a, b):
        rename(a, b)
        if b.endswith(f'.old-{os.getpid()}'):
            monkeypatch.setattr(os, 'rename', rename)
            subprocess.run([sys.executable, 'export_ct2.py', '--ckpt', ckpt, '--out', str(out), '--force'], cwd=HERE,
                           env=ENV, check=True, capture_output=True)
    monkeypatch.setattr(os, 'rename', landing)
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', ckpt, '--out', str(out), '--force', '--quantization', 'int8'])
    assert 'another export wrote it meanwhile' in str(e.value) and 'use --force' not in str(e.value)
    assert T.load_ct2(str(out))[0].compute_type == 'float32' and sorted(os.listdir(tmp_path)) == ['ct2', 'link', 'new']
