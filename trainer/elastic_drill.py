"""An elastic drill on one machine: ``moeckpt train --nnodes`` agents play the nodes of one job.

A node is a torchrun elastic agent and its workers. The drill starts two nodes, kills one of them outright (agent
and workers, as a lost machine), lets the survivor carry on in the smaller world, then starts a fresh node that
the running job takes in, and waits for the run to finish. Tests and ``benchmarks/elastic_agents.py`` run it;
on a real cluster the same ``moeckpt train --nnodes MIN:MAX --rdzv-endpoint HOST:PORT`` runs once per machine.

The first node started binds the rendezvous endpoint and keeps the c10d store, so it is the one that survives:
losing the store's host ends the job (use a store outside the training nodes for that, see
``docs/fault-tolerance.md``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moeckpt.formats.checkpoint import committed_steps
from moeckpt.formats.errors import MoeckptError
from moeckpt.trainer.metrics import read_metrics

from .local_world import free_port

__all__ = [
    "DrillError",
    "DrillResult",
    "LocalNode",
    "cpu_drill_args",
    "kill_node",
    "plot_drill",
    "run_shrink_grow_drill",
    "start_node",
]

#: rendezvous timing for a drill on one machine: a dead node's heartbeat expires after 3 s; a round after a lost
#: node closes 2 s after the survivors joined (``restart_last_call_timeout``: they rejoin within milliseconds of
#: each other); the first round and a round for a joining node close 10 s after the minimum number of nodes joined
#: (``last_call_timeout``), at once when all of them did. A joining node (C) must see the new round open and
#: enter it: under CI's load on 2 cores it once took longer than 2 s, node A closed the round alone and the job
#: restarted once more to take C in; the 10 s are only waited when a node is late. A waiting agent looks at the
#: rendezvous state every 0.1 s instead of torch's 1 s (``poll_interval``). ``poll_interval`` and
#: ``restart_last_call_timeout`` are moeckpt's agent's own keys (:mod:`moeckpt.trainer.agent`). torch's defaults
#: (15 s, 30 s, 1 s) suit large clusters. A shorter heartbeat expiry (``keep_alive_max_attempt=2``) was tried and
#: let a loaded 2-core machine take a live node for dead: the joining node trained a world of its own.
DRILL_RDZV_CONF = (
    "join_timeout=300,last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3,"
    "restart_last_call_timeout=2,poll_interval=0.1"
)
#: restarts each drill agent allows: the drill needs two (the loss of B, the arrival of C).
DRILL_MAX_RESTARTS = 4
#: the CPU drill (demo, test, benchmark): its length, and the step after which node B is killed (between
#: checkpoints, every 5 steps: the steps after 15 are lost and trained again).
CPU_DRILL_STEPS = 80
CPU_DRILL_KILL_AT = 17


#: the extra delay per step after node B is lost, while the survivors train alone: their stretch must outlast node
#: C's start (its interpreter, torch's import, the rendezvous) on a loaded machine, or the run ends before C can
#: join. Once C has joined, the grown job trains on without it (the drill's minute is mostly these waits).
CPU_DRILL_SLOW_AFTER_KILL = 0.35


def cpu_drill_args(
    run_dir: str,
    *,
    steps: int = CPU_DRILL_STEPS,
    model: str = "zaya-tiny",
    slow: float = 0.15,
    kill_at: int = CPU_DRILL_KILL_AT,
    slow_after_kill: float = CPU_DRILL_SLOW_AFTER_KILL,
    shrunk_world: int = 2,
) -> list[str]:
    """``moeckpt train`` arguments of the CPU drill: zaya-tiny, ep 2, a checkpoint every 5 steps, and a straggler
    delay of ``slow`` seconds per step that keeps this tiny run going while nodes come and go, ``slow_after_kill``
    more after step ``kill_at`` while the job runs with ``shrunk_world`` workers (the survivor's, while a new node
    starts)."""
    return [
        "--model",
        model,
        "--run-dir",
        run_dir,
        "--steps",
        str(steps),
        "--save-every",
        "5",
        "--ep",
        "2",
        "--seed",
        "1",
        "--warmup-steps",
        "3",
        "--cpu",
        "--hang-timeout",
        "60",
        "--inject",
        f"slow:step=1,seconds={slow}",
        "--inject",
        f"slow:step={kill_at + 1},seconds={slow_after_kill},world={shrunk_world}",
    ]


class DrillError(MoeckptError, RuntimeError):
    """The drill did not get where it should have (a node did not start, the run did not shrink or grow)."""

    exit_code = 1


@dataclass
class LocalNode:
    """One node of the drill: the agent process (``moeckpt train --nnodes ...``) and where its output goes."""

    name: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def start_node(
    name: str,
    train_args: Sequence[str],
    *,
    nproc: int,
    nnodes: str,
    endpoint: str,
    log_dir: str,
    env: dict[str, str] | None = None,
    host: bool | None = None,
    rdzv_conf: str = DRILL_RDZV_CONF,
) -> LocalNode:
    """Start one node: ``moeckpt train TRAIN_ARGS --nproc N --nnodes MIN:MAX --rdzv-endpoint ...`` in the
    background, its output in ``log_dir/node-NAME.log``; ``env`` adds to the environment (e.g. the node's GPUs
    as ``CUDA_VISIBLE_DEVICES``, so two nodes on one machine do not share a GPU). ``host`` says whether this node
    hosts the rendezvous store (torch's ``is_host``; ``None``: whichever binds the endpoint first)."""
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"node-{name}.log")
    conf = rdzv_conf + ("" if host is None else f",is_host={str(host).lower()}")
    cmd = [
        sys.executable,
        "-m",
        "moeckpt.cli.main",
        "train",
        *train_args,
        "--nproc",
        str(nproc),
        "--nnodes",
        nnodes,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-conf",
        conf,
        "--max-restarts",
        str(DRILL_MAX_RESTARTS),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "w") as log:
        # Its own session, so that killing the node can never reach the drill's process group.
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return LocalNode(name=name, proc=proc, log_path=log_path)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def kill_node(node: LocalNode) -> None:
    """SIGKILL the node's agent and every process under it, as when a machine dies.

    torchrun starts each worker in a session of its own, so a process-group kill of the agent would leave the
    workers running as orphans still holding their sockets: the whole process tree is walked instead (Linux
    ``/proc``). The tree is collected before anything is killed, so no worker is re-parented away first.
    """
    kids = _children()
    tree, todo = [], [node.proc.pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(kids.get(pid, []))
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it exited between the walk and the kill: the outcome we want
    node.proc.wait(timeout=30)


def _wait_for_agent(node: LocalNode, timeout_s: float) -> None:
    """Until the node's launcher has started torchrun's agent (its own start-up, torch's import, is over)."""
    from moeckpt.trainer.supervise import descendants

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise DrillError(
                f"node {node.name} exited with {node.proc.returncode} before starting its agent:\n{node.log()[-3000:]}"
            )
        for pid in descendants(node.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"moeckpt.trainer.agent" in f.read():
                        return
            except OSError:
                continue
        time.sleep(0.1)
    raise DrillError(f"node {node.name} did not start its agent within {timeout_s:.0f} s")


def _wait_for_port(host: str, port: int, node: LocalNode, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            raise DrillError(
                f"node {node.name} exited with {node.proc.returncode} before hosting the rendezvous:\n"
                f"{node.log()[-3000:]}"
            )
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise DrillError(f"node {node.name} did not open the rendezvous {host}:{port} within {timeout_s:.0f} s")


@dataclass
class DrillResult:
    """What the drill saw: every metrics record, when it acted, and how the nodes ended."""

    records: list[dict]
    #: (seconds since the start, what happened), e.g. (12.3, "killed node B at step 15, world 4").
    timeline: list[tuple[float, str]]
    #: exit codes of the nodes that were not killed, by name.
    exit_codes: dict[str, int]
    logs: dict[str, str]
    #: wall-clock time (``time.time()``) of the timeline's zero, to line it up with metrics records.
    started_at: float = 0.0

    def steps(self) -> list[dict]:
        return [r for r in self.records if "loss" in r]

    def events(self) -> list[dict]:
        return [r for r in self.records if "event" in r]

    def kill_step(self) -> int | None:
        """The step at which node B was killed (from the timeline)."""
        for _, what in self.timeline:
            if what.startswith("killed node B") and " at step " in what:
                return int(what.split(" at step ")[1].split(",")[0])
        return None

    def shrink_resume(self) -> dict | None:
        """The first resume event after node B was lost (which tier, which step), if any."""
        resumes = [e for e in self.events() if e.get("event") == "resume"]
        return resumes[0] if resumes else None

    def steps_lost(self) -> int | None:
        """Steps trained before node B was lost that the survivors had to train again."""
        kill, resume = self.kill_step(), self.shrink_resume()
        if kill is None or resume is None:
            return None
        before = resume["from_layout"].get("tp", 1) * resume["from_layout"]["dp"]  # the world that was lost
        trained = max(
            (r["step"] for r in self.steps() if r["world"] == before and r["time"] <= resume["time"]), default=kill
        )
        return max(0, trained - resume["step"])

    def to_json(self) -> dict:
        """Records, timeline and exit codes (the logs are files beside the run: ``drill-logs/node-*.log``)."""
        return {
            "records": self.records,
            "timeline": [list(t) for t in self.timeline],
            "exit_codes": self.exit_codes,
            "started_at": self.started_at,
        }

    @classmethod
    def from_json(cls, doc: dict, logs: dict[str, str] | None = None) -> DrillResult:
        """From :meth:`to_json` or what ``benchmarks/elastic_agents.py`` wrote (records, timeline, exit codes)."""
        return cls(
            records=doc["records"],
            timeline=[tuple(t) for t in doc["timeline"]],
            exit_codes=doc["exit_codes"],
            logs=dict(logs or {}),
            started_at=doc.get("started_at", 0.0),
        )

    def worlds(self) -> list[tuple[int, int]]:
        """``(first step, world size)`` of each stretch of training at one world size."""
        out: list[tuple[int, int]] = []
        for r in self.steps():
            if not out or out[-1][1] != r["world"]:
                out.append((r["step"], r["world"]))
        return out


def run_shrink_grow_drill(
    run_dir: str,
    train_args: Sequence[str],
    *,
    nproc: int = 2,
    kill_at_step: int = 15,
    timeout_s: float = 300.0,
    node_env: Callable[[str], dict[str, str]] | None = None,
    progress: Callable[[str], None] | None = None,
    memory_root: str | None = None,
    memory_every: int = 1,
    rdzv_conf: str = DRILL_RDZV_CONF,
) -> DrillResult:
    """Two nodes of ``nproc`` workers train ``train_args`` (which must include ``--run-dir run_dir``); node B is
    killed once the 2-node world reached ``kill_at_step`` and a checkpoint is committed; node C is started once the
    survivor trains alone; the drill returns when the run ends (raises :class:`DrillError` if it does not within
    ``timeout_s``).
    ``node_env(name)`` gives each node's extra environment (node C replaces B, so give it B's GPUs).
    With ``memory_root`` the memory tier is on (``--memory-tier --memory-every memory_every``), each node with its
    own memory directory ``memory_root/<name>`` (and ``$MOECKPT_NODE``), and killing node B deletes B's, as a real
    node loss loses its RAM. ``rdzv_conf`` replaces the drill's rendezvous settings (:data:`DRILL_RDZV_CONF`)."""
    t0, started_at = time.monotonic(), time.time()
    timeline: list[tuple[float, str]] = []

    def note(what: str) -> None:
        timeline.append((round(time.monotonic() - t0, 2), what))
        if progress is not None:
            progress(f"[{timeline[-1][0]:6.1f} s] {what}")

    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    logs = os.path.join(run_dir, "drill-logs")

    def start(name: str) -> LocalNode:
        args, env = list(train_args), node_env(name) if node_env is not None else None
        if memory_root is not None:
            args += [
                "--memory-tier",
                "--memory-every",
                str(memory_every),
                "--memory-dir",
                os.path.join(memory_root, name),
            ]
            env = {**(env or {}), "MOECKPT_NODE": name}
        return start_node(
            name,
            args,
            nproc=nproc,
            nnodes="1:2",
            endpoint=endpoint,
            log_dir=logs,
            env=env,
            host=name == "A",
            rdzv_conf=rdzv_conf,
        )

    # B first: its agent waits for A's store (a client retries its connection), so that it is ready to join
    # the first round the moment A opens it. Started the other way round, a loaded machine could close A's
    # first round (3 s of last call) before B's agent got there, and A would train alone first.
    b = start("B")
    note(f"started node B ({nproc} workers)")
    started = [b]
    try:
        _wait_for_agent(b, timeout_s=120)
        a = start("A")
        started.append(a)
        note(f"started node A ({nproc} workers), host of the rendezvous {endpoint}")
        _wait_for_port("127.0.0.1", port, a, timeout_s=120)
    except BaseException:
        for node in started:
            if node.proc.poll() is None:
                kill_node(node)
        raise
    nodes = {"A": a, "B": b}
    phase, deadline = "kill", time.monotonic() + timeout_s
    try:
        while a.proc.poll() is None:
            if time.monotonic() > deadline:
                raise DrillError(f"the drill did not finish within {timeout_s:.0f} s (waiting to {phase})")
            steps = read_metrics(run_dir)
            last = steps[-1] if steps else None
            # A node is killed only once a checkpoint is committed: a big GPU state may still be persisting at
            # kill_at_step, and then the survivors would rightly start from scratch.
            if (
                phase == "kill"
                and last
                and last["world"] == 2 * nproc
                and last["step"] >= kill_at_step
                and committed_steps(run_dir)
            ):
                kill_node(b)
                if memory_root is not None:
                    shutil.rmtree(os.path.join(memory_root, "B"), ignore_errors=True)  # its RAM is gone with it
                note(f"killed node B (agent and {nproc} workers) at step {last['step']}, world {last['world']}")
                phase = "see the survivors train alone"
                seen = len(steps)
            elif (
                phase == "see the survivors train alone"
                and last is not None
                and any(r["world"] == nproc for r in steps[seen:])
            ):
                note(f"the survivors train alone at step {last['step']}, world {last['world']}")
                nodes["C"] = start("C")
                note(f"started node C ({nproc} workers) to grow the job back")
                phase = "finish"
            time.sleep(0.2)
        note(f"node A exited with {a.proc.returncode}")
        if "C" in nodes:
            nodes["C"].proc.wait(timeout=60)
            note(f"node C exited with {nodes['C'].proc.returncode}")
    finally:
        for node in nodes.values():
            if node.proc.poll() is None:
                kill_node(node)
    return DrillResult(
        records=read_metrics(run_dir, events=True),
        timeline=timeline,
        exit_codes={n: node.proc.returncode for n, node in nodes.items() if n != "B"},
        logs={n: node.log() for n, node in nodes.items()},
        started_at=started_at,
    )


def plot_drill(result: DrillResult, path: str, title: str | None = None) -> None:
    """The drill's loss curve: one line per stretch at one world size, the resumes marked (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result.steps()
    fig, ax = plt.subplots(figsize=(9, 4))
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    colors = {w: palette[i % len(palette)] for i, w in enumerate(dict.fromkeys(r["world"] for r in steps))}
    # one line per stretch at one world size, in the order they ran (the lost steps are drawn twice)
    stretch: list[dict] = []
    for r in steps + [None]:
        if stretch and (r is None or r["world"] != stretch[-1]["world"] or r["step"] <= stretch[-1]["step"]):
            w = stretch[0]["world"]
            ax.plot(
                [s["step"] for s in stretch],
                [s["loss"] for s in stretch],
                color=colors[w],
                marker=".",
                ms=3,
                lw=1.2,
                label=f"{w} workers",
            )
            stretch = []
        if r is not None:
            stretch.append(r)
    for e in result.events():
        if e.get("event") == "resume":
            ax.axvline(e["step"] + 0.5, color="gray", ls=":", lw=1)
            ax.annotate(
                f"resume step {e['step']}\ndp {e['from_layout']['dp']} -> {e['to_layout']['dp']}",
                (e["step"] + 0.5, ax.get_ylim()[1]),
                fontsize=8,
                va="top",
                ha="left",
            )
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys())
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title or "training under torchrun elastic agents: a node lost, then a node joining")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
