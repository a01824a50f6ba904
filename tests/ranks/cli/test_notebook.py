"""Tests of refimpl.launch.notebook and .command: ranks as ipyparallel engines, %%px, timeouts, run_command.

One cluster of 2 engines is shared by the module (starting it costs a few seconds on 2 cores). It runs
under a throw-away IPython shell so that ``start_ranks`` registers the ``%%px`` magics;
the shell's changes to the interpreter (``__main__``, hooks, builtins) are undone afterwards.
"""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ipyparallel as ipp  # a dependency: a missing one fails here, it does not skip the file
import pytest

from refimpl.launch import CommandFailed, RankError, Ranks, free_port, run_command, start_ranks

CLUSTER_TIMEOUT = 300  # pytest-timeout for tests using the cluster: includes its start in the fixture
TIMEOUT_S = 5.0  # the process-group timeout: a collective that a rank never joins fails after it


@pytest.fixture(scope="module")
def shell() -> Iterator[Any]:
    """An IPython shell (so %%px can be registered and run), removed again after the module."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    saved_main, hooks = sys.modules.get("__main__"), (sys.displayhook, sys.excepthook)
    saved_builtins = set(vars(builtins))
    config = Config()
    config.HistoryManager.enabled = False
    ip = InteractiveShell.instance(config=config)
    try:
        yield ip
    finally:
        InteractiveShell.clear_instance()
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        sys.displayhook, sys.excepthook = hooks
        for name in set(vars(builtins)) - saved_builtins:
            delattr(builtins, name)


@pytest.fixture(scope="module")
def ranks(shell: Any) -> Iterator[Ranks]:
    with start_ranks(2, timeout_s=TIMEOUT_S, stream=False) as r:
        pids = r.run(os.getpid)
        yield r
    r.stop()  # idempotent
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "engines still running after stop()"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which nobody reaped in a container, counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


# Functions shipped to the engines. ``ipp.interactive`` makes them behave like functions defined in a
# notebook: their globals are each engine's namespace (rank, world_size, device, dist, torch).


@ipp.interactive
def _rank_info() -> tuple[Any, ...]:
    import os

    import torch
    import torch.distributed as dist

    g = globals()
    return (
        g["rank"],
        g["world_size"],
        str(g["device"]),
        dist.get_rank(),
        os.environ["RANK"],
        os.environ["MASTER_ADDR"],
        torch.get_num_threads(),
        g["dist"] is dist,
        g["torch"] is torch,
    )


@ipp.interactive
def _all_reduce_ones() -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.ones(3, device=globals()["device"])
    dist.all_reduce(t)
    return t.cpu().tolist()


@ipp.interactive
def _raise_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return dist.get_rank()


@ipp.interactive
def _only_rank_0_all_reduces() -> str:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    return "returned"


@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_each_engine_is_a_rank_with_a_process_group(ranks: Ranks) -> None:
    assert ranks.world_size == 2
    info = ranks.run(_rank_info)
    for r, (rank, world, device, pg_rank, env_rank, addr, threads, same_dist, same_torch) in enumerate(info):
        assert (rank, world, pg_rank, env_rank, addr) == (r, 2, r, str(r), "127.0.0.1")
        assert same_dist and same_torch
        if ranks.backend == "gloo":
            assert (device, threads) == ("cpu", 1)
        else:
            assert device == f"cuda:{r}"


@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_all_reduce_of_ones_is_world_size_on_every_rank(ranks: Ranks) -> None:
    assert ranks.run(_all_reduce_ones) == [[2.0, 2.0, 2.0]] * 2


@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_engines_import_refimpl_and_get_arguments(ranks: Ranks) -> None:
    ports = ranks.run(free_port)  # a module-level function: imported by name on the engines
    assert all(isinstance(p, int) and p > 0 for p in ports)
    assert ranks.run(ipp.interactive(lambda a, b=0: a + b + globals()["rank"]), 10, b=5) == [15, 16]


@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_failure_on_rank_1_raises_with_its_traceback(ranks: Ranks) -> None:
    with pytest.raises(RankError) as info:
        ranks.run(_raise_on_rank_1)
    assert set(info.value.failures) == {1}
    text = str(info.value)
    assert text.split("\n", 1)[0] == "rank 1: ValueError: boom on rank 1", text[:200]  # short first
    assert "rank 1" in text and "ValueError: boom on rank 1" in text and "_raise_on_rank_1" in text
    assert "ipyparallel/engine/kernel.py" not in text  # its own frames are trimmed
    assert ranks.run(_all_reduce_ones) == [[2.0, 2.0, 2.0]] * 2  # an ordinary error breaks nothing


@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_px_cells_share_state_and_fail_when_one_rank_raises(ranks: Ranks, shell: Any) -> None:
    shell.run_cell_magic("px", "", "x = rank * 10\nt = torch.ones(2, device=device)\ndist.all_reduce(t)")
    assert ranks.run(ipp.interactive(lambda: (globals()["x"], globals()["t"].tolist()))) == [
        (0, [2.0, 2.0]),
        (10, [2.0, 2.0]),
    ]
    with pytest.raises(ipp.error.CompositeError) as info:
        shell.run_cell_magic("px", "", "if rank == 1:\n    raise ValueError('boom in a px cell')")
    assert [ei["engine_id"] for *_, ei in info.value.elist] == [ranks.view.targets[1]]
    assert "boom in a px cell" in "\n".join(info.value.render_traceback())


@pytest.mark.timeout(CLUSTER_TIMEOUT)
def test_collective_only_rank_0_enters_times_out_instead_of_hanging(ranks: Ranks, shell: Any) -> None:
    try:
        with pytest.raises(RankError) as info:
            ranks.run(_only_rank_0_all_reduces)
        assert set(info.value.failures) == {0}
        assert "all_reduce" in info.value.failures[0]
        # the same through %%px: the cell fails (rank 0 raises after the timeout)
        ranks.restart_process_group()
        with pytest.raises(ipp.error.CompositeError):
            shell.run_cell_magic("px", "", "if rank == 0:\n    dist.all_reduce(torch.ones(1))")
    finally:  # the group is out of step now: make a new one so that later tests can use the cluster
        ranks.restart_process_group()
    assert ranks.run(_all_reduce_ones) == [[2.0, 2.0, 2.0]] * 2


@pytest.mark.timeout(CLUSTER_TIMEOUT)
@pytest.mark.skipif(sys.platform != "linux", reason="the zygote forks engines on Linux only")
def test_engines_are_forked_by_one_zygote(ranks: Ranks) -> None:
    """The engines are children of the zygote (refimpl.launch.engine_zygote), which imported torch once."""
    zygote = ranks._zygote
    assert zygote is not None and zygote.process.poll() is None
    parents = ranks.run(os.getppid)
    assert parents == [zygote.process.pid] * 2, (parents, zygote.process.pid)


@pytest.mark.timeout(60)
@pytest.mark.skipif(sys.platform != "linux", reason="the zygote forks engines on Linux only")
def test_engines_die_with_their_zygote(tmp_path: Path) -> None:
    """SIGKILL the zygote (nothing can catch it): its forked engines go with it (PR_SET_PDEATHSIG).
    Negative control: before the kill they were alive, waiting for a controller that never comes."""
    import psutil

    env = dict(os.environ, IPP_CLUSTER_ID="no-such-cluster", IPP_PROFILE_DIR=str(tmp_path),
               PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    zygote = subprocess.Popen([PY, "-m", "refimpl.launch.engine_zygote", "2"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while len(children := psutil.Process(zygote.pid).children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [c.pid for c in children]
        assert len(pids) == 2 and all(_alive(p) for p in pids), "the zygote did not fork 2 engines"
        zygote.kill()
        zygote.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "an engine outlived its zygote"
    finally:
        if zygote.poll() is None:
            zygote.kill()


def test_zygote_usage_error_exits_2() -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    proc = subprocess.run([PY, "-m", "refimpl.launch.engine_zygote", "zero"], capture_output=True, text=True,
                          timeout=30, env=env)
    assert proc.returncode == 2 and "usage" in proc.stderr, proc.stderr


@pytest.mark.timeout(30)
def test_start_ranks_rejects_an_empty_world() -> None:
    with pytest.raises(ValueError):
        start_ranks(0)


PY = sys.executable


@pytest.mark.timeout(60)
def test_run_command_returns_output_and_sets_the_rendezvous_env(capsys: pytest.CaptureFixture[str]) -> None:
    code = (
        "import os; print('hello'); print(os.environ['TORCH_DISABLE_SHARE_RDZV_TCP_STORE'], os.environ['X'])"
    )
    out = run_command([PY, "-c", code], env={"X": "y"})
    assert out == "hello\n1 y\n"
    assert capsys.readouterr().out == out  # streamed as it came
    assert run_command(f"{PY} -c 'print(42)'") == "42\n"


@pytest.mark.timeout(60)
def test_run_command_keeps_a_progress_bar_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # tqdm redraws with "\r": a cell shows that in place; turning each redraw into a line would not
    code = ("import sys, time\nfor i in range(4):\n"
            "    sys.stderr.write(f'\\rstep {i}/3'); sys.stderr.flush()\n"
            "    time.sleep(0.05)\nprint()\nprint('done')")
    out = run_command([PY, "-c", code])
    assert out == "\rstep 0/3\rstep 1/3\rstep 2/3\rstep 3/3\ndone\n", repr(out)
    assert capsys.readouterr().out == out


def test_run_command_raises_on_non_zero_exit() -> None:
    with pytest.raises(CommandFailed) as info:
        run_command([PY, "-c", "import sys; print('partial output'); sys.exit(3)"])
    assert isinstance(info.value, RuntimeError)
    assert info.value.returncode == 3 and not info.value.timed_out
    assert "exited with code 3" in str(info.value) and "partial output" in str(info.value)


@pytest.mark.timeout(60)
def test_run_command_timeout_kills_the_whole_process_group() -> None:
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    with pytest.raises(CommandFailed) as info:
        run_command([PY, "-c", code], timeout_s=3)
    assert info.value.timed_out and info.value.returncode is None
    grandchild = int(info.value.output.split()[0])
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)
