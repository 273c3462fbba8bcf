"""
What train.py needs to run as several processes and nodes under torchrun, and to stop and go on as
a cluster has it: the process group, values every rank agrees on, a check that every node sees the
same out_dir, and the signals a scheduler sends before it preempts a job (docs/training.md).
"""
import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

stop = {'signal': None}  # the name of the first stop signal this process received


def start(device, ddp_timeout_minutes, out_dir):
    """-> ddp, rank, world, device of this process (a GPU of its own under torchrun), and a gloo
    group for the small agreements on the host (the default group where that is gloo already).
    Every node must see the same out_dir, and a rank that fails ends the others in one line."""
    if 'RANK' not in os.environ:
        # Until the loop catches them (catch_stop_signals), SIGTERM stops the start as Ctrl-C
        # does. Not under torchrun: it SIGTERMs the workers when one fails, and a worker blocked
        # in a collective would run no handler before torchrun's SIGKILL, 30 s later.
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        sys.excepthook = one_line_on_failure
        return False, 0, 1, device, None
    rank = int(os.environ['RANK'])
    world = int(os.environ['WORLD_SIZE'])
    timeout = datetime.timedelta(minutes=ddp_timeout_minutes)
    try:
        device, host_group = join_group(device, rank, world, timeout)
    except dist.DistNetworkError as e:  # a launch of one's own: a port in use, a master not up
        address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        advice = f"check that rank 0 runs and {address} is reachable"
        if 'EADDRINUSE' in str(e):
            advice = "choose a free MASTER_PORT"
        sys.exit(f"train.py: cannot start the process group at {address} "
                 f"({str(e).strip().splitlines()[0]}): {advice}")
    check_shared_out_dir(out_dir, rank, host_group)
    sys.excepthook = one_line_on_failure  # after init_process_group's, which would hide its line
    return True, rank, world, device, host_group


def join_group(device, rank, world, timeout):
    """init_process_group -> this rank's device and the host group (see start)."""
    store = attempt_store(timeout)
    if device.startswith('cuda'):
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
        # device_id: NCCL connects each rank to its own GPU at once.
        dist.init_process_group('nccl', timeout=timeout, device_id=torch.device(device),
                                store=store, rank=rank, world_size=world)
        return device, dist.new_group(backend='gloo', timeout=timeout)
    dist.init_process_group('gloo', timeout=timeout, store=store, rank=rank, world_size=world)
    return device, None


def attempt_store(timeout):
    """Under torchrun, its store with keys of this attempt alone: after a restart the process
    group would otherwise read a dead worker's address, left by the attempt before, and fail to
    connect. None elsewhere: the process group makes its own."""
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True':
        return None
    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def wrap_ddp(model, device_type):
    """DDP averages the gradients over the ranks as backward computes them, bucket by bucket."""
    # The sinusoids are a constant buffer: nothing to sync in forward.
    no_buffer_sync = {'forward_sync_buffers': False}
    if torch.__version__ < (2, 13):
        no_buffer_sync = {'broadcast_buffers': False}
    device_ids = None
    if device_type == 'cuda':
        device_ids = [torch.cuda.current_device()]
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=True, **no_buffer_sync)


def gather(obj, ddp, world):
    """Every rank's obj, in rank order."""
    if not ddp:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def check_shared_out_dir(out_dir, rank, group):
    """Every node must write into one out_dir (fairseq's save_dir: a filesystem every node sees),
    or the ranks would decide on different files and rank 0's checkpoints would hold other ranks'
    steps. Rank 0 leaves a file of a new name there; every rank must see it."""
    name = [None]
    if rank == 0:
        name = [f'.shared_{os.urandom(8).hex()}']
        open(os.path.join(out_dir, name[0]), 'w').close()
    dist.broadcast_object_list(name, src=0, group=group)
    seen = torch.tensor([int(os.path.exists(os.path.join(out_dir, name[0])))])
    dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=group)
    dist.barrier(group=group)
    if rank == 0:
        os.remove(os.path.join(out_dir, name[0]))
    if seen.item() == 0:
        sys.exit(f"out_dir {out_dir} is not the same folder on every node of this run: give an "
                 f"out_dir on a filesystem that every node sees")


def catch_stop_signals():
    """SIGTERM (what SLURM and Kubernetes send before they kill a preempted job) and SIGINT (Ctrl-C)
    ask the run to stop after the current update, with a training state saved; a second signal
    stops it at once."""
    def ask_to_stop(signum, frame):
        if stop['signal'] is not None:
            os._exit(128 + signum)
        stop['signal'] = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, ask_to_stop)
    signal.signal(signal.SIGINT, ask_to_stop)


def signals_stop_at_once(when, master):
    """After the loop: a stop signal (or one that came since the last step's check) ends the run
    at once, in rank 0's line (another rank's leaving ends rank 0's next collective, in its
    line); the same command averages and evaluates again."""
    def stop_now(signum, frame):
        stop['signal'] = signal.Signals(signum).name
        stopped_at_once(when, master)

    signal.signal(signal.SIGTERM, stop_now)
    signal.signal(signal.SIGINT, stop_now)
    if stop['signal'] is not None:
        stopped_at_once(when, master)


def stopped_at_once(when, master):
    if master:
        print(f"{stop['signal']}: stopped {when}; the same command does what was left",
              file=sys.stderr)
    exit_now(1)


def stop_asked(ddp, group):
    """Whether a stop signal reached any rank: every rank agrees on the same step. The flag is a
    host tensor over gloo: no wait for the GPU, and a peer that died makes this raise at once."""
    asked = stop['signal'] is not None
    if not ddp:
        return asked
    flag = torch.tensor([int(asked)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() and stop['signal'] is None:
        stop['signal'] = 'a stop signal to another rank'
    return bool(flag.item())


def exit_stopped(step, out_dir, master):
    """Leave after a stop signal, the training state saved; nonzero: the scheduler requeues the
    job."""
    if master:
        print(f"{stop['signal']}: stopped at step {step} with a training state in {out_dir}; "
              f"the same command continues the run", file=sys.stderr)
    exit_now(1)


def one_line_on_failure(kind, error, traceback):
    """One line, not a traceback, for a stop before the first step, for running out of GPU memory
    anywhere (a step, Adam's first, an evaluation) and, under torchrun, for a rank that died or
    left, which ends the others' next collective with an error (the saves are atomic, so nothing
    is half-written)."""
    if kind is KeyboardInterrupt:
        print("train.py: interrupted before the first step; the same command starts it again",
              file=sys.stderr)
        exit_now(1)
    message = str(error)
    if isinstance(error, torch.OutOfMemoryError):
        print(f"train.py: out of GPU memory ({message.strip().splitlines()[0][:200]}): lower "
              f"max_tokens and raise update_freq to keep the tokens per update, or set "
              f"checkpoint_activations=True", file=sys.stderr)
        exit_now(1)
    lost = isinstance(error, dist.DistError) or 'gloo' in message or 'NCCL' in message
    peer_failed = dist.is_initialized() and isinstance(error, RuntimeError) and lost
    if not peer_failed:
        sys.__excepthook__(kind, error, traceback)
        return
    first_line = message.strip().splitlines()[0][:300]
    print(f"train.py: another process of this run failed or left, so this one ends ({first_line}); "
          f"the same command continues from out_dir's newest state", file=sys.stderr, flush=True)
    exit_now(1)  # at once: a Gloo thread may still hold the failed collective


def exit_now(status):
    """Python's shutdown takes a second (torch's objects freed one by one), and under DDP a Gloo
    thread that still releases the last collective's tensors aborts it: leave at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
