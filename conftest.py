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
    model, d, enc, cfg = train_reversal()
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
    config.addinivalue_line('markers', 'started_early: the test waits for a run started before the '
                            'first test (started_early below): it goes last')
    config.addinivalue_line('markers', 'both_cores: the tests start processes that keep both '
                            'cores busy: they go after the others')


def place(item):
    """0: the tests that keep one core busy, while the runs started early take the other; 1: those
    marked both_cores; 2: those marked started_early."""
    if item.get_closest_marker('started_early'):
        return 2
    if item.get_closest_marker('both_cores'):
        return 1
    return 0


def pytest_collection_modifyitems(items):
    items.sort(key=place)  # stable: in the order collected within each group


@pytest.fixture(scope='session', autouse=True)
def one_thread():
    """Torch in this process on one thread: two shared cores, and small models run as fast on one
    as on two, while another process takes the other."""
    torch.set_num_threads(1)


@pytest.fixture(scope='session')
def selected(request):
    """{test module: the names of its selected tests and of the fixtures they use}."""
    names = {}
    for item in request.session.items:
        names.setdefault(item.module, set()).update([item.originalname, *item.fixturenames])
    return names


@pytest.fixture(scope='session', autouse=True)
def started_early(request, one_thread, selected):
    """{name: (process, what else)}: the runs that each test module's start_early(request, names)
    starts for the names of its selected tests and fixtures, all before the first test: they take
    the time that the other tests leave a core idle. Those still running when the test run ends,
    or when one module's start fails, are killed."""
    runs = {}
    try:
        for module, names in selected.items():
            if hasattr(module, 'start_early'):
                runs.update(module.start_early(request, names))
        yield runs
    finally:
        for process, _ in runs.values():
            process.kill()
            process.wait()
