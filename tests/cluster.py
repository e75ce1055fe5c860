"""A real small cluster on this machine: SSH hosts in network namespaces.

Each cluster gets its own private subnet 10.213.N.0/24 (N = a free number
1..254 picked under a lock; ANVIL_TESTNET_PREFIX overrides "10.213").
10.213.0.0/16 is reserved for these test clusters and nothing else: only
addresses inside namespaces that the cluster itself created are ever used.

    root namespace  bridge anvbrN, address 10.213.N.1  (where `inv -H` runs)
    host i          namespace anvN-hI, veth eth0, address 10.213.N.(10+i),
                    its own UTS namespace (hostname nodeI) and its own sshd
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

Use from Python (tests/conftest.py has the pytest fixture):

    with Cluster.start(workdir, n_hosts=2, n_down=1) as cluster:
        cluster.ssh(cluster.hosts[0], "hostname")

or by hand:  python tests/cluster.py up [--hosts 2] [--down 1]
             python tests/cluster.py down N      (or: down --stale)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATE_DIR = Path("/run/anvil-testnet")
SSHD = "/usr/sbin/sshd"
PREFIX = os.environ.get("ANVIL_TESTNET_PREFIX", "10.213")
SSH_PORT = 22
FIRST_HOST_OCTET = 10


class ClusterUnavailable(RuntimeError):
    """This machine cannot build namespace hosts (not root, no ip/sshd, ...)."""


class ClusterError(RuntimeError):
    """Building or stopping the cluster failed."""


def missing_prerequisites() -> str | None:
    """Why namespace hosts cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns, sshd)"
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

    # ---- life cycle -----------------------------------------------------------------

    @classmethod
    def start(cls, workdir: str | Path, n_hosts: int = 2, n_down: int = 1) -> "Cluster":
        reason = missing_prerequisites()
        if reason:
            raise ClusterUnavailable(reason)
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        remove_stale()
        with _lock():
            number = _free_number()
            cluster = cls._plan(number, workdir, n_hosts, n_down)
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
        except Exception:
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
                        pidfile=str(workdir / f"sshd-node{index}.pid") if up else "")

        return cls(number=number, bridge=f"anvbr{number}", bridge_address=f"{net}.1",
                   hosts=[host(i, "h", True) for i in range(1, n_hosts + 1)],
                   down_hosts=[host(j, "d", False) for j in range(1, n_down + 1)],
                   workdir=str(workdir), key_file=str(workdir / "id_ed25519"),
                   owner_pid=os.getpid(), owner_start=_process_start(os.getpid()))

    def stop(self) -> None:
        """Stop our sshds and whatever still runs in our namespaces, delete the network."""
        problems = []
        for host in self.hosts:
            _stop_pidfile(host.pidfile, expect=SSHD)
        for host in self.hosts + self.down_hosts:
            for pid in _netns_pids(host.netns):
                _stop_pid(pid)
            _ip("netns", "del", host.netns, check=False)
            _ip("link", "del", host.veth, check=False)     # gone with the namespace, normally
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
        _ip(*inside, "link", "set", peer, "name", "eth0")
        _ip(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "link", "set", "lo", "up")
        # No default route: the hosts reach each other and the bridge, nothing else.

    def _start_sshd(self, host: Host) -> None:
        work = Path(self.workdir)
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
        return cls(**data)

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


# ---- helpers ----------------------------------------------------------------------------


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


def _stop_pidfile(pidfile: str, expect: str) -> None:
    """Stop the process a pid file names, if it still is the program we started."""
    if not pidfile:
        return
    try:
        pid = int(Path(pidfile).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    argv = _cmdline(pid)
    if argv and argv[0].startswith(expect):   # a recycled pid is someone else's
        _stop_pid(pid)


def _netns_pids(netns: str) -> list[int]:
    out = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


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
    parser = argparse.ArgumentParser(prog="python tests/cluster.py",
                                     description="Namespace SSH hosts for trying `inv -H` by hand.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster and keep it until Ctrl-C")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--down", type=int, default=1)
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
        workdir = tempfile.mkdtemp(prefix="anvil-testnet-")
        checkout = Path(__file__).resolve().parents[1]
        with Cluster.start(workdir, args.hosts, args.down) as cluster:
            settings = Path(workdir) / "anvil-hosts.yaml"
            settings.write_text(cluster.invoke_yaml(checkout))
            up_hosts = ",".join(h.address for h in cluster.hosts)
            print(f"cluster {cluster.number}: up {up_hosts}; down "
                  f"{','.join(h.address for h in cluster.down_hosts) or '-'}")
            print(f"  .venv/bin/inv -f {settings} -i {cluster.key_file} -H {up_hosts} preflight.all")
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
