"""
Tests for export_ct2.py and translate.py's CTranslate2 path: an export scores every token as
model.py does (pre-norm and post-norm), and trained word-reversal models (conftest.py's toy,
post-norm; a pre-norm one with learned positions and d_head) decode under CTranslate2 as under
model.py.
"""
import dataclasses
import json
import os
import random

import pytest
import torch
import torch.nn.functional as F

import model as M
import translate as T
from test_translate import WORDS, reverse, sentence, train_reversal

ctranslate2 = pytest.importorskip('ctranslate2')
import export_ct2 as E  # noqa: E402  (needs ctranslate2)


@pytest.fixture(scope='module')
def toy(toy, tmp_path_factory):
    """conftest.py's toy (test_translate.py's reversal model, post-norm as the paper), with its
    float32 export, its tokenizer dict and 32 source lines."""
    ct2 = str(tmp_path_factory.mktemp('toy') / 'ct2')
    E.main(['--ckpt', toy['ckpt'], '--out', ct2])
    d = torch.load(toy['ckpt'], weights_only=True)['tokenizer']
    # Lengths out of order, so batches are length-sorted and put back.
    lines = [sentence(random.Random(i)) for i in range(32)]
    return dict(ckpt=toy['ckpt'], ct2=ct2, model=toy['model'], enc=toy['enc'], d=d, lines=lines)


# Table 3: (E) learned positions, (A) h 8 x d_k 8 = d_model 64, (B) d_k 4 at h 4 (CTranslate2:
# head_dim).
@pytest.mark.parametrize('kw', [dict(pre_norm=True), dict(pre_norm=False),
                                dict(positions='learned', pre_norm=True),
                                dict(n_heads=8, d_head=8, pre_norm=True),
                                dict(d_head=4, pre_norm=False)],
                         ids=['pre_norm', 'post_norm', 'E_learned', 'A_h8_dk8', 'B_dk4_post_norm'])
def test_export_scores_each_token_as_model_py(toy, tmp_path, kw):
    # An untrained model: the log-probabilities of given targets check every weight, without a
    # search.
    torch.manual_seed(1)
    model = M.Transformer(dataclasses.replace(toy['model'].cfg, **kw)).eval()
    E.export(model, toy['d'], str(tmp_path / 'ct2'))
    ct2, enc = E.load_ct2(str(tmp_path / 'ct2'))
    cfg, rng = model.cfg, random.Random(0)
    pairs = []
    for _ in range(8):
        pairs.append((enc.encode_ordinary(sentence(rng)), enc.encode_ordinary(sentence(rng))))
    # The export appends EOS to the source and scores the target's EOS itself.
    theirs = ct2.translator.score_batch([[ct2.tokens[t] for t in s] for s, _ in pairs],
                                        [[ct2.tokens[t] for t in t_] for _, t_ in pairs])
    for (s, t), r in zip(pairs, theirs):
        with torch.no_grad():
            logits = model(torch.tensor([s + [cfg.eos_id]]), torch.tensor([[cfg.bos_id] + t]))
        ours = logits.log_softmax(-1)[0].gather(1, torch.tensor([t + [cfg.eos_id]]).T)[:, 0]
        assert r.log_probs == pytest.approx(ours.tolist(), abs=1e-4)


@pytest.mark.parametrize('edit', ['gelu', 'gain', 'renamed'])
def test_an_edited_model_py_that_ctranslate2_cannot_hold_is_refused(toy, tmp_path, monkeypatch,
                                                                     edit):
    # A reader changes the FFN's activation, adds a parameter to it, or renames a layer: the
    # export would serve another model, with nothing said.
    init = M.FeedForward.__init__

    def with_gain(self, cfg):
        init(self, cfg)
        self.gain = torch.nn.Parameter(torch.ones(cfg.d_model))
        if edit == 'renamed':
            self.fc1 = self.w1
            del self.w1
    forwards = {'gelu': lambda self, x: self.w2(F.gelu(self.w1(x))),
                'gain': lambda self, x: self.gain * self.w2(F.relu(self.w1(x))),
                'renamed': lambda self, x: self.w2(F.relu(self.fc1(x)))}
    monkeypatch.setattr(M.FeedForward, '__init__', with_gain)
    monkeypatch.setattr(M.FeedForward, 'forward', forwards[edit])
    model = M.Transformer(toy['model'].cfg).eval()
    with pytest.raises(SystemExit, match='serve the checkpoint itself') as e:
        E.export(model, toy['d'], str(tmp_path / 'ct2'))
    assert edit != 'renamed' or "modules are not those export_ct2.py maps" in str(e.value)
    assert not os.listdir(tmp_path)


def test_the_architecture_check_needs_no_longer_position_table_than_the_model(toy):
    E.check_architecture(dataclasses.replace(toy['model'].cfg, max_len=4, positions='learned'))


def test_float32_export_decodes_as_model_py(toy):
    model, enc, lines = toy['model'], toy['enc'], toy['lines']
    ct2, _ = E.load_ct2(toy['ct2'])
    assert isinstance(ct2, E.CT2Model) and ct2.cfg == model.cfg

    def both(**kw):
        # exact=False: model.py stops a sentence once beam hypotheses finished, as CTranslate2 does.
        return [list(T.translate_lines(m, enc, lines, max_tokens=60, exact=False, **kw))
                for m in (model, ct2)]

    ours, theirs = both(greedy=True)
    # Learnt: outputs differ.
    assert sum(h == reverse(s) for h, s in zip(ours, lines)) >= 0.8 * len(lines)
    assert theirs == ours
    # Caps of a * |src| + b that cut most outputs short, a different cap per sentence within a
    # batch.
    ours, theirs = both(greedy=True, max_len_a=0.5, max_len_b=1)
    assert theirs == ours
    assert sum(len(h.split()) < len(s.split()) for h, s in zip(ours, lines)) > len(lines) / 2
    # CTranslate2 ranks finished hypotheses by log P / |Y|^alpha during its search: the best are
    # mostly the same, their scores model.py's.
    ours, theirs = both(nbest=2)
    assert sum(a[0][1] == b[0][1] for a, b in zip(ours, theirs)) >= 0.9 * len(lines)
    for a, b in zip(ours, theirs):
        if a[0][1] == b[0][1]:
            assert b[0][0] == pytest.approx(a[0][0], abs=5e-3)
    # Under caps that cut them, the hypotheses both return score the same: EOS's log-probability
    # counted.
    ours, theirs = both(nbest=2, max_len_a=0.5, max_len_b=1)
    same = 0
    for a, b in zip(ours, theirs):
        score = {text: s for s, text in b}
        for s, text in a:
            if text in score:
                assert score[text] == pytest.approx(s, abs=5e-3), text
                same += 1
    assert same >= len(lines)
    # Room for EOS alone: its log-probability is the score.
    ours, theirs = both(nbest=2, max_len_a=0, max_len_b=1)
    their_texts = [[t for _, t in a] for a in theirs]
    assert their_texts == [[t for _, t in a] for a in ours] == [['']] * len(lines)
    their_scores = [s for a in theirs for s, _ in a]
    assert their_scores == pytest.approx([s for a in ours for s, _ in a], abs=5e-3)
    assert all(s < 0 for a in ours for s, _ in a)


def test_an_export_of_learned_positions_and_d_head_decodes_as_model_py(toy, tmp_path):
    # The reversal model trained with rows (E) and (B) at once: learned positions, and
    # h 2 x d_k 16 < d_model 64.
    model, d, enc, cfg = train_reversal(pre_norm=True, positions='learned', n_heads=2, d_head=16)
    saved = dict(model=model.state_dict(), model_cfg=dataclasses.asdict(cfg), tokenizer=d, step=250)
    torch.save(saved, tmp_path / 'ckpt.pt')
    E.main(['--ckpt', str(tmp_path / 'ckpt.pt'), '--out', str(tmp_path / 'ct2')])
    ct2, _ = E.load_ct2(str(tmp_path / 'ct2'))
    assert ct2.cfg == model.cfg and model.cfg.positions == 'learned'
    ours = list(T.translate_lines(model, enc, toy['lines'], greedy=True))
    theirs = list(T.translate_lines(ct2, enc, toy['lines'], greedy=True))
    assert sum(h == reverse(s) for h, s in zip(ours, toy['lines'])) >= 0.8 * len(ours)  # learnt
    assert theirs == ours


def test_an_export_never_generates_ids_past_the_tokenizers(toy, tmp_path):
    # vocab_size rounded up: the 5 ids past the tokenizer's have no text. Here the decoder's last
    # LayerNorm gives every position one state, whose logits favour those ids above all others.
    n = toy['enc'].n_vocab
    torch.manual_seed(1)
    cfg = dataclasses.replace(toy['model'].cfg, vocab_size=n + 5, pre_norm=False)
    model = M.Transformer(cfg).eval()
    with torch.no_grad():
        model.decoder[-1].norm3.weight.zero_()
        model.decoder[-1].norm3.bias.fill_(1.0)
        model.embed.weight[n:] = 1.0
    E.export(model, toy['d'], str(tmp_path / 'ct2'))
    ct2, enc = E.load_ct2(str(tmp_path / 'ct2'))
    src = torch.tensor([enc.encode_ordinary(toy['lines'][0]) + [model.cfg.eos_id]])
    for beam in (1, 4):
        assert all(t < n for hyp, _ in ct2.decode(src, beam, 0.6, 1, 50, beam)[0] for t in hyp)


def test_int8_export_is_smaller_and_translates_nearly_as_float32(toy, tmp_path):
    E.main(['--ckpt', toy['ckpt'], '--out', str(tmp_path / 'int8'), '--quantization', 'int8'])
    info = json.loads((tmp_path / 'int8' / E.CT2_MARKER).read_text())
    assert info['quantization'] == 'int8'
    assert info['model_cfg'] == dataclasses.asdict(toy['model'].cfg)
    ct2, enc = E.load_ct2(str(tmp_path / 'int8'))
    assert ct2.compute_type.startswith('int8')
    int8_size = os.path.getsize(tmp_path / 'int8' / 'model.bin')
    assert int8_size < 0.5 * os.path.getsize(os.path.join(toy['ct2'], 'model.bin'))
    fp32 = list(T.translate_lines(toy['model'], enc, toy['lines']))
    int8 = list(T.translate_lines(ct2, enc, toy['lines']))
    assert sum(a == b for a, b in zip(fp32, int8)) >= 0.75 * len(fp32)


def test_an_existing_export_is_replaced_whole_and_only_with_force(toy, tmp_path):
    out = tmp_path / 'ct2'
    E.main(['--ckpt', toy['ckpt'], '--out', str(out)])
    # An older export's file, which a new one does not write.
    (out / 'source_vocabulary.json').write_text('[]')
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', toy['ckpt'], '--out', str(out), '--quantization', 'int8'])
    assert str(out) in str(e.value) and '--force' in str(e.value)
    assert json.loads((out / E.CT2_MARKER).read_text())['quantization'] == 'none'
    E.main(['--ckpt', toy['ckpt'], '--out', str(out), '--quantization', 'int8', '--force'])
    assert json.loads((out / E.CT2_MARKER).read_text())['quantization'] == 'int8'
    assert not (out / 'source_vocabulary.json').exists()
    assert os.listdir(tmp_path) == ['ct2']  # nothing left over


def test_force_never_replaces_a_folder_that_is_not_a_bare_export(toy, tmp_path):
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'log.jsonl').write_text('{}')
    E.main(['--ckpt', toy['ckpt'], '--out', str(tmp_path / 'ct2')])
    (tmp_path / 'ct2' / 'notes.txt').write_text('mine')  # the user's file in the export's folder
    for out, kept in (('run', 'log.jsonl'), ('ct2', 'notes.txt')):
        for force in ([], ['--force']):
            with pytest.raises(SystemExit) as e:
                E.main(['--ckpt', toy['ckpt'], '--out', str(tmp_path / out), *force])
            assert str(tmp_path / out) in str(e.value)
            assert '--force' not in str(e.value)  # it would not help
            assert (tmp_path / out / kept).exists()


def test_an_interrupted_export_leaves_the_old_export_as_it_was(toy, tmp_path, monkeypatch):
    E.main(['--ckpt', toy['ckpt'], '--out', str(tmp_path / 'ct2')])
    before = {f: (tmp_path / 'ct2' / f).read_bytes() for f in os.listdir(tmp_path / 'ct2')}

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(E.ctranslate2.specs.TransformerSpec, 'save', interrupted)  # mid-write
    with pytest.raises(KeyboardInterrupt):
        E.main(['--ckpt', toy['ckpt'], '--out', str(tmp_path / 'ct2'), '--force'])
    assert os.listdir(tmp_path) == ['ct2']
    assert before == {f: (tmp_path / 'ct2' / f).read_bytes() for f in before}


def test_export_of_averaged_checkpoints_equals_export_of_the_average(toy, tmp_path):
    base = torch.load(toy['ckpt'], weights_only=True)
    for step, shift in ((10, 0.01), (20, -0.01)):
        shifted = {k: v + shift for k, v in base['model'].items()}
        torch.save({**base, 'model': shifted, 'step': step}, tmp_path / f'ckpt_{step}.pt')
    E.main(['--ckpt', str(tmp_path), '--average-last', '2', '--out', str(tmp_path / 'avg')])
    info = json.loads((tmp_path / 'avg' / E.CT2_MARKER).read_text())
    assert [os.path.basename(p) for p in info['checkpoints']] == ['ckpt_10.pt', 'ckpt_20.pt']
    assert info['step'] == 20
    ct2, enc = E.load_ct2(str(tmp_path / 'avg'))
    lines = toy['lines'][:8]
    theirs = list(T.translate_lines(ct2, enc, lines, greedy=True))
    ours = list(T.translate_lines(toy['model'], enc, lines, greedy=True))
    assert theirs == ours  # the shifts cancel (up to rounding)


def test_export_carries_the_length_penalty_the_checkpoint_was_validated_with(toy, tmp_path):
    ckpt = torch.load(toy['ckpt'], weights_only=True)
    torch.save({**ckpt, 'config': {'bleu_lenpen': 1.5}}, tmp_path / 'ckpt.pt')
    E.main(['--ckpt', str(tmp_path / 'ckpt.pt'), '--out', str(tmp_path / 'ct2')])
    assert E.load_ct2(str(tmp_path / 'ct2'))[0].lenpen == 1.5
    assert E.load_ct2(toy['ct2'])[0].lenpen == 0.6


def test_translate_cli_serves_an_export_with_the_same_line_rules_and_scores(toy, tmp_path, capsys):
    long_line = ' '.join(WORDS * 7)  # longer than max_len 80 holds: truncated, with a warning
    src, ref, hyp = tmp_path / 'src', tmp_path / 'ref', tmp_path / 'hyp'
    src.write_text('\n'.join(toy['lines'][:6] + ['', long_line] + toy['lines'][6:]) + '\n')
    T.main(['--ckpt', toy['ckpt'], '--greedy', '--input', str(src), '--output', str(ref)])
    capsys.readouterr()
    T.main(['--ckpt', toy['ct2'], '--greedy', '--input', str(src), '--output', str(hyp),
            '--ref', str(ref)])
    err = capsys.readouterr().err
    assert hyp.read_text() == ref.read_text()  # line for line, the empty one too
    assert 'line 8' in err and 'truncated' in err and 'CTranslate2 float32' in err
    assert 'BLEU = 100.00' in err and 'chrF2 = 100.00' in err


def test_bad_exports_and_options_are_one_line_errors(toy, tmp_path, capsys):
    broken = tmp_path / 'broken'
    E.main(['--ckpt', toy['ckpt'], '--out', str(broken)])
    (broken / 'model.bin').write_bytes(b'not a model')
    with pytest.raises(SystemExit) as e:
        E.load_ct2(str(broken))
    assert str(broken) in str(e.value) and '\n' not in str(e.value)
    with pytest.raises(SystemExit) as e:  # a checkpoint's option, for an export
        T.main(['--ckpt', toy['ct2'], '--dtype', 'bfloat16'])
    assert e.value.code == 2 and '--dtype' in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # an export has its own stopping rule: not ignored
        T.main(['--ckpt', toy['ct2'], '--exact'])
    assert e.value.code == 2 and '--exact' in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        E.main(['--ckpt', str(tmp_path / 'missing.pt'), '--out', str(tmp_path / 'x')])
    assert 'missing.pt' in str(e.value) and not (tmp_path / 'x').exists()
