"""Elastic training: the resume decision, fault injection, heartbeats that name a stuck rank, and the
launch helpers (chapter 11).

**How a restart happens.** ``torchrun --max-restarts R`` runs an *agent* per machine. When one of its
workers exits non-zero (or is killed), the agent stops the others, meets the other agents again (the
*rendezvous*), and starts a fresh set of workers, at most ``R`` times. The new workers know nothing: the
trainer must find out where to continue. It does so **from the disk**: the newest checkpoint that
verifies (``refimpl.checkpoint.Checkpointer.resume_point``). ``TORCHELASTIC_RESTART_COUNT`` is not a
substitute: it counts the restarts *of this agent*, so a node that joins later, a job requeued by Slurm or
a run started again by hand all see 0 although checkpoints exist, and a restart whose previous attempt
died before its first save sees 1 although there is nothing to load. We read it for reports only
(``restart_count``) and for the fault injector's "first attempt only".

**``--resume never`` and restarts.** ``never`` refuses a folder that holds checkpoints of *another* run.
The checkpoints this very job wrote before a restart are its own: they carry the job's
``TORCHELASTIC_RUN_ID`` (the rendezvous id, the same on every agent and every restart of one job) and
``resume_mode`` lets the restarted workers resume from them.

**Fault injection** (``FaultPlan``), for teaching and tests: a rank kills itself with SIGKILL in the
middle of a step (after its forward pass, while the others already wait in the gradient all-reduce), stalls
there (a hang: only the collective timeout ends it), sends itself SIGTERM (a preemption), or kills its own
torchrun agent (a machine lost). Each takes one step per attempt: ``--fail-at-step 3`` fails the first
attempt only, ``--fail-at-step 1,2,2`` the first three.

**Naming the stuck rank** (``Heartbeat``). A collective that times out says only that it timed out.
Every rank therefore posts its position (step and phase) to the process group's key-value store as it
goes; when a collective fails, each surviving rank reads all positions and names the rank that is behind
(``explain_positions``).

**Where it runs** (``torchrun_command``, ``elastic_env``). On one machine: ``--standalone``. On
several: every machine runs the same ``torchrun --nnodes=MIN:MAX --rdzv-backend=c10d
--rdzv-endpoint=HOST:PORT --rdzv-id=JOB``; the agent on ``HOST`` serves the rendezvous store, so that
machine is a single point of failure (if it dies, the others cannot meet again: the job must be started
again, and resumes from the checkpoints on shared storage). Under Slurm, one ``srun`` task per node runs
torchrun with HOST = the first node of the allocation and JOB = ``$SLURM_JOB_ID``; under Kubernetes, the
PyTorchJob / JobSet controllers start one pod per node with the same command and a headless service
naming the rendezvous pod; ``--max-restarts`` handles worker failures and the scheduler handles lost
nodes (requeue, pod restart), and both resume from the disk.

We set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for every launch: with the rendezvous store shared with
the workers (torch's default), restarted gloo workers can read stale addresses and hang (seen on 2.13).

The files, one concept each: ``.restart`` (the counters, ``resume_mode``, the torchrun command
and environment), ``.failures`` (the failure log), ``.faults`` (``FaultPlan``),
``.heartbeat`` (``Heartbeat``, ``explain_positions``).
"""

from refimpl.elastic.failures import FAILURES, read_failures, record_failure, summarize_failures
from refimpl.elastic.faults import FaultPlan, parse_steps
from refimpl.elastic.heartbeat import Heartbeat, explain_positions
from refimpl.elastic.restart import (
    RESTART_COUNT_ENV,
    RUN_ID_ENV,
    elastic_env,
    restart_count,
    resume_mode,
    run_id,
    torchrun_command,
)

__all__ = [
    "FAILURES", "RESTART_COUNT_ENV", "RUN_ID_ENV", "FaultPlan", "Heartbeat", "elastic_env",
    "explain_positions", "parse_steps", "read_failures", "record_failure", "restart_count", "resume_mode",
    "run_id", "summarize_failures", "torchrun_command",
]
