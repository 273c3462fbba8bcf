import gzip
import os
import random

import numpy as np
import pytest

import data_prep
import model as M
import scale

WORDS = ('a man woman dog runs sits on the in park street with red blue ball child two young old'
         .split())


def fake_multi30k(folder, n=300):
    rnd = random.Random(0)
    os.makedirs(folder)
    for split in ('train', 'val'):
        sents = [' '.join(rnd.choice(WORDS) for _ in range(rnd.randint(8, 16))) for _ in range(n)]
        upper = [s.upper() for s in sents]  # a 'translation' by line
        for lang, text in (('en', sents), ('de', upper)):
            with gzip.open(os.path.join(folder, f'{split}.{lang}.gz'), 'wt', encoding='utf-8') as f:
                f.write('\n'.join(text) + '\n')


def read(folder, name):
    return list(data_prep.read_lines(os.path.join(folder, name)))


def corpus(tmp_path, out, pairs, *args):
    """scale.py corpus from the fake Multi30k in tmp_path / 'm30k' (made if need be) into
    tmp_path / out."""
    if not (tmp_path / 'm30k').exists():
        fake_multi30k(tmp_path / 'm30k')
    scale.main(
        [
            'corpus',
            '--pairs',
            str(pairs),
            '--multi30k',
            str(tmp_path / 'm30k'),
            '--out',
            str(tmp_path / out),
            *args,
        ]
    )


def test_corpus_is_parallel_wmt_sized_and_reproducible(tmp_path):
    corpus(tmp_path, 'a', 4000, '--held-out', '60', '--pool', '5000')
    corpus(tmp_path, 'b', 4000, '--held-out', '60', '--pool', '5000')
    a = tmp_path / 'a'
    src, tgt = read(a, 'train.en.gz'), read(a, 'train.de.gz')
    assert len(src) == len(tgt) == 4000
    assert len(read(a, 'valid.en.gz')) == len(read(a, 'test.de.gz')) == 60
    assert not [f for f in os.listdir(a) if f.endswith('.tmp')]
    words = np.array([len(s.split()) for s in src])
    assert 20 <= words.mean() <= 32  # WMT's news and Europarl: about 25 words a sentence
    assert words.max() >= 4 * 8  # the tail joins 4 to 24 sentences
    # the pairs stay parallel: each target is its source upper-cased, but for their shared
    # pseudo-words
    rare = set(' '.join(src).split()) - set(WORDS)
    assert len(rare) > 100
    for s, t in zip(src, tgt):
        assert len(s.split()) == len(t.split())
        assert [w for w in s.split() if w in rare] or s.upper() == t
    assert sum(bool(set(s.split()) & set(t.split()) & rare) for s, t in zip(src, tgt)) > 100
    assert src == read(tmp_path / 'b', 'train.en.gz')  # same seed, same corpus
    held_out = ' '.join(read(a, 'valid.en.gz') + read(a, 'test.en.gz')).split()
    held_out_rare = [w for w in held_out if w not in WORDS]
    seen = sum(w in rare for w in held_out_rare) / len(held_out_rare)
    # one pool: held-out rare words are mostly the training set's, as newstest's are WMT's
    assert seen > 0.5


@pytest.mark.parametrize('out', ['a_file', 'a_file/c'])
def test_an_out_that_cannot_be_made_is_a_one_line_error_naming_it(tmp_path, out):
    (tmp_path / 'a_file').write_text('')
    with pytest.raises(SystemExit) as e:
        corpus(tmp_path, out, 20, '--held-out', '5', '--pool', '50')
    assert str(tmp_path / out) in str(e.value) and '\n' not in str(e.value)


def test_an_out_in_a_new_folder_is_made(tmp_path):
    # as data/fake_wmt in a fresh clone
    corpus(tmp_path, 'new/c', 20, '--held-out', '5', '--pool', '50')
    assert len(read(tmp_path / 'new' / 'c', 'train.en.gz')) == 20


def test_a_multi30k_folder_whose_sides_differ_is_a_one_line_error(tmp_path):
    fake_multi30k(tmp_path / 'm30k')
    with gzip.open(tmp_path / 'm30k' / 'train.de.gz', 'wt') as f:
        f.write('one line\n')
    with pytest.raises(SystemExit) as e:
        corpus(tmp_path, 'c', 100, '--pool', '50')
    assert 'train.de.gz' in str(e.value) and '300' in str(e.value) and '\n' not in str(e.value)


def test_corpus_files_in_out_are_replaced_only_with_force(tmp_path, capsys):
    fake_multi30k(tmp_path / 'm30k')
    with gzip.open(tmp_path / 'train.en.gz', 'wt') as f:  # a real corpus of the same name
        f.write('mine\n')
    args = ('--held-out', '10', '--pool', '500')
    with pytest.raises(SystemExit) as e:
        corpus(tmp_path, '.', 100, *args)
    assert e.value.code == 2 and '--force' in capsys.readouterr().err
    assert read(tmp_path, 'train.en.gz') == ['mine']
    corpus(tmp_path, '.', 100, *args, '--force')
    assert len(read(tmp_path, 'train.en.gz')) == 100


def test_corpus_goes_through_data_prep_and_the_loader(tmp_path, capsys):
    c = tmp_path / 'c'
    corpus(tmp_path, 'c', 2000, '--held-out', '40', '--pool', '2000')
    data_prep.main(
        [
            'custom',
            '--train',
            str(c / 'train'),
            '--valid',
            str(c / 'valid'),
            '--test',
            str(c / 'test'),
            '--src',
            'en',
            '--tgt',
            'de',
            '--vocab-size',
            '400',
            '--out',
            str(tmp_path / 'prep'),
        ]
    )
    loader = ['loader', '--data', str(tmp_path / 'prep')]
    scale.main(loader + ['--max-tokens', '512', '4096', '--batches', '20'])
    out = capsys.readouterr().out
    assert 'max_tokens 512' in out and 'max_tokens 4096' in out
    scale.main(loader + ['--max-tokens', '40', '--batches', '20'])
    # pairs longer than a batch, as train.py leaves them out
    assert 'left out' in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # not a division by the zero batches built
        scale.main(loader + ['--max-tokens', '1'])
    assert 'max_tokens 1' in str(e.value)


@pytest.mark.parametrize(
    'argv, named',
    [
        (['corpus', '--pairs', '10', '--out', 'c', '--src', 'en', '--tgt', 'en'],
         '--src and --tgt'),
        (['corpus', '--pairs', '10', '--out', 'c', '--seed', '-1'], '--seed'),
        (['corpus', '--pairs', '10', '--out', 'c', '--pool', '0'], '--pool'),
        (['loader', '--data', 'prep', '--batches', '0'], '--batches'),
        (['loader', '--data', 'prep', '--max-tokens', '0'], '--max-tokens'),
        (['checkpoints', '--dir', 'nowhere'], '--dir nowhere'),
    ],
)
def test_bad_arguments_are_a_usage_error_naming_the_flag(tmp_path, monkeypatch, capsys, argv,
                                                          named):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'a_file').write_text('')
    with pytest.raises(SystemExit) as e:
        scale.main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ['a_file']


def test_checkpoints_are_written_averaged_timed_and_removed(tmp_path, monkeypatch, capsys):
    # base and big are GBs: tiny models stand in, run through the same code.
    tiny = dict(n_enc_layers=1, n_dec_layers=1, d_model=16, d_ff=32, n_heads=2)
    monkeypatch.setitem(M.PRESETS, 'base', tiny)
    monkeypatch.setitem(M.PRESETS, 'big', tiny)
    scale.main(['checkpoints', '--dir', str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert [line.split(':')[0] for line in out] == ['base', 'big'] and 'averaging 20' in out[1]
    assert os.listdir(tmp_path) == []
