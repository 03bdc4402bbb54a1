"""A real SLURM cluster on this host, for the tests: Debian's slurmctld, slurmd (one per node, two if this build
runs several on one host), slurmdbd with MariaDB for `sacct`, and munge, all installed through apt when missing
and started as root with their files under one directory.

    python tests/support/slurm.py start     # prints the SLURM_CONF to export
    python tests/support/slurm.py stop

The daemons run until `stop`; the tests start the cluster once per session and stop it at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "mariadb-server"]
HOME = Path(os.environ.get("RUNNER_SLURM_DIR", "/tmp/runner-slurm"))
CLUSTER = "runner"
PARTITION = "debug"
# Two slurmd on this host, each on its own port, as two machines would be. A job's tasks reach its first node by
# its name, so both names must resolve here: the host's own name and localhost.
NODES = (socket.gethostname(), "localhost")


class Unavailable(Exception):
    """Why the cluster cannot run on this machine."""


def install() -> None:
    """Debian's packages, through apt, when a daemon is missing."""
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "slurmdbd", "sbatch", "munged", "mariadbd")):
        return
    if os.geteuid() != 0:
        raise Unavailable("installing slurm-wlm and munge needs root (apt-get), and this process is not root")
    if not shutil.which("apt-get"):
        raise Unavailable("slurm-wlm and munge are not installed and this machine has no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "install", "-y", "-q", *PACKAGES],
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", *PACKAGES],
    ):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode == 0 and command[1] == "install":
            return
    last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    raise Unavailable(f"apt-get could not install {' '.join(PACKAGES)} (no package mirror?): {last[0]}")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def slurm_conf(ports: dict[str, int], nodes: tuple[str, ...]) -> str:
    cpus = os.cpu_count() or 1
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    node_lines = [
        f"NodeName={node} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={ports[node]} "
        f"CPUs={cpus} RealMemory={memory_mb * 9 // 10} State=UNKNOWN"
        for node in nodes
    ]
    return "\n".join(
        [
            f"ClusterName={CLUSTER}",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={ports['slurmctld']}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            # A requeued job waits until the credentials of its last run expire (120 s by default), then for the next
            # scheduling pass (up to 60 s), before it starts again.
            "AuthInfo=cred_expire=5",
            f"StateSaveLocation={HOME}/slurmctld",
            f"SlurmdSpoolDir={HOME}/slurmd/%n",
            f"SlurmctldPidFile={HOME}/slurmctld.pid",
            f"SlurmdPidFile={HOME}/slurmd.%n.pid",
            f"SlurmctldLogFile={HOME}/log/slurmctld.log",
            f"SlurmdLogFile={HOME}/log/slurmd.%n.log",
            # No cgroups here (and none needed): processes are tracked by their process group.
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "JobRequeue=1",
            # A job past its time limit is signalled and then killed without grace minutes.
            "OverTimeLimit=0",
            "KillWait=30",
            "MinJobAge=600",
            "AccountingStorageType=accounting_storage/slurmdbd",
            "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={ports['slurmdbd']}",
            *node_lines,
            f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
            "",
        ]
    )


def slurmdbd_conf(ports: dict[str, int]) -> str:
    return "\n".join(
        [
            "AuthType=auth/munge",
            "DbdHost=localhost",
            "DbdAddr=127.0.0.1",
            f"DbdPort={ports['slurmdbd']}",
            "SlurmUser=root",
            f"PidFile={HOME}/slurmdbd.pid",
            f"LogFile={HOME}/log/slurmdbd.log",
            "StorageType=accounting_storage/mysql",
            "StorageHost=127.0.0.1",
            f"StoragePort={ports['mariadb']}",
            "StorageUser=slurm",
            "StoragePass=slurm",
            "StorageLoc=slurm_acct_db",
            "",
        ]
    )


def run(*command: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment())
    if check and done.returncode != 0:
        raise Unavailable(f"{' '.join(command)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return done


def environment() -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(HOME / "slurm.conf")}


def wait_for(what: str, ready, timeout: float, log: Optional[Path] = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    tail = log.read_text().strip().splitlines()[-3:] if log and log.exists() else []
    raise Unavailable(
        f"{what} not ready after {timeout:.0f} s" + (f"; its log ends: {' | '.join(tail)}" if tail else "")
    )


def start_munged() -> None:
    """munged on its usual socket, where every SLURM client and daemon looks (slurmdbd's connections know no
    other); one already running there serves the test cluster as well."""
    if munge_answers():
        return
    key = HOME / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    run(
        "munged",
        "--force",
        f"--key-file={key}",
        f"--pid-file={HOME}/munge/munged.pid",
        f"--log-file={HOME}/log/munged.log",
        f"--seed-file={HOME}/munge/munged.seed",
    )
    wait_for("munged", munge_answers, 20, HOME / "log/munged.log")


def munge_answers() -> bool:
    credential = subprocess.run(["munge", "-n"], capture_output=True)
    return (
        credential.returncode == 0
        and subprocess.run(["unmunge"], input=credential.stdout, capture_output=True).returncode == 0
    )


def start_mariadb(port: int) -> None:
    data = HOME / "mariadb"
    run(
        "mariadb-install-db",
        "--user=root",
        f"--datadir={data}",
        "--auth-root-authentication-method=normal",
        "--skip-test-db",
        timeout=120,
    )
    subprocess.Popen(
        [
            "mariadbd",
            "--user=root",
            f"--datadir={data}",
            f"--socket={HOME}/mariadb.sock",
            f"--port={port}",
            "--bind-address=127.0.0.1",
            f"--pid-file={HOME}/mariadb.pid",
            f"--log-error={HOME}/log/mariadb.log",
            "--skip-name-resolve",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    sql = ["mariadb", f"--socket={HOME}/mariadb.sock", "-uroot"]
    wait_for("MariaDB", lambda: run(*sql, "-e", "select 1", check=False).returncode == 0, 60, HOME / "log/mariadb.log")
    run(
        *sql,
        "-e",
        "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';",
    )


def start() -> dict[str, str]:
    """Starts the cluster (after `stop` of any earlier one); returns the environment its clients need."""
    install()
    if os.geteuid() != 0:
        raise Unavailable("slurmd runs jobs as their users and munged as its own: the test cluster needs root")
    stop()
    shutil.rmtree(HOME, ignore_errors=True)
    for directory in ("munge", "slurmctld", "slurmd", "log"):
        (HOME / directory).mkdir(parents=True)
    nodes = NODES if NODES[0] != NODES[1] else NODES[:1]  # a host named localhost has one name for both
    ports = dict(zip(("slurmctld", "slurmdbd", "mariadb", *nodes), free_ports(3 + len(nodes))))
    (HOME / "slurm.conf").write_text(slurm_conf(ports, nodes))
    dbd_conf = HOME / "slurmdbd.conf"
    dbd_conf.write_text(slurmdbd_conf(ports))
    dbd_conf.chmod(0o600)

    start_munged()
    start_mariadb(ports["mariadb"])
    run("slurmdbd")  # reads slurmdbd.conf beside $SLURM_CONF
    wait_for(
        "slurmdbd",
        lambda: run("sacctmgr", "-n", "list", "cluster", check=False).returncode == 0,
        60,
        HOME / "log/slurmdbd.log",
    )
    run("sacctmgr", "-i", "add", "cluster", CLUSTER)
    run("slurmctld", "-f", str(HOME / "slurm.conf"))
    for node in nodes:
        run("slurmd", "-f", str(HOME / "slurm.conf"), "-N", node)
    wait_for(
        f"the nodes {','.join(nodes)} (sinfo idle)", lambda: idle_nodes() == set(nodes), 90, HOME / "log/slurmctld.log"
    )
    return {"SLURM_CONF": str(HOME / "slurm.conf")}


def idle_nodes() -> set[str]:
    done = run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=20)
    return {line.split()[0] for line in done.stdout.splitlines() if line.split()[1:] == ["idle"]}


def stop() -> None:
    """Stops whatever an earlier `start` left running: its jobs, then the daemons by their pid files."""
    # scancel waits for an answer from slurmctld; one that an earlier session left dead would take 18 s to fail.
    if controller_alive() and run("scancel", "--partition", PARTITION, check=False).returncode == 0:
        try:
            wait_for("the jobs to end", lambda: not run("squeue", "-h", check=False).stdout.strip(), 60)
        except Unavailable:
            pass  # their processes go with the daemons below
    for pid_file in sorted(HOME.glob("*.pid")) + sorted(HOME.glob("munge/*.pid")):
        try:
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, signal.SIGTERM)
        except (ValueError, IndexError, ProcessLookupError, PermissionError):
            continue
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def controller_alive() -> bool:
    try:
        return (HOME / "slurm.conf").exists() and _alive(int((HOME / "slurmctld.pid").read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


if __name__ == "__main__":
    action = sys.argv[1] if len(sys.argv) > 1 else "start"
    try:
        if action == "start":
            print(f"export SLURM_CONF={start()['SLURM_CONF']}")
        elif action == "stop":
            stop()
        else:
            sys.exit(f"usage: {sys.argv[0]} start|stop")
    except Unavailable as reason:
        sys.exit(f"slurm cluster: {reason}")
