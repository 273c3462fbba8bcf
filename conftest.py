"""Fixtures that several test files share, each made once per test run (a module fixture that
another test file imports is made again for that file)."""
import os
import random
import sys
from dataclasses import asdict

import pytest
import torch

import data_prep

# The tests of the scripts lie in tests/ and import each other's helpers.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tests'))


@pytest.fixture(scope='session')
def toy(tmp_path_factory):
    """test_translate.py's tiny word-order reversal model, its checkpoint, and 24 source lines."""
    from test_translate import sentence, train_reversal
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: one thread is faster than oversubscribed ones
    try:
        model, d, enc, cfg = train_reversal()
    finally:
        torch.set_num_threads(threads)
    folder = tmp_path_factory.mktemp('toy')
    ckpt = folder / 'ckpt.pt'
    saved = {'model': model.state_dict(), 'model_cfg': asdict(cfg), 'tokenizer': d, 'step': 250,
             'config': {}}
    torch.save(saved, ckpt)
    # Lengths deliberately out of order, so that length-sorted batches would scramble a naive
    # writer.
    lines = [sentence(random.Random(i)) for i in range(24)]
    (folder / 'test.src').write_text(''.join(line + '\n' for line in lines))
    return dict(ckpt=str(ckpt), model=model, enc=enc, cfg=cfg, lines=lines,
                src=str(folder / 'test.src'))


@pytest.fixture(scope='session')
def toy_data(tmp_path_factory):
    """test_train.py's toy corpus, prepared once for it and dev/test_gpu.py -> its folder."""
    from test_train import toy_corpus
    return toy_corpus(tmp_path_factory.mktemp('toy'))


@pytest.fixture(scope='session')
def multi30k_en_de(tmp_path_factory):
    """The real Multi30k en-de as `data_prep.py multi30k --src en --tgt de` prepares it
    -> (folder, meta)."""
    if not os.path.isdir(data_prep.LOCAL_MULTI30K):
        pytest.skip('no Multi30k copy in ../shared/data')
    out = tmp_path_factory.mktemp('multi30k') / 'multi30k_en_de'
    return out, data_prep.main(['multi30k', '--src', 'en', '--tgt', 'de', '--out', str(out)])


def pytest_configure(config):
    config.addinivalue_line('markers', "started_early: the test reads a run that its module's "
                            "start_early(request) starts before the first test")


def pytest_collection_modifyitems(items):
    """The tests marked started_early go last: their runs overlap the rest of the suite, whose
    train.py processes mostly keep one of the two cores busy."""
    items.sort(key=lambda item: item.get_closest_marker('started_early') is not None)


@pytest.fixture(scope='session', autouse=True)
def started_early(request):
    """{test name: (process, what else its module's start_early(request) gave)} of the selected
    tests marked started_early, started before the first test; killed if the test run ends first."""
    runs = {}
    for item in request.session.items:
        if item.get_closest_marker('started_early'):
            runs[item.originalname] = item.module.start_early(request)
    yield runs
    for process, _ in runs.values():
        process.kill()
        process.wait()
