"""A real small cluster on this machine: SSH hosts in network namespaces.

Each cluster gets its own private subnet 10.213.N.0/24 (N = a free number
1..254 picked under a lock; ANVIL_TESTNET_PREFIX overrides "10.213").
10.213.0.0/16 is reserved for these test clusters and nothing else: only
addresses inside namespaces that the cluster itself created are ever used.

    root namespace  bridge anvbrN, address 10.213.N.1  (where `inv -H` runs)
    host i          namespace anvN-hI, interface eth0 (node1) or enp<i>s0, address 10.213.N.(10+i),
                    its own UTS namespace (hostname nodeI) and its own sshd, which sees the
                    cluster's hosts file as /etc/hosts (/etc/netns/anvN-hI/hosts: ip netns exec
                    binds it there), so every host has a name on every host
    down host j     namespace anvN-dJ with an address but no sshd: connecting
                    is refused at once, as for a node whose sshd is dead

sshd runs with a config of our own (key-only root login, authorized_keys and
host key in the cluster's directory, never ~/.ssh). All namespaces share the
file system, like a cluster with a shared home: a remote command can run this
same checkout.

Cleanup stops exactly the processes this cluster started (pid files, then the
pids `ip netns pids` lists in our namespaces), deletes the namespaces and the
bridge. A state file /run/anvil-testnet/N.json names the owner process; a
later cluster removes leftovers whose owner is gone (a crashed run), and never
touches a live owner's, so parallel runs do not collide.

With slurm=True the up hosts are also the compute nodes of a real Slurm
cluster (Debian's slurmctld, slurmd, slurm-client and munge):

    munged          our own (never the system's /run/munge): socket
                    /run/anvil-testnet/munge-N/munge.socket (munged wants every
                    directory above it searchable), key, pid, log and seed file
                    in the cluster's directory, a key made for this cluster
    slurmctld       root namespace, SlurmctldHost=<hostname>(10.213.N.1),
                    port 16800 + 2N (slurmd: 16801 + 2N), state in the directory
    slurmd nodeI    in host i's network namespace, started with nsenter --net
                    (`ip netns exec` remounts /sys and breaks slurmd) plus its
                    own UTS and mount namespace: hostname nodeI, and the
                    cluster's hosts file bind-mounted on /etc/hosts, so node1,
                    node2, ... resolve on every node (torchrun's master address)
                    without touching the machine's /etc/hosts; job steps inherit
                    all of it; spool in /run/anvil-testnet/slurmd-N/nodeI (job
                    steps' Unix sockets live there: a path must fit in 108 bytes)
    slurm.conf      <workdir>/slurm/slurm.conf: linuxproc/task none, no cgroups,
                    no accounting (no sacct), no --cpu-bind, short timeouts,
                    partition debug. Clients need only SLURM_CONF=<that file>
                    (cluster.slurm_env()); AuthInfo in it points them at our
                    munged. A requeued job starts again after cred_expire (10 s).

Use from Python (tests/conftest.py has the pytest fixtures):

    with Cluster.start(workdir, n_hosts=2, n_down=1) as cluster:
        cluster.ssh(cluster.hosts[0], "hostname")

    with Cluster.start(workdir, n_hosts=2, n_down=0, slurm=True) as cluster:
        cluster.slurm_run("srun", "-N2", "hostname")       # env: cluster.slurm_env()
        cluster.kill_node(cluster.hosts[1]); cluster.restart_node(cluster.hosts[1])

or by hand:  python tests/helpers/cluster.py up [--hosts 2] [--down 1]
             python tests/helpers/cluster.py up --slurm [--nodes 2]
             python tests/helpers/cluster.py down N      (or: down --stale)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATE_DIR = Path("/run/anvil-testnet")
NETNS_ETC = Path("/etc/netns")   # /etc/netns/<ns>/hosts: ip netns exec binds it on /etc/hosts
SSHD = "/usr/sbin/sshd"
PREFIX = os.environ.get("ANVIL_TESTNET_PREFIX", "10.213")
SSH_PORT = 22
FIRST_HOST_OCTET = 10
SLURM_PORT_BASE = 16800      # cluster N: slurmctld 16800 + 2N, slurmd 16801 + 2N
SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol", "scancel",
               "squeue", "munged")


class ClusterUnavailable(RuntimeError):
    """This machine cannot build namespace hosts (not root, no ip/sshd, ...)."""


class ClusterError(RuntimeError):
    """Building or stopping the cluster failed."""


def missing_prerequisites(slurm: bool = False) -> str | None:
    """Why namespace hosts (and with slurm=True a Slurm cluster on them) cannot be
    built here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns, sshd" + (", slurmd" if slurm else "") + ")"
    if slurm:
        for tool in SLURM_TOOLS + ("nsenter", "mount"):
            if _which(tool) is None:
                return (f"`{tool}` not found (apt-get install slurmctld slurmd slurm-client "
                        "munge util-linux mount)")
    for tool in ("ip", "ssh-keygen", "ssh", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install iproute2 openssh-client util-linux)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not found (apt-get install openssh-server)"
    probe = f"anvprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclasses.dataclass
class Host:
    name: str        # hostname inside the namespace (node1, ...)
    address: str     # reachable from the root namespace
    netns: str
    veth: str        # bridge-side end, in the root namespace
    up: bool         # runs sshd
    pidfile: str = ""
    slurmd_pidfile: str = ""   # slurm clusters: this node's slurmd
    iface: str = "eth0"        # its interface: eth0 on node1, enp<i>s0 on the others (as on mixed
                               # hardware), so values computed on the wrong node show

    def __str__(self) -> str:
        return self.address


@dataclasses.dataclass
class Cluster:
    number: int
    bridge: str
    bridge_address: str
    hosts: list[Host]
    down_hosts: list[Host]
    workdir: str
    key_file: str
    user: str = "root"
    owner_pid: int = 0
    owner_start: str = ""
    # Slurm (slurm=True); paths under workdir/slurm, see _slurm_path().
    slurm: bool = False
    slurmctld_port: int = 0
    slurmd_port: int = 0
    slurm_settings: dict = dataclasses.field(default_factory=dict)   # slurm.conf overrides
    # daemons we started: name -> [pid, start time] (stopped only while both match)
    daemons: dict = dataclasses.field(default_factory=dict)

    # ---- life cycle -----------------------------------------------------------------

    @classmethod
    def start(cls, workdir: str | Path, n_hosts: int = 2, n_down: int = 1,
              slurm: bool = False, slurm_settings: dict | None = None) -> "Cluster":
        """Build the hosts; with slurm=True also munged, slurmctld and one slurmd per
        up host, and return once every node is idle. slurm_settings: slurm.conf
        keys to set or override, e.g. {"SlurmdTimeout": 4, "MessageTimeout": 2}
        for a node failure noticed in seconds."""
        reason = missing_prerequisites(slurm=slurm)
        if reason:
            raise ClusterUnavailable(reason)
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        remove_stale()
        with _lock():
            number = _free_number()
            cluster = cls._plan(number, workdir, n_hosts, n_down)
            if slurm:
                cluster.slurm = True
                cluster.slurm_settings = dict(slurm_settings or {})
                cluster.slurmctld_port, cluster.slurmd_port = _free_port_pair(number)
                for host in cluster.hosts:
                    host.slurmd_pidfile = cluster._slurm_path(f"slurmd-{host.name}.pid")
            cluster._save()           # before creating anything: a crash leaves a record
            try:
                cluster._make_bridge()  # claims the subnet while we hold the lock
            except Exception:
                cluster.stop()
                raise
        try:
            cluster._make_keys()
            for host in cluster.hosts + cluster.down_hosts:
                cluster._make_host(host)
            for host in cluster.hosts:
                cluster._start_sshd(host)
            for host in cluster.hosts:
                _wait_for_ssh(host.address, workdir / f"sshd-{host.name}.log")
            if slurm:
                cluster._start_slurm()
        except BaseException:         # Ctrl-C while starting cleans up too
            cluster.stop()
            raise
        return cluster

    @classmethod
    def _plan(cls, number: int, workdir: Path, n_hosts: int, n_down: int) -> "Cluster":
        if n_hosts + n_down > 200:
            raise ClusterError("at most 200 hosts per cluster")
        net = f"{PREFIX}.{number}"

        def host(i: int, kind: str, up: bool) -> Host:
            index = i if up else n_hosts + i
            return Host(name=f"node{index}", address=f"{net}.{FIRST_HOST_OCTET + index}",
                        netns=f"anv{number}-{kind}{i}", veth=f"anv{number}{kind}{i}", up=up,
                        iface="eth0" if index == 1 else f"enp{index}s0",
                        pidfile=str(workdir / f"sshd-node{index}.pid") if up else "")

        return cls(number=number, bridge=f"anvbr{number}", bridge_address=f"{net}.1",
                   hosts=[host(i, "h", True) for i in range(1, n_hosts + 1)],
                   down_hosts=[host(j, "d", False) for j in range(1, n_down + 1)],
                   workdir=str(workdir), key_file=str(workdir / "id_ed25519"),
                   owner_pid=os.getpid(), owner_start=_process_start(os.getpid()))

    def stop(self) -> None:
        """Stop our sshds and whatever still runs in our namespaces, delete the network.
        A Slurm cluster: cancel its jobs, stop slurmd, slurmctld and munged first."""
        problems = []
        if self.slurm:
            self._stop_slurm()
        for host in self.hosts:
            _stop_pidfile(host.pidfile, expect=SSHD)
        for host in self.hosts + self.down_hosts:
            for pid in _netns_pids(host.netns):
                _stop_pid(pid)
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.veth, check=False)     # gone with the namespace, normally
            shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)   # its hosts file (_start_sshd)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()      # only when no other cluster's namespace has a folder there
        _ip("link", "del", self.bridge, check=False)
        left = {line.split()[0] for line in _ip("netns", "list", check=False).splitlines() if line}
        for name in [h.netns for h in self.hosts + self.down_hosts]:
            if name in left:
                problems.append(f"namespace {name} still exists")
        if Path(f"/sys/class/net/{self.bridge}").exists():
            problems.append(f"bridge {self.bridge} still exists")
        if problems:
            raise ClusterError("cleanup incomplete: " + "; ".join(problems))
        with contextlib.suppress(FileNotFoundError):
            self._state_file().unlink()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- using it ---------------------------------------------------------------------

    @property
    def all_hosts(self) -> list[Host]:
        return self.hosts + self.down_hosts

    def ssh_argv(self, host: Host | str, command: str) -> list[str]:
        address = host.address if isinstance(host, Host) else host
        return ["ssh", "-i", self.key_file, "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5",
                f"{self.user}@{address}", command]

    def ssh(self, host: Host | str, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run `command` on `host` with the OpenSSH client (stdin closed)."""
        return subprocess.run(self.ssh_argv(host, command), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def invoke_yaml(self, checkout: str | Path, connect_timeout: int = 5) -> str:
        """Runner settings (invoke.yaml `anvil:` block) to reach these hosts."""
        checkout = Path(checkout).resolve()
        settings = {"anvil": {"user": self.user, "key_filename": self.key_file,
                              "remote_path": str(checkout),
                              "remote_inv": str(checkout / ".venv" / "bin" / "inv"),
                              "connect_timeout": connect_timeout}}
        return json.dumps(settings, indent=2)   # JSON is YAML

    # ---- using Slurm --------------------------------------------------------------------

    def slurm_env(self) -> dict[str, str]:
        """What a child process needs in its environment to use this cluster's Slurm
        (srun, sbatch, salloc, sinfo, scontrol, ...): merge it into os.environ.
        Jobs inherit it (sbatch/srun --export=ALL is the default)."""
        if not self.slurm:
            raise ClusterError("not a Slurm cluster (start it with slurm=True)")
        return {"SLURM_CONF": self.slurm_conf}

    @property
    def slurm_conf(self) -> str:
        return self._slurm_path("slurm.conf")

    @property
    def node_names(self) -> list[str]:
        return [host.name for host in self.hosts]

    def slurm_run(self, *argv: str, timeout: float = 60, check: bool = False,
                  cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """Run a Slurm client command (from the root namespace) against this cluster."""
        env = {**os.environ, **self.slurm_env()}
        for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del env[key]       # a job's own variables would redirect srun/sbatch
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=env,
                              timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd)
        if check and proc.returncode != 0:
            raise ClusterError(f"{' '.join(argv)}: exit {proc.returncode}: "
                               f"{proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def node_states(self) -> dict[str, str]:
        """sinfo's compact state per node: 'idle', 'alloc', 'idle*' (not responding),
        'down*', ... ({} when slurmctld does not answer)."""
        proc = self.slurm_run("sinfo", "-N", "-h", "-o", "%N %t", timeout=30)
        states = {}
        for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
            name, _, state = line.strip().partition(" ")
            states[name] = state.strip()
        return states

    def wait_for_nodes(self, names: list[str] | None = None, states: tuple[str, ...] = ("idle",),
                       timeout: float = 30) -> dict[str, str]:
        """Wait until every named node (default: all) shows one of `states` in sinfo."""
        names = self.node_names if names is None else names
        deadline = time.monotonic() + timeout
        seen: dict[str, str] = {}
        while True:
            seen = self.node_states()
            if all(seen.get(name) in states for name in names):
                return seen
            if time.monotonic() > deadline:
                raise ClusterError(f"Slurm nodes not {'/'.join(states)} after {timeout:.0f} s: "
                                   f"sinfo says {seen or '(nothing: slurmctld not answering)'}\n"
                                   + self._slurm_log_tails())
            time.sleep(0.25)

    def kill_node(self, host: Host | str, sig: int = signal.SIGKILL) -> None:
        """Node failure: kill this node's slurmd and every job process in its namespace
        (by pid; its sshd stays). slurmctld notices on its next ping: the node shows
        'not responding' (state with '*'), then DOWN after SlurmdTimeout."""
        host = self._slurm_host(host)
        keep = _descendants(_pidfile_pid(host.pidfile, expect=SSHD))
        victims = [pid for pid in _netns_pids(host.netns) if pid not in keep]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        for pid in victims:
            _stop_pid(pid)            # SIGTERM was not enough: SIGKILL after a grace
        self.daemons.pop(f"slurmd-{host.name}", None)
        self._save()

    def restart_node(self, host: Host | str, timeout: float = 30) -> None:
        """Start a killed node's slurmd again and wait until the node is idle
        (ReturnToService=2: a DOWN node comes back when it registers)."""
        host = self._slurm_host(host)
        self._start_slurmd(host)
        self.wait_for_nodes([host.name], timeout=timeout)

    def node_tmpfs(self, host: Host | str, target: str, size: str | None) -> None:
        """Mount a tmpfs of `size` (e.g. "1m") over `target` in the node's own mount namespace
        (its slurmd's, which job steps inherit): a misconfigured node, such as a container
        default /dev/shm. size=None unmounts it again."""
        host = self._slurm_host(host)
        pid = self.daemons[f"slurmd-{host.name}"][0]
        command = (["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", target] if size
                   else ["umount", target])
        done = subprocess.run(["nsenter", f"--target={pid}", "--mount", *command], capture_output=True,
                              text=True, timeout=30)
        if done.returncode != 0:
            raise ClusterError(f"{' '.join(command)} on {host.name}: {done.stderr.strip()}")

    def slow_link(self, host: Host | str, delay_ms: float | None, rate: str | None = None) -> str:
        """Make one host's link slow, as a bad cable or NIC would: `tc qdisc add dev <its bridge-side
        veth> root netem delay <delay_ms>ms` (everything sent to the host waits; every path to it is
        slow). rate="100mbit" shapes it instead (tbf; with delay_ms too: netem ... rate), for
        kernels without sch_netem. slow_link(host, None) removes it. Returns the qdisc set ('')."""
        found = next((h for h in self.all_hosts if host in (h, h.name, h.address)), None)
        if found is None:
            raise ClusterError(f"no host {host} in cluster {self.number}")
        host = found
        subprocess.run(["tc", "qdisc", "del", "dev", host.veth, "root"], capture_output=True,
                       stdin=subprocess.DEVNULL)            # none there yet: nothing to remove
        if delay_ms is None and rate is None:
            return ""
        if delay_ms is not None:
            qdisc = ["netem", "delay", f"{delay_ms:g}ms"] + (["rate", rate] if rate else [])
        else:
            qdisc = ["tbf", "rate", rate, "burst", "64kb", "latency", "200ms"]
        done = subprocess.run(["tc", "qdisc", "add", "dev", host.veth, "root", *qdisc], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            hint = " (this kernel has no sch_netem: pass rate= instead)" if qdisc[0] == "netem" else ""
            raise ClusterError(f"tc qdisc add dev {host.veth} root {' '.join(qdisc)}: "
                               f"{done.stderr.strip()}{hint}")
        return " ".join(qdisc)

    def _slurm_host(self, host: Host | str) -> Host:
        if not self.slurm:
            raise ClusterError("not a Slurm cluster (start it with slurm=True)")
        for candidate in self.hosts:
            if host in (candidate, candidate.name, candidate.address):
                return candidate
        raise ClusterError(f"no Slurm node {host} in cluster {self.number}")

    # ---- building ---------------------------------------------------------------------

    def _make_bridge(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def _make_keys(self) -> None:
        work = Path(self.workdir)
        for key in (self.key_file, str(work / "ssh_host_ed25519_key")):
            for path in (key, key + ".pub"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                            f"anvil-testnet-{self.number}", "-f", key],
                           check=True, capture_output=True, stdin=subprocess.DEVNULL)
        shutil.copy(self.key_file + ".pub", work / "authorized_keys")
        (work / "sshd_config").write_text(_SSHD_CONFIG.format(work=work))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)   # sshd's privilege-separation dir

    def _make_host(self, host: Host) -> None:
        peer = host.veth + "p"
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", host.netns)
        _ip("link", "set", host.veth, "master", self.bridge)
        _ip("link", "set", host.veth, "up")
        inside = ["-n", host.netns]
        _ip(*inside, "link", "set", peer, "name", host.iface)
        _ip(*inside, "addr", "add", f"{host.address}/24", "dev", host.iface)
        _ip(*inside, "link", "set", host.iface, "up")
        _ip(*inside, "link", "set", "lo", "up")
        # No default route: the hosts reach each other and the bridge, nothing else.

    def _start_sshd(self, host: Host) -> None:
        work = Path(self.workdir)
        # ip netns exec binds /etc/netns/<ns>/* over /etc/*: sshd and its sessions see the cluster's hosts file.
        netns_etc = NETNS_ETC / host.netns
        netns_etc.mkdir(parents=True, exist_ok=True)
        (netns_etc / "hosts").write_text(self._hosts_file())
        sshd = [SSHD, "-f", str(work / "sshd_config"), "-o", f"ListenAddress={host.address}",
                "-o", f"PidFile={host.pidfile}", "-E", str(work / f"sshd-{host.name}.log")]
        # unshare -u: each host has its own hostname, as real nodes do.
        inner = f"hostname {host.name} && exec " + " ".join(sshd)
        started = subprocess.run(["ip", "netns", "exec", host.netns, "unshare", "-u",
                                  "sh", "-c", inner], capture_output=True, text=True,
                                 stdin=subprocess.DEVNULL, timeout=30)
        if started.returncode != 0:
            raise ClusterError(f"sshd for {host.name} ({host.address}) did not start: "
                               f"{started.stderr.strip() or started.stdout.strip()}")

    # ---- Slurm ------------------------------------------------------------------------

    def _slurm_path(self, name: str) -> str:
        return str(Path(self.workdir) / "slurm" / name)

    @property
    def munge_socket(self) -> str:
        return str(STATE_DIR / f"munge-{self.number}" / "munge.socket")

    @property
    def slurmd_spool(self) -> Path:
        """The nodes' spool directories (one per node inside): job steps make their Unix sockets
        there, whose paths may not exceed 108 bytes, so not under a test's tmp_path (pytest-xdist's
        add a worker folder: `.../popen-gw0/test_<name>0/cluster/slurm/spool-node2/node2_1.4294967291`
        did not fit, and the batch job failed to launch)."""
        return STATE_DIR / f"slurmd-{self.number}"

    def _start_slurm(self) -> None:
        Path(self._slurm_path("state")).mkdir(parents=True, exist_ok=True)
        for host in self.hosts:
            (self.slurmd_spool / host.name).mkdir(parents=True, exist_ok=True)
        self._start_munged()
        Path(self._slurm_path("hosts")).write_text(self._hosts_file())
        Path(self.slurm_conf).write_text(self._slurm_conf_text())
        env = {**os.environ, **self.slurm_env()}
        started = subprocess.run([_which("slurmctld"), "-i", "-f", self.slurm_conf],
                                 capture_output=True, text=True, env=env,
                                 stdin=subprocess.DEVNULL, timeout=30)
        if started.returncode != 0:
            raise ClusterError(f"slurmctld did not start: {started.stderr.strip()}\n"
                               + self._slurm_log_tails())
        self._record("slurmctld", self._slurm_path("slurmctld.pid"), "slurmctld")
        for host in self.hosts:
            self._start_slurmd(host)
        self.wait_for_nodes(timeout=30)

    def _start_munged(self) -> None:
        """Our own munged: own key, socket, pid, log and seed file (never the system's)."""
        key = Path(self._slurm_path("munge.key"))
        with contextlib.suppress(FileNotFoundError):
            key.unlink()
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(1024))
        # munged runs as root here, and it insists that the key belongs to the user
        # it runs as: root, mode 0400 (a munge-owned key is refused as insecure).
        # Its socket's directory must be searchable by all (pytest's tmp dirs are
        # 0700): it goes in /run/anvil-testnet/munge-N.
        sockdir = Path(self.munge_socket).parent
        STATE_DIR.chmod(STATE_DIR.stat().st_mode | 0o755)
        sockdir.mkdir(mode=0o755, exist_ok=True)
        sockdir.chmod(0o755)
        started = subprocess.run(
            [_which("munged"), f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={self._slurm_path('munged.pid')}",
             f"--log-file={self._slurm_path('munged.log')}",
             f"--seed-file={self._slurm_path('munged.seed')}"],
            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
        if started.returncode != 0:
            raise ClusterError(f"munged did not start: {started.stderr.strip()}")
        self._record("munged", self._slurm_path("munged.pid"), "munged")

    def _start_slurmd(self, host: Host) -> None:
        # nsenter --net, not `ip netns exec` (that remounts /sys: slurmd breaks).
        # unshare -u -m: the node's hostname, and the cluster's hosts file on
        # /etc/hosts in a private mount namespace that the job steps inherit.
        q = shlex.quote
        inner = (f"hostname {host.name} && mount --bind {q(self._slurm_path('hosts'))} /etc/hosts"
                 f" && exec {q(_which('slurmd'))} -N {host.name} -f {q(self.slurm_conf)}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(host.slurmd_pidfile)
        started = subprocess.run(["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "-u",
                                  "-m", "sh", "-c", inner], capture_output=True, text=True,
                                 env={**os.environ, **self.slurm_env()},
                                 stdin=subprocess.DEVNULL, timeout=30)
        if started.returncode != 0:
            raise ClusterError(f"slurmd for {host.name} ({host.address}) did not start: "
                               f"{started.stderr.strip() or started.stdout.strip()}\n"
                               + self._slurm_log_tails())
        self._record(f"slurmd-{host.name}", host.slurmd_pidfile, "slurmd")

    def _record(self, name: str, pidfile: str, expect: str, timeout: float = 10) -> None:
        """Note the daemon's pid and start time in the state file (so stale-cluster
        removal finds it even without its pid file)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = _pidfile_pid(pidfile, expect=_which(expect) or expect)
            if pid:
                self.daemons[name] = [pid, _process_start(pid)]
                self._save()
                return
            time.sleep(0.05)
        raise ClusterError(f"{name} wrote no pid file {pidfile} within {timeout:.0f} s\n"
                           + self._slurm_log_tails())

    def _stop_slurm(self) -> None:
        conf = Path(self.slurm_conf)
        if conf.exists() and self._daemon_alive("slurmctld"):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                jobs = self.slurm_run("squeue", "-h", "-o", "%A", timeout=10).stdout.split()
                if jobs:
                    self.slurm_run("scancel", *jobs, timeout=10)
        for host in self.hosts:
            _stop_pidfile(host.slurmd_pidfile, expect=_which("slurmd") or "slurmd")
        # slurmctld's helper (slurmscriptd) lives in the root namespace too: the netns
        # sweep would not find it if slurmctld had to be killed.
        ctld = _pidfile_pid(self._slurm_path("slurmctld.pid"), expect=_which("slurmctld") or "slurmctld")
        helpers = {pid: _process_start(pid) for pid in _descendants(ctld) - {ctld}}
        _stop_pidfile(self._slurm_path("slurmctld.pid"), expect=_which("slurmctld") or "slurmctld")
        for pid, start in helpers.items():
            if start and _process_start(pid) == start:
                _stop_pid(pid)
        _stop_pidfile(self._slurm_path("munged.pid"), expect=_which("munged") or "munged")
        for name in list(self.daemons):      # pid files gone (workdir removed): by record
            if self._daemon_alive(name):
                _stop_pid(self.daemons[name][0])
        shutil.rmtree(Path(self.munge_socket).parent, ignore_errors=True)
        shutil.rmtree(self.slurmd_spool, ignore_errors=True)

    def _daemon_alive(self, name: str) -> bool:
        pid, start = (self.daemons.get(name) or [0, ""])
        return bool(pid) and _process_start(pid) == start

    def _hosts_file(self) -> str:
        """/etc/hosts as the hosts see it (the Slurm nodes' bind mount, the SSH hosts' /etc/netns/<ns>/hosts):
        the node names, and the controller. Each address also in its IPv4-mapped IPv6 form: torch's c10d
        connects to the master over a dual-stack socket (::ffff:10.213.N.11) and names the peer with
        getnameinfo, which looks a mapped address up as IPv6. The namespaces reach no DNS server, so a
        name not here fails at once ('[c10d] The hostname of the client socket cannot be retrieved.
        err=-3', once per rank of every multi-node run)."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
                 f"# anvil-testnet {self.number}: its hosts (bind-mounted on the hosts' /etc/hosts)"]
        named = [(host.address, host.name) for host in self.hosts] + [(self.bridge_address, _short_hostname())]
        lines += [f"{address}\t{name}" for address, name in named]
        lines += [f"::ffff:{address}\t{name}" for address, name in named]
        return "\n".join(lines) + "\n"

    def _slurm_conf_text(self) -> str:
        cpus = os.cpu_count() or 1
        memory = max(256, _mem_total_mb() // max(1, len(self.hosts)))
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.address} NodeHostname={h.name} "
                          f"CPUs={cpus} RealMemory={memory} State=UNKNOWN" for h in self.hosts)
        text = _SLURM_CONF.format(
            number=self.number, ctld_host=_short_hostname(), ctld_addr=self.bridge_address,
            ctld_port=self.slurmctld_port, slurmd_port=self.slurmd_port,
            slurm=Path(self._slurm_path("")), spool=self.slurmd_spool, socket=self.munge_socket,
            nodes=nodes)
        for key, value in self.slurm_settings.items():
            line = f"{key}={value}"
            text, found = re.subn(rf"^{re.escape(key)}=.*$", lambda _: line, text, flags=re.M | re.I)
            if not found:
                text = text.replace("\nNodeName=", f"\n{line}\nNodeName=", 1)
        return text

    def _slurm_log_tails(self, chars: int = 1500) -> str:
        parts = []
        for name in ["slurmctld.log"] + [f"slurmd-{h.name}.log" for h in self.hosts] + ["munged.log"]:
            path = Path(self._slurm_path(name))
            if path.exists():
                parts.append(f"--- {path} (tail)\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts) or "(no Slurm logs)"

    # ---- state ----------------------------------------------------------------------

    def _state_file(self) -> Path:
        return STATE_DIR / f"{self.number}.json"

    def _save(self) -> None:
        tmp = self._state_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, self._state_file())

    @classmethod
    def load(cls, state_file: Path) -> "Cluster":
        data = json.loads(state_file.read_text())
        data["hosts"] = [Host(**h) for h in data["hosts"]]
        data["down_hosts"] = [Host(**h) for h in data["down_hosts"]]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def owner_alive(self) -> bool:
        return bool(self.owner_pid) and _process_start(self.owner_pid) == self.owner_start


_SSHD_CONFIG = """\
# Test sshd for a namespace host; ListenAddress and PidFile come on the command line.
Port 22
HostKey {work}/ssh_host_ed25519_key
AuthorizedKeysFile {work}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The work directory lives under /tmp; key files there are ours.
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
# Fan-out tests open many sessions at once.
MaxStartups 100
MaxSessions 100
LogLevel VERBOSE
Subsystem sftp internal-sftp
"""


# Slurm 22.05 without systemd or cgroups: processes tracked through /proc, no task
# binding (so no --cpu-bind), no accounting (no sacct). Everything in {slurm}.
_SLURM_CONF = """\
# anvil-testnet cluster {number} (tests/helpers/cluster.py): one machine, nodes in network namespaces.
ClusterName=anvil{number}
SlurmctldHost={ctld_host}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# Our munged's socket, for daemons and clients alike. cred_expire also sets how long
# a requeued job waits before it starts again (default 120 s; 5 is the minimum).
AuthInfo=socket={socket},cred_expire=10
StateSaveLocation={slurm}/state
SlurmctldPidFile={slurm}/slurmctld.pid
SlurmctldLogFile={slurm}/slurmctld.log
SlurmdSpoolDir={spool}/%n
SlurmdPidFile={slurm}/slurmd-%n.pid
SlurmdLogFile={slurm}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=5
MessageTimeout=10
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=debug Default=YES Nodes=ALL MaxTime=INFINITE State=UP
"""


# ---- helpers ----------------------------------------------------------------------------


def _which(tool: str) -> str | None:
    """Also looks in the sbin directories (not on every user's PATH)."""
    return shutil.which(tool) or shutil.which(tool, path="/usr/local/sbin:/usr/sbin:/sbin")


def _short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def _mem_total_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As slurmctld binds: a port a previous cluster left in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _free_port_pair(number: int) -> tuple[int, int]:
    """slurmctld's port (root namespace, must be free there) and slurmd's (inside the
    node namespaces): 16800 + 2N and the next one, else the first free pair above."""
    for port in [SLURM_PORT_BASE + 2 * number] + list(range(SLURM_PORT_BASE + 512, 18000, 2)):
        if _port_free(port):
            return port, port + 1
    raise ClusterError("no free TCP port pair for slurmctld/slurmd")


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


@contextlib.contextmanager
def _lock():
    with open(STATE_DIR / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _free_number() -> int:
    """A subnet number no interface, route or state file of this machine uses."""
    used_text = _ip("-4", "-o", "addr", "show", check=False) + _ip("-4", "route", "show", "table", "all", check=False)
    links = _ip("-o", "link", "show", check=False)
    for n in range(1, 255):
        if (STATE_DIR / f"{n}.json").exists():
            continue
        if f"{PREFIX}.{n}." in used_text or f" anvbr{n}:" in links or f" anvbr{n}@" in links:
            continue
        return n
    raise ClusterError(f"no free subnet left in {PREFIX}.0.0/16 (see {STATE_DIR})")


def _process_start(pid: int) -> str:
    """Start time of `pid` in clock ticks ('' if it is gone): pid + start = identity."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[1].split()
    return "" if fields[0] in ("Z", "X") else fields[19]   # a zombie is gone too


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _stop_pid(pid: int, grace: float = 5.0) -> None:
    if pid <= 1 or pid == os.getpid():
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not _process_start(pid):
                return
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)


def _pidfile_pid(pidfile: str, expect: str) -> int:
    """The pid a pid file names if that process still is the program `expect`, else 0."""
    if not pidfile:
        return 0
    try:
        pid = int(Path(pidfile).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    argv = _cmdline(pid)
    return pid if argv and argv[0].startswith(expect) else 0   # a recycled pid is someone else's


def _stop_pidfile(pidfile: str, expect: str) -> None:
    """Stop the process a pid file names, if it still is the program we started."""
    pid = _pidfile_pid(pidfile, expect)
    if pid:
        _stop_pid(pid)


def _descendants(root: int) -> set[int]:
    """`root` and every process below it (empty for 0)."""
    if not root:
        return set()
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


def _netns_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def trainer_pids(netns: str) -> list[int]:
    """The ranks (python -m trainer, not their agent) running in one host's network namespace."""
    return [pid for pid in _netns_pids(netns) if _cmdline(pid)[1:3] == ["-m", "trainer"]]


def kill_trainers(netns: str) -> float:
    """SIGKILL every rank of one host at once, as a lost node; the time.monotonic() of the kill."""
    victims = trainer_pids(netns)
    assert victims, f"no trainer processes found in {netns}"
    killed = time.monotonic()
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    return killed


def _wait_for_ssh(address: str, log: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, SSH_PORT), timeout=2) as conn:
                conn.settimeout(2)
                if conn.recv(64).startswith(b"SSH-"):
                    return
        except OSError as exc:
            last = exc
        time.sleep(0.1)
    tail = log.read_text()[-800:] if log.exists() else "(no sshd log)"
    raise ClusterError(f"sshd at {address}:{SSH_PORT} not answering after {timeout:.0f} s "
                       f"({last}); sshd log:\n{tail}")


def remove_stale() -> list[int]:
    """Tear down clusters whose owner process is gone; returns their numbers."""
    removed = []
    if not STATE_DIR.exists():
        return removed
    for state_file in sorted(STATE_DIR.glob("*.json")):
        try:
            cluster = Cluster.load(state_file)
        except (OSError, ValueError, TypeError):
            continue
        if not cluster.owner_alive():
            try:
                cluster.stop()
            except ClusterError as exc:   # keep its state file: the number stays taken
                print(f"cluster: stale cluster {cluster.number}: {exc}", file=sys.stderr)
                continue
            removed.append(cluster.number)
    return removed


# ---- by hand ------------------------------------------------------------------------------


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tests/helpers/cluster.py",
                                     description="Namespace SSH hosts (and Slurm) for trying `inv -H` by hand.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster and keep it until Ctrl-C")
    up.add_argument("--hosts", "--nodes", dest="hosts", type=int, default=2)
    up.add_argument("--down", type=int, default=None, help="hosts without sshd (default 1; "
                    "0 with --slurm)")
    up.add_argument("--slurm", action="store_true",
                    help="also run Slurm (munged, slurmctld, a slurmd per host)")
    down = sub.add_parser("down", help="remove a cluster by number, or every stale one")
    down.add_argument("number", nargs="?", type=int)
    down.add_argument("--stale", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "down":
            if args.stale or args.number is None:
                print("removed:", remove_stale() or "nothing")
            else:
                Cluster.load(STATE_DIR / f"{args.number}.json").stop()
            return 0
        if args.down is None:
            args.down = 0 if args.slurm else 1
        workdir = tempfile.mkdtemp(prefix="anvil-testnet-")
        checkout = Path(__file__).resolve().parents[2]
        started = time.monotonic()
        with Cluster.start(workdir, args.hosts, args.down, slurm=args.slurm) as cluster:
            settings = Path(workdir) / "anvil-hosts.yaml"
            settings.write_text(cluster.invoke_yaml(checkout))
            up_hosts = ",".join(h.address for h in cluster.hosts)
            print(f"cluster {cluster.number}: up {up_hosts}; down "
                  f"{','.join(h.address for h in cluster.down_hosts) or '-'} "
                  f"(started in {time.monotonic() - started:.1f} s)")
            print(f"  .venv/bin/inv -f {settings} -i {cluster.key_file} -H {up_hosts} preflight.all")
            if cluster.slurm:
                n = len(cluster.hosts)
                nodes = ", ".join(f"{h.name}={h.address}" for h in cluster.hosts)
                print(f"Slurm: controller {_short_hostname()}({cluster.bridge_address}):"
                      f"{cluster.slurmctld_port}, nodes {nodes}, partition debug; "
                      f"logs in {cluster._slurm_path('')}")
                print(f"  export SLURM_CONF={cluster.slurm_conf}")
                print("  sinfo -N")
                print(f"  srun -N{n} hostname")
                print(f"  srun -N{n} -n{2 * n} bash -c 'echo $SLURM_PROCID on $(hostname)'")
                print(f"  salloc -N{n}            # then srun ... inside; exit to release")
                print(f"  cd {checkout} && INVOKE_ANVIL_RUNTIME=slurm .venv/bin/inv train.pretrain "
                      f"--nproc 2")
            print("Ctrl-C (or SIGTERM) stops and cleans up.", flush=True)
            stop = []
            for signum in (signal.SIGINT, signal.SIGTERM):   # SIGINT may arrive ignored (`&`)
                signal.signal(signum, lambda *_: stop.append(1))
            while not stop:
                signal.pause()
        shutil.rmtree(workdir, ignore_errors=True)
    except (ClusterUnavailable, ClusterError, FileNotFoundError) as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
