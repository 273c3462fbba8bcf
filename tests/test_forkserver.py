"""forkserver.py's runs, as tests/test_train.py's one-process runs are, against new processes of
the same command: the same argv, sys.path[0], __file__, working folder, environment, output and
exit status."""
import os
import subprocess
import sys

import pytest

import forkserver

CODE = '''
import atexit, os, signal, sys
atexit.register(print, 'at exit')
print(sys.argv, sys.path[0], os.getcwd(), os.environ['SETTING'], sys.stdin.read(),
      globals().get('__file__'))
if sys.argv[1] == 'raise':
    raise ValueError('an error')
if sys.argv[1] == 'exit':
    sys.exit('a message')
if sys.argv[1] == 'signal':
    os.kill(os.getpid(), signal.SIGTERM)
'''


ENDS = [('script', 'return'), ('script', 'raise'), ('script', 'exit'), ('script', 'signal'),
        ('-c', 'raise')]


@pytest.mark.parametrize('kind, end', ENDS)
def test_a_forked_run_starts_and_ends_as_a_new_process(kind, end, tmp_path):
    (tmp_path / 'script.py').write_text(CODE)
    argv = ['-c', CODE, end]
    if kind == 'script':
        argv = ['script.py', end]
    env = dict(os.environ, SETTING='a setting')
    new = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True,
                         text=True, stdin=subprocess.DEVNULL)
    forked = forkserver.server().start(argv, tmp_path, env)
    out, err = forked.communicate(timeout=60)
    assert (forked.returncode, out) == (new.returncode, new.stdout)
    # A traceback has the server's frames above the script's.
    assert err.splitlines()[-1:] == new.stderr.splitlines()[-1:]
    assert ('Traceback' in err) == ('Traceback' in new.stderr)
