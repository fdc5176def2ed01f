"""One rank of the collectives benchmark under mpirun: ``python -m torchdist_ext.bench._mpi_rank TMPDIR``.

The launching command wrote its parsed arguments to TMPDIR/args.pkl; the rank number comes from
mpirun's environment (Open MPI's OMPI_COMM_WORLD_RANK, or PMI_RANK for MPICH-style launchers).
"""
import os
import pickle
import sys

from torchdist_ext.bench.collectives import _leave, _worker

__all__ = []


def main(tmpdir):
    with open(os.path.join(tmpdir, "args.pkl"), "rb") as f:
        args = pickle.load(f)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "-1")))
    if rank < 0:
        raise SystemExit("torchdist_ext.bench._mpi_rank: no rank in the environment; it runs under mpirun only")
    _worker(rank, args, tmpdir)
    _leave()


if __name__ == "__main__":
    main(sys.argv[1])
