"""Helpers shared by the benchmarks."""
import argparse
import random
import sys
import tempfile

__all__ = ["parser", "print_command", "seeded_order", "spawn_ranks"]


def seeded_order(items, seed):
    """A new list of ``items`` shuffled with ``seed``: the same order on every rank that passes the
    same seed (the benchmarks interleave their configurations this way, round by round)."""
    order = list(items)
    random.Random(seed).shuffle(order)
    return order


def parser(name, doc, *, steps, warmup, batch, batch_help="per rank", world_help="local processes (ranks)"):
    """The argument parser of ``python -m torchdist_ext.bench NAME`` with the options every model
    benchmark shares: --world-size, --batch, --steps, --warmup, --threads."""
    p = argparse.ArgumentParser(prog=f"python -m torchdist_ext.bench {name}", description=doc.split("\n")[0])
    p.add_argument("--world-size", "-n", type=int, default=2, help=world_help)
    p.add_argument("--batch", type=int, default=batch, help=batch_help)
    p.add_argument("--steps", type=int, default=steps, help="timed steps")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps first")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    return p


def print_command(name, argv):
    """Prints the command line that produced the output, as its first line."""
    shown = sys.argv[1:] if argv is None else argv
    print(f"# python -m torchdist_ext.bench {name} {' '.join(shown)}".rstrip())


def spawn_ranks(target, world_size, *args):
    """Runs ``target(rank, *args, tmpdir, results)`` in ``world_size`` spawned processes (``tmpdir``
    a private folder for a file:// rendezvous) and returns the first object a rank puts on
    ``results``, after every process has exited."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=target, args=(r, *args, tmp, results)) for r in range(world_size)]
        for pr in procs:
            pr.start()
        rows = results.get()
        for pr in procs:
            pr.join()
    return rows
