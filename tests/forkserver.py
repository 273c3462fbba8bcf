"""
Runs `python SCRIPT ARGS` and `python -c CODE ARGS` in processes forked from a server that has
imported torch already. Most of a test's train.py run is the import of torch and torch._dynamo:
a 6-step run takes 2.3 s as a new process and 0.15 s forked (2026-12-02, 2-core Xeon). Each run is
still a process of its own, started as Python starts a script (sys.argv, sys.path[0], the working
folder, the environment, stdin from /dev/null, stdout and stderr to files), that ends as Python
ends one (an uncaught error's traceback, sys.exit's message, atexit, the exit status). Only
torch, numpy and the like are imported before the fork: the project's modules are imported by the
run, as in a new process. What the server's imports read (OMP_NUM_THREADS=1 for the tests' runs,
PYTHONHASHSEED) and print (once, to the test run's stderr) is the server's.

The server reads one JSON line per run from stdin and answers on stdout with {'id', 'pid'} as it
starts the run and {'id', 'returncode'} as it ends.
"""
import functools
import gc
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import types


def serve():
    """Forks a child per request on stdin -> the request, in the child; returns nothing in the
    server, which ends with its stdin."""
    wakeup_r, wakeup_w = os.pipe()  # SIGCHLD writes to it and wakes select up
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    ids = {}  # pid: the request's id
    pending = b''
    while True:
        readable, _, _ = select.select([0, wakeup_r], [], [])
        if wakeup_r in readable:
            os.read(wakeup_r, 4096)
        reap(ids)
        if 0 not in readable:
            continue
        data = os.read(0, 65536)
        if not data:  # the tests have ended: so do their runs, as with a pipe nobody reads
            for pid in ids:
                os.kill(pid, signal.SIGKILL)
            return None
        pending += data
        while b'\n' in pending:
            line, pending = pending.split(b'\n', 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wakeup_r)
                os.close(wakeup_w)
                return request
            ids[pid] = request['id']
            answer({'id': request['id'], 'pid': pid})


def reap(ids):
    while ids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        answer({'id': ids.pop(pid), 'returncode': os.waitstatus_to_exitcode(status)})


def answer(message):
    os.write(1, (json.dumps(message) + '\n').encode())


def start_run(request):
    """In the child: what `python ARGV` does before it runs the script or the code -> a new
    __main__ module and the code to run in it."""
    streams = [os.open(os.devnull, os.O_RDONLY)]
    for name in ('stdout', 'stderr'):
        streams.append(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
    for fd, stream in enumerate(streams):
        os.dup2(stream, fd)
        os.close(stream)
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    numpy.random.seed()  # its own global state, as a new process draws (hash(): the server's seed)
    main = types.ModuleType('__main__')
    sys.modules['__main__'] = main  # what pickle and `import __main__` find
    argv = request['argv']
    if argv[0] == '-c':
        sys.argv = ['-c', *argv[2:]]
        sys.path[0] = ''
        return main, compile(argv[1], '<string>', 'exec')
    assert not argv[0].startswith('-'), f'{argv[0]}: only SCRIPT or -c CODE'
    sys.argv = argv
    path = os.path.abspath(argv[0])
    sys.path[0] = os.path.dirname(path)
    main.__file__ = path  # absolute, as Python gives it
    with open(path, 'rb') as f:
        return main, compile(f.read(), path, 'exec')


class Run:
    """A run of the server, as subprocess.Popen: args, pid, returncode, poll(), wait(),
    communicate(), send_signal(), kill(). Its output is read from files when it has ended."""

    def __init__(self, args, stdout, stderr):
        self.args, self.stdout_path, self.stderr_path = args, stdout, stderr
        self.pid = None
        self.returncode = None
        self.started = threading.Event()
        self.ended = threading.Event()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        outputs = []
        for path in (self.stdout_path, self.stderr_path):
            with open(path, encoding='utf-8', errors='replace') as f:
                outputs.append(f.read())
        return tuple(outputs)

    def send_signal(self, signum):
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # ended, and the server has not said so yet
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The server, started at the first run with env (in effect for its import of torch)."""

    def __init__(self, env):
        self.folder = tempfile.TemporaryDirectory(prefix='forkserver')
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.runs = {}
        self.count = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.read_answers, daemon=True).start()

    def read_answers(self):
        for line in self.process.stdout:
            message = json.loads(line)
            run = self.runs[message['id']]
            if 'pid' in message:
                run.pid = message['pid']
                run.started.set()
            else:
                run.returncode = message['returncode']
                run.ended.set()
        # The server has ended (killed, or out of memory): so have the runs it did not answer for.
        for run in self.runs.values():
            if not run.ended.is_set():
                run.returncode = -signal.SIGKILL
                run.started.set()
                run.ended.set()

    def start(self, argv, cwd, env):
        """`python ARGV` (ARGV: SCRIPT ARGS, or -c CODE ARGS), started -> its Run."""
        with self.lock:
            self.count += 1
            key = str(self.count)
            out = os.path.join(self.folder.name, f'{key}.out')
            err = os.path.join(self.folder.name, f'{key}.err')
            run = Run([sys.executable, *argv], out, err)
            self.runs[key] = run
            request = {'id': key, 'argv': argv, 'cwd': str(cwd), 'env': dict(env), 'stdout': out,
                       'stderr': err}
            self.process.stdin.write((json.dumps(request) + '\n').encode())
            self.process.stdin.flush()
        assert run.started.wait(60) and run.pid, 'the fork server did not start the run'
        return run


@functools.cache
def server():
    """The test run's server, started at its first run, with OMP_NUM_THREADS=1 for the runs."""
    return ForkServer(dict(os.environ, OMP_NUM_THREADS='1'))


if __name__ == '__main__':
    import numpy  # what the runs import, once; start_run reseeds its generator
    import sacrebleu  # noqa: F401
    import tiktoken  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (the optimizer's constructor imports it)
    gc.freeze()  # the runs' garbage collections, and their ends, skip these modules' objects
    request = serve()
    if request is not None:
        main, code = start_run(request)
        exec(code, main.__dict__)
