"""Cluster launchers that start every rank themselves: tell torch.distributed which rank this process is.

`python src/train.py -m hydra/launcher=slurm parallel=ddp` (hydra-submitit-launcher) runs `main` once per
submitit task. With more than one task per job, each task is one DDP rank: the job environment's ranks and first
host become the env:// variables that DDPStrategy reads to join the group instead of starting workers. A job of
one task is left alone: it is one machine's share, and the strategy starts its ranks itself, as on a workstation.
"""

import os
import zlib

PORTS = range(20000, 32768)  # above the usual service ports, below Linux's ephemeral ports (32768 up)


def export_submitit_rank_env() -> int:
    """Inside a submitit task of a multi-task job, sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT from the job environment. Returns the job's number of tasks (1 outside submitit).
    """
    if "SUBMITIT_EXECUTOR" not in os.environ:  # set by submitit in its tasks only; importing it costs time
        return 1
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks == 1:
        return 1
    # Overwrite, never setdefault: values inherited from the submitting shell (sbatch exports its environment)
    # would put every job on one port, or make a task believe it is another rank.
    os.environ.update(
        RANK=str(job.global_rank),
        LOCAL_RANK=str(job.local_rank),
        WORLD_SIZE=str(job.num_tasks),
        LOCAL_WORLD_SIZE=str(job.num_tasks // job.num_nodes),
        MASTER_ADDR=job.hostnames[0],
        MASTER_PORT=str(master_port(job.job_id)),
    )
    return job.num_tasks


def master_port(job_id: str) -> int:
    """The same port in every task of one job (Python's hash() is salted per process, crc32 is not); jobs
    sharing a node get different ports unless their ids collide (1 in 12768)."""
    return PORTS[zlib.crc32(job_id.encode()) % len(PORTS)]
