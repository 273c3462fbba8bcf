import gzip
import os
import random

import numpy as np
import pytest

import data_prep
import scale

WORDS = 'a man woman dog runs sits on the in park street with red blue ball child two young old'.split()


def fake_multi30k(folder, n=300):
    rnd = random.Random(0)
    os.makedirs(folder)
    for split in ('train', 'val'):
        sents = [' '.join(rnd.choice(WORDS) for _ in range(rnd.randint(8, 16))) for _ in range(n)]
        for lang, text in (('en', sents), ('de', [s.upper() for s in sents])):  # a 'translation' by line
            with gzip.open(os.path.join(folder, f'{split}.{lang}.gz'), 'wt', encoding='utf-8') as f:
                f.write('\n'.join(text) + '\n')


def read(folder, name):
    return list(data_prep.read_lines(os.path.join(folder, name)))


def test_corpus_is_parallel_wmt_sized_and_reproducible(tmp_path):
    fake_multi30k(tmp_path / 'm30k')
    args = ['corpus', '--pairs', '4000', '--held-out', '60', '--pool', '5000', '--multi30k', str(tmp_path / 'm30k')]
    scale.main(args + ['--out', str(tmp_path / 'a')])
    scale.main(args + ['--out', str(tmp_path / 'b')])
    a = tmp_path / 'a'
    src, tgt = read(a, 'train.en.gz'), read(a, 'train.de.gz')
    assert len(src) == len(tgt) == 4000
    assert len(read(a, 'valid.en.gz')) == len(read(a, 'test.de.gz')) == 60
    assert not [f for f in os.listdir(a) if f.endswith('.tmp')]
    words = np.array([len(s.split()) for s in src])
    assert 20 <= words.mean() <= 32  # WMT's news and Europarl: about 25 words a sentence
    assert words.max() >= 4 * 8  # the tail joins 4 to 24 sentences
    # the pairs stay parallel: the target is the source upper-cased, but for the pseudo-words both share
    rare = set(' '.join(src).split()) - set(WORDS)
    assert len(rare) > 100
    for s, t in zip(src, tgt):
        assert len(s.split()) == len(t.split())
        assert [w for w in s.split() if w in rare] or s.upper() == t
    assert sum(bool(set(s.split()) & set(t.split()) & rare) for s, t in zip(src, tgt)) > 100
    assert src == read(tmp_path / 'b', 'train.en.gz')  # same seed, same corpus
    held_out_rare = [w for w in ' '.join(read(a, 'valid.en.gz') + read(a, 'test.en.gz')).split() if w not in WORDS]
    seen = sum(w in rare for w in held_out_rare) / len(held_out_rare)
    assert seen > 0.5  # one pool: held-out rare words are mostly the training set's, as newstest's are WMT's


def test_an_out_that_cannot_be_made_is_a_one_line_error_and_one_in_a_new_folder_is_made(tmp_path):
    fake_multi30k(tmp_path / 'm30k')
    (tmp_path / 'a_file').write_text('')
    args = ['corpus', '--pairs', '20', '--held-out', '5', '--pool', '50', '--multi30k', str(tmp_path / 'm30k')]
    with pytest.raises(SystemExit) as e:
        scale.main(args + ['--out', str(tmp_path / 'a_file' / 'c')])
    assert f"--out {tmp_path / 'a_file' / 'c'} cannot be created" in str(e.value)
    scale.main(args + ['--out', str(tmp_path / 'new' / 'c')])  # as data/fake_wmt in a fresh clone, before data/
    assert len(read(tmp_path / 'new' / 'c', 'train.en.gz')) == 20


def test_a_multi30k_folder_whose_sides_differ_is_a_one_line_error(tmp_path):
    fake_multi30k(tmp_path / 'm30k')
    with gzip.open(tmp_path / 'm30k' / 'train.de.gz', 'wt') as f:
        f.write('one line\n')
    with pytest.raises(SystemExit) as e:
        scale.main(['corpus', '--pairs', '100', '--pool', '50', '--multi30k', str(tmp_path / 'm30k'),
                    '--out', str(tmp_path / 'c')])
    assert 'train.de.gz' in str(e.value) and '300' in str(e.value) and '\n' not in str(e.value)


def test_corpus_files_in_out_are_replaced_only_with_force(tmp_path, capsys):
    fake_multi30k(tmp_path / 'm30k')
    with gzip.open(tmp_path / 'train.en.gz', 'wt') as f:  # a real corpus of the same name
        f.write('mine\n')
    args = ['corpus', '--pairs', '100', '--held-out', '10', '--pool', '500', '--multi30k', str(tmp_path / 'm30k'),
            '--out', str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        scale.main(args)
    assert e.value.code == 2 and '--force' in capsys.readouterr().err and read(tmp_path, 'train.en.gz') == ['mine']
    scale.main(args + ['--force'])
    assert len(read(tmp_path, 'train.en.gz')) == 100


def test_corpus_goes_through_data_prep_and_the_loader(tmp_path, capsys):
    fake_multi30k(tmp_path / 'm30k')
    c = tmp_path / 'c'
    scale.main(['corpus', '--pairs', '2000', '--held-out', '40', '--pool', '2000', '--multi30k', str(tmp_path / 'm30k'),
                '--out', str(c)])
    data_prep.main(['custom', '--train', str(c / 'train'), '--valid', str(c / 'valid'), '--test', str(c / 'test'),
                    '--src', 'en', '--tgt', 'de', '--vocab-size', '400', '--out', str(tmp_path / 'prep')])
    scale.main(['loader', '--data', str(tmp_path / 'prep'), '--max-tokens', '512', '4096', '--batches', '20'])
    out = capsys.readouterr().out
    assert 'max_tokens 512: batch_plan' in out and 'max_tokens 4096: batch_plan' in out
    scale.main(['loader', '--data', str(tmp_path / 'prep'), '--max-tokens', '40', '--batches', '20'])
    assert 'pairs over max_tokens 40 left out, as train.py leaves them' in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # not a division by the zero batches built
        scale.main(['loader', '--data', str(tmp_path / 'prep'), '--max-tokens', '1'])
    assert 'max_tokens 1' in str(e.value)


@pytest.mark.parametrize('argv, named', [
    (['corpus', '--pairs', '10', '--out', 'a_file'], '--out a_file'),
    (['corpus', '--pairs', '10', '--out', 'c', '--src', 'en', '--tgt', 'en'], '--src and --tgt'),
    (['corpus', '--pairs', '10', '--out', 'c', '--seed', '-1'], '--seed'),
    (['corpus', '--pairs', '10', '--out', 'c', '--pool', '0'], '--pool'),
    (['loader', '--data', 'prep', '--batches', '0'], '--batches'),
    (['loader', '--data', 'prep', '--max-tokens', '0'], '--max-tokens'),
    (['checkpoints', '--dir', 'nowhere'], '--dir nowhere')])
def test_bad_arguments_are_a_usage_error_naming_the_flag(tmp_path, monkeypatch, capsys, argv, named):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'a_file').write_text('')
    with pytest.raises(SystemExit) as e:
        scale.main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ['a_file']
