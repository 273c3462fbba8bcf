"""
Tests for plot.py. Its attention weights are a distribution over keys, causal and blind to padding
where the model must be, and reproduce what the model's SDPA computes; the plot commands write real
PNGs and fail on bad input with one line naming the file.
"""
import json
import os
import warnings
from dataclasses import asdict

import pytest
import torch

import data_prep
import dataset
import decode
import model as M
import plot

PAD, BOS, EOS = 0, 1, 2


def tiny():
    torch.manual_seed(0)
    cfg = M.Config(vocab_size=24, n_enc_layers=2, n_dec_layers=2, d_model=32, d_ff=64, n_heads=4,
                   dropout=0.0, max_len=64)
    return M.Transformer(cfg).eval()


def batch():
    # The second pair is padded in source and target, so padding has something to be ignored by.
    src = torch.tensor([[5, 6, 7, 8, 9, EOS], [10, 11, EOS, PAD, PAD, PAD]])
    tgt_in = torch.tensor([[BOS, 12, 13, 14, 15], [BOS, 16, PAD, PAD, PAD]])
    return src, tgt_in


@pytest.fixture(scope='module')
def weights():
    return plot.attention_weights(tiny(), *batch())


def test_attention_rows_sum_to_one(weights):
    for w in weights['encoder'] + weights['decoder'] + weights['cross']:
        assert (w >= 0).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-6, rtol=0)


def test_decoder_self_attention_is_causal(weights):
    for layer in weights['decoder']:
        T = layer.size(-1)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        assert (layer[..., future] == 0).all()
        assert (layer[..., ~future] > 0).all()  # and every earlier position is seen


def test_padding_gets_zero_weight(weights):
    for layer in weights['encoder'] + weights['cross']:
        assert (layer[1, :, :, 3:] == 0).all()  # keys 3.. of sentence 2 are padding
        assert (layer[1, :, :, :3] > 0).all()
        assert (layer[0] > 0).all()  # sentence 1 has no padding: nothing masked


def test_weights_reproduce_each_attention_output():
    # out_proj(weights @ V), heads concatenated, is what the module computes with SDPA.
    m, src = tiny(), batch()[0]
    s, t, mask = torch.randn(2, 6, 32), torch.randn(2, 5, 32), (src != PAD)[:, None, None, :]
    for attn, x, kw in ((m.encoder[0].self_attn, s, dict(mask=mask)),
                        (m.decoder[0].self_attn, t, dict(causal=True)),
                        (m.decoder[1].cross_attn, t, dict(memory=s, mask=mask))):
        with torch.no_grad():
            want = attn(x, **kw)
            kv = attn.kv_proj(s).chunk(2, -1) if attn.cross else attn.qkv_proj(x).chunk(3, -1)
            y = plot.weights_of(attn, x, **kw) @ attn.heads(kv[-1])
            got = attn.out_proj(y.transpose(1, 2).reshape(x.shape))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_query_with_every_key_masked_gets_zero_weights():
    attn, x = tiny().encoder[0].self_attn, torch.randn(1, 3, 32)
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    with torch.no_grad():
        w = plot.weights_of(attn, x, mask=mask)
    assert (w[:, :, 1] == 0).all() and (w[:, :, 0].sum(-1) - 1).abs().max() < 1e-6


def test_attention_weights_leave_the_model_as_it_was():
    m = tiny()
    with torch.no_grad():
        before = m(*batch())
    plot.attention_weights(m, *batch())
    assert not any(mod._forward_pre_hooks for mod in m.modules())
    with torch.no_grad():
        torch.testing.assert_close(m(*batch()), before, atol=0, rtol=0)


# -----------------------------------------------------------------------------------------------
# the commands

def write_log(path, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    return str(path)


def train_record(step, minutes, loss=5.0):
    return dict(step=step, epoch=0, loss=loss, ppl=100.0, lr=1e-3 * step / 40, grad_norm=1.0,
                tok_per_s=2000.0, elapsed_min=minutes, eta_min=1.0)


def eval_record(step, loss, **kw):
    return dict(step=step, valid_loss=loss, **kw)


def synthetic_log(path, bleu=True):
    records = []
    for step in range(10, 50, 10):
        records.append(train_record(step, step / 10, loss=8.0 - step / 10))
        if step % 20 == 0:
            records.append(eval_record(step, 7.0 - step / 20, valid_ppl=50.0,
                                       **({'valid_bleu': step / 4} if bleu else {})))
    return write_log(path, records)


def curves(*args):
    plot.main(['curves', *args, '--no-show'])


@pytest.fixture
def figures(monkeypatch):
    """The figures plot.py draws, kept open for the test to read."""
    plt = pytest.importorskip('matplotlib.pyplot')
    figs = []
    monkeypatch.setattr(plt, 'close', figs.append)
    yield figs
    monkeypatch.undo()
    for fig in figs:
        plt.close(fig)


def assert_png(path):
    image = pytest.importorskip('matplotlib.image')
    assert open(path, 'rb').read(8) == b'\x89PNG\r\n\x1a\n'
    pixels = image.imread(path)  # decodes the whole file, so a truncated one fails here
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0  # something was drawn


def test_curves_png_is_valid(tmp_path):
    pytest.importorskip('matplotlib')
    a, b = synthetic_log(tmp_path / 'a'), synthetic_log(tmp_path / 'b', bleu=False)
    for x in ('step', 'minutes'):
        out = tmp_path / 'figs' / f'curves_{x}.png'
        curves(a, b + '/log.jsonl', '-o', str(out), '--x', x)
        assert_png(out)
    written = sorted(p.name for p in (tmp_path / 'figs').iterdir())
    assert written == ['curves_minutes.png', 'curves_step.png']


def test_legend_has_an_entry_per_run_even_of_one_folder_name(tmp_path, figures):
    runs = [synthetic_log(tmp_path / x / 'run') for x in ('a', 'b')]
    curves(*runs, '-o', str(tmp_path / 'c.png'))
    legend = figures[0].axes[5].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ['run', 'run']
    assert len({h.get_color() for h in legend.legend_handles}) == 2


def test_a_run_with_one_training_record_is_drawn(tmp_path, figures):
    # A run shorter than log_interval logs only its last step: one point, which a line without a
    # marker leaves invisible.
    run = write_log(tmp_path / 'r', [train_record(5, 0.2), eval_record(5, 7.0, valid_bleu=0.0)])
    curves(run, '-o', str(tmp_path / 'c.png'))
    for ax in figures[0].axes[:5]:
        (line,) = ax.lines
        assert line.get_marker() not in (None, 'None', '', ' ')


def test_eval_minutes_are_interpolated_and_resumes_continue_the_clock(tmp_path):
    records = [train_record(10, 1.0), train_record(20, 2.0), eval_record(15, 6.0),
               train_record(30, 3.0), train_record(40, 4.0),
               # resumed from step 20 in a new process: its clock starts at 0
               train_record(30, 0.5), eval_record(30, 5.0), train_record(40, 1.5)]
    train, evals = plot.read_log(write_log(tmp_path / 'r', records))
    want = [(10, 1.0), (20, 2.0), (30, 2.5), (40, 3.5)]
    assert [(r['step'], r['minutes']) for r in train] == want
    assert [(e['step'], e['minutes']) for e in evals] == [(15, 1.5), (30, 2.5)]


def test_a_resumed_run_whose_clock_goes_on_keeps_its_minutes(tmp_path):
    # train.py restores the training time from the state it resumes (here saved at step 20, 2.0
    # minutes): the resumed process logs the run's minutes, which are not to be shifted by the time
    # of the steps it redoes.
    records = [train_record(10, 1.0), train_record(20, 2.0), train_record(30, 3.0),
               train_record(40, 4.0), train_record(30, 3.1), train_record(40, 4.1)]
    train, _ = plot.read_log(write_log(tmp_path / 'r', records))
    want = [(10, 1.0), (20, 2.0), (30, 3.1), (40, 4.1)]
    assert [(r['step'], r['minutes']) for r in train] == want


def test_non_finite_values_are_said_and_the_finite_points_around_them_drawn(
        tmp_path, figures, capsys):
    records = [train_record(50, 0.5, loss=1.0), train_record(100, 1.0, loss=float('nan')),
               train_record(150, 1.5, loss=float('inf')), train_record(200, 2.0, loss=0.5)]
    run = write_log(tmp_path / 'r', records)  # json writes NaN and Infinity, as train.py's log does
    curves(run, '-o', str(tmp_path / 'c.png'))
    (line,) = figures[0].axes[0].lines
    assert list(line.get_xdata()) == [50, 200] and list(line.get_ydata()) == [1.0, 0.5]
    assert '2 non-finite' in capsys.readouterr().err


def test_lines_that_are_not_train_py_records_are_skipped_and_counted(tmp_path, capsys):
    run = tmp_path / 'r'
    write_log(run, [train_record(10, 1.0)])
    with open(run / 'log.jsonl', 'a') as f:
        f.write('{"step": 20, "loss": 1.0, "elapsed_min": "2.0"}\n')
        f.write('{"step": 30, "loss": "x"}\n')
        f.write('[1, 2]\n')
    train, _ = plot.read_log(str(run))
    assert [r['step'] for r in train] == [10] and 'skipped 3' in capsys.readouterr().err


def test_an_unreadable_log_is_a_one_line_error_naming_it(tmp_path, monkeypatch):
    run = synthetic_log(tmp_path / 'run')

    def denied(path, *args, **kwargs):
        raise PermissionError(13, 'Permission denied', path)
    monkeypatch.setattr(plot, 'open', denied, raising=False)  # root reads any file
    with pytest.raises(SystemExit) as e:
        curves(run, '-o', str(tmp_path / 'c.png'))
    assert 'log.jsonl: Permission denied' in str(e.value) and '\n' not in str(e.value)


def test_minutes_of_a_log_without_training_records_is_a_one_line_error(tmp_path):
    pytest.importorskip('matplotlib')
    run = write_log(tmp_path / 'r', [eval_record(200, 2.0), eval_record(400, 1.5, valid_bleu=10.0)])
    # Its panels would be drawn empty: no clock to place them on.
    with pytest.raises(SystemExit) as e:
        curves(run, '-o', str(tmp_path / 'c.png'), '--x', 'minutes')
    assert '--x step' in str(e.value) and 'log.jsonl' in str(e.value)


def test_more_runs_than_colours_stay_apart(tmp_path, figures):
    to_hex = pytest.importorskip('matplotlib.colors').to_hex  # 'C10' is 'C0' again
    curves(*[synthetic_log(tmp_path / f'r{i}') for i in range(12)], '-o', str(tmp_path / 'c.png'))
    lines = figures[0].axes[0].lines
    assert len({(to_hex(ln.get_color()), ln.get_linestyle()) for ln in lines}) == 12
    assert len(figures[0].axes[5].get_legend().get_texts()) == 12


@pytest.mark.parametrize('content', [None, '', '\n', '{"not": "a record"}\n'])
def test_bad_log_is_a_one_line_error_naming_it(tmp_path, content):
    run = tmp_path / 'run'
    run.mkdir()
    if content is not None:
        (run / 'log.jsonl').write_text(content)
    with pytest.raises(SystemExit) as e:
        curves(str(run), '-o', str(tmp_path / 'c.png'))
    msg = str(e.value)
    assert str(run / 'log.jsonl') in msg and '\n' not in msg
    assert not (tmp_path / 'c.png').exists()


@pytest.mark.parametrize('out', ['.', 'c.xyz', 'a_file/c.png',
                                 pytest.param('x' * 250 + '.png', id='name_too_long')])
def test_bad_output_is_a_one_line_error_that_leaves_no_file(tmp_path, monkeypatch, out):
    pytest.importorskip('matplotlib')
    run = synthetic_log(tmp_path / 'run')
    (tmp_path / 'a_file').write_text('')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        curves(run, '-o', out)
    assert out in str(e.value) and '\n' not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ['a_file', 'run']  # no figure, nor its temporary file


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
    words = 'a man is riding a red bike ein mann fährt ein rotes fahrrad'.split()
    d = data_prep.train_tokenizer(iter([' '.join(words)] * 20), 300, 'toy')
    sp = d['special_tokens']
    torch.manual_seed(0)
    cfg = M.Config(vocab_size=dataset.load_tokenizer(d).n_vocab, n_enc_layers=2, n_dec_layers=2,
                   d_model=32, d_ff=64, n_heads=4, dropout=0.0, max_len=64, pad_id=sp['<pad>'],
                   bos_id=sp['<s>'], eos_id=sp['</s>'])
    path = tmp_path_factory.mktemp('ckpt') / 'ckpt.pt'
    # bleu_lenpen: the length penalty it validated with, which its own translation is to use
    torch.save({'model': M.Transformer(cfg).state_dict(), 'model_cfg': asdict(cfg), 'tokenizer': d,
                'step': 0, 'config': {'bleu_lenpen': 1.2}}, path)
    return str(path)


def attention(checkpoint, out, *args):
    plot.main(['attention', '--ckpt', checkpoint, '-o', str(out), '--no-show', *args])


@pytest.mark.parametrize('extra', [
    [],  # every kind and head of the last layer
    ['--layers', '0', '1', '--heads', '1', '-1', '--kinds', 'cross', 'decoder']])
def test_attention_png_is_valid(tmp_path, checkpoint, extra):
    pytest.importorskip('matplotlib')
    attention(checkpoint, tmp_path / 'a.png', '--src', 'a man is riding a bike',
              '--tgt', 'ein mann fährt', *extra)
    assert_png(tmp_path / 'a.png')


def test_attention_shows_a_control_character_token_escaped(tmp_path, checkpoint, figures):
    # A byte-level BPE token may be a control character, which no font draws: matplotlib warned
    # "Glyph 7 missing" and drew a box. Shown as repr shows it instead, in the labels and the title.
    with warnings.catch_warnings():
        warnings.filterwarnings('error', message='Glyph')
        attention(checkpoint, tmp_path / 'a.png', '--src', 'a man', '--tgt', 'ein\x07mann',
                  '--kinds', 'cross', '--heads', '0')
    ticks = [t for ax in figures[0].axes for t in ax.get_xticklabels() + ax.get_yticklabels()]
    labels = [t.get_text() for t in ticks]
    assert '\\x07' in labels and all(label.isprintable() for label in labels)
    assert any('ein\\x07mann' in t.get_text() for t in figures[0].texts)  # the suptitle


def test_dollar_signs_in_sentences_and_names_are_drawn_as_text(tmp_path, checkpoint):
    # matplotlib reads $...$ as TeX: '$\\foo$' ended in a ParseFatalException traceback.
    pytest.importorskip('matplotlib')
    attention(checkpoint, tmp_path / 'a.png', '--src', '$\\foo$ bar', '--tgt', 'ein $x$',
              '--kinds', 'cross', '--heads', '0')
    assert_png(tmp_path / 'a.png')
    run = synthetic_log(tmp_path / '$\\bar$')
    curves(run, '-o', str(tmp_path / 'c.png'), '--labels', '$\\foo$')
    assert_png(tmp_path / 'c.png')


def test_attention_of_its_own_translation_decodes_as_translate_py(
        tmp_path, checkpoint, monkeypatch):
    pytest.importorskip('matplotlib')
    seen, search = [], decode.beam_search

    def beam_search(*a, **k):
        seen.append(k)
        return search(*a, **k)
    monkeypatch.setattr(decode, 'beam_search', beam_search)
    # An untrained model's translation runs to the length limit: one small map keeps it quick.
    attention(checkpoint, tmp_path / 'a.png', '--src', 'a man', '--kinds', 'cross', '--heads', '0',
              '--beam', '2')
    assert [k['alpha'] for k in seen] == [1.2] and not any(k.get('exact') for k in seen)
    assert_png(tmp_path / 'a.png')


@pytest.mark.parametrize('flag, value, named', [
    ('--ckpt', 'nowhere/ckpt.pt', 'nowhere/ckpt.pt'), ('--layers', '5', '--layers 5'),
    ('--heads', '-5', '--heads -5'), ('--src', ' ', '--src')])
def test_bad_attention_input_is_a_one_line_error(tmp_path, checkpoint, flag, value, named):
    given = {'--ckpt': checkpoint, '--src': 'a man', flag: value}
    with pytest.raises(SystemExit) as e:
        attention(given.pop('--ckpt'), tmp_path / 'a.png', *[x for kv in given.items() for x in kv])
    assert named in str(e.value) and '\n' not in str(e.value)
    assert not (tmp_path / 'a.png').exists()


def test_attention_of_a_folder_names_no_option_plot_py_lacks(tmp_path):
    with pytest.raises(SystemExit) as e:
        attention(str(tmp_path), tmp_path / 'a.png', '--src', 'a man')
    assert str(tmp_path) in str(e.value) and 'average-last' not in str(e.value)
