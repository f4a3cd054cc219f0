"""A container harness for the deployment tests: podman with runc, a base image made locally with
mmdebstrap (no registry is needed), and the host's pip configuration mounted into the build.

What the machine needs is detected, not assumed: the OCI runtime that works with this host's cgroup
layout, default ulimits within the host's hard limits, the pip configuration pip itself reports.
Everything made here lives in a cache folder outside the clone (``ROUTING_CI_CACHE``, default
``/var/cache/routing-service-ci``) and in podman's image store, so later runs reuse it.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("ROUTING_CI_CACHE", "/var/cache/routing-service-ci"))
BASE = "localhost/routing-base:bookworm"
BASE_PACKAGES = "python3,python3-venv,python-is-python3,ca-certificates,netbase,tzdata"
ROOT = Path(__file__).resolve().parents[2]


def need(tool: str) -> str:
    path = shutil.which(tool)
    assert path, f"{tool} is not installed; the README's test command installs it (apt-get install podman runc " \
                 "mmdebstrap)"
    return path


def run(*args: str, timeout: float = 1800, check: bool = True, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command with the harness's podman configuration; raise with its output when it fails."""
    env = {**(env or os.environ), "CONTAINERS_CONF": str(containers_conf())}
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])} ... exited {out.returncode}:\n{out.stdout[-3000:]}\n"
                           f"{out.stderr[-3000:]}")
    return out


def cli(*args: str, timeout: float = 1800, check: bool = True, cwd: Path | None = None
        ) -> subprocess.CompletedProcess[str]:
    """Run ``podman ARGS`` (see :func:`run`)."""
    return run(need("podman"), *args, timeout=timeout, check=check, cwd=cwd)


def runtime() -> str:
    """runc on a hybrid cgroup layout (crun refuses it), else crun when present."""
    hybrid = Path("/sys/fs/cgroup/unified").is_dir()
    if not hybrid and shutil.which("crun"):
        return "crun"
    need("runc")
    return "runc"


def containers_conf() -> Path:
    """A containers.conf for this machine (never the system's own)."""
    path = CACHE / "containers.conf"
    if path.is_file():
        return path
    _write_conf(path, ulimits=True)
    return path


def _write_conf(path: Path, ulimits: bool) -> None:
    """``ulimits``: default ulimits within the host's hard limits (podman's own may exceed them); else none, the
    runtime keeping the host's."""
    CACHE.mkdir(parents=True, exist_ok=True)
    limits = []
    for name, rlimit, want in (("nofile", resource.RLIMIT_NOFILE, 65536), ("nproc", resource.RLIMIT_NPROC, 65536)):
        hard = resource.getrlimit(rlimit)[1]
        n = want if hard == resource.RLIM_INFINITY else min(want, hard)
        limits.append(f'"{name}={n}:{n}"')
    path.write_text(f"[containers]\ndefault_ulimits = [{', '.join(limits) if ulimits else ''}]\n[engine]\n"
                    f"runtime = \"{runtime()}\"\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n")


_ULIMITS_CHECKED = False


def settle_ulimits(image: str) -> None:
    """Some machines refuse every rlimit runc sets on a container's process (seen here: 'error setting rlimit
    type 6: operation not permitted', whatever the value); there the configuration asks for none. Checked
    once per test run, with ``image``, since the configuration is cached between runs."""
    global _ULIMITS_CHECKED
    if _ULIMITS_CHECKED:
        return
    _ULIMITS_CHECKED = True
    path = containers_conf()
    for ulimits in (True, False):
        _write_conf(path, ulimits)
        out = cli("run", "--rm", "--network", "none", image, "true", check=False)
        if out.returncode == 0:
            return
        if "error setting rlimit" not in out.stdout + out.stderr:
            raise RuntimeError(f"podman cannot run {image}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    raise RuntimeError(f"podman cannot run {image} with or without default ulimits:\n{out.stderr[-2000:]}")


def image_exists(name: str) -> bool:
    return cli("image", "exists", name, check=False).returncode == 0


def ensure_base() -> str:
    """The Dockerfile's Python base, made from Debian's packages (bookworm's python3 is 3.11)."""
    if image_exists(BASE):
        settle_ulimits(BASE)
        return BASE
    tar = CACHE / "base.tar"
    print(f"making the base image with mmdebstrap into {tar}", file=sys.stderr)
    run(need("mmdebstrap"), "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(tar))
    cli("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--change", "ENV LANG=C.UTF-8", str(tar), BASE)
    tar.unlink()
    settle_ulimits(BASE)
    return BASE


DNS_PACKAGES = {"cni": "golang-github-containernetworking-plugin-dnsname", "netavark": "aardvark-dns"}
"""The Debian package that resolves container names on a network of each podman network backend (podman picks
CNI where netavark is not installed, or where its storage was made with CNI)."""


def assert_names_resolve(image: str) -> None:
    """Containers on one user-defined network (as compose makes) resolve each other's names; else fail at once,
    naming the package this machine's network backend lacks (without it, a compose stack's services cannot reach
    each other and Prometheus scrapes nothing)."""
    backend = cli("info", "--format", "{{.Host.NetworkBackend}}").stdout.strip()
    net, peer = "routing-ci-names", "routing-ci-names-peer"
    cli("rm", "-f", "-t", "0", peer, check=False)
    cli("network", "rm", "-f", net, check=False)
    cli("network", "create", net)
    try:
        started = cli("run", "-d", "--network", net, "--name", peer, image, "sleep", "120", check=False)
        looked_up = cli("run", "--rm", "--network", net, image, "getent", "hosts", peer, check=False) \
            if started.returncode == 0 else started
    finally:
        cli("rm", "-f", "-t", "0", peer, check=False)
        cli("network", "rm", "-f", net, check=False)
    package = DNS_PACKAGES.get(backend, f"the DNS plugin of podman's {backend!r} network backend")
    assert looked_up.returncode == 0, (
        f"containers on a podman network cannot resolve each other's names (network backend {backend}): install "
        f"{package} (the README's test command does: apt-get install ... {' '.join(DNS_PACKAGES.values())})\n"
        f"{looked_up.stdout[-1000:]}{looked_up.stderr[-1000:]}")


PIP_PATH_KEYS = ("cert", "client-cert", "find-links", "constraint", "requirement", "index-url", "extra-index-url")


def pip_mounts() -> list[str]:
    """``-v`` options that give the build the host's pip configuration: its config files, and the files and
    folders they or the environment name (certificates, find-links, constraints, local indexes; read-only): a
    config file that names a file the build cannot see fails every ``pip install``."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "debug"], capture_output=True, text=True)
    files = [line.split(",")[0].strip() for line in out.stdout.splitlines() if line.strip().endswith("exists: True")]
    paths = {f.strip().removesuffix(":").split()[-1] for f in files}
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in PIP_PATH_KEYS:
            values = [v.removeprefix("file://") for v in value.strip("'\"").split()]
            # a local index's pages link to files beside it (../files/...): its parent folder goes in whole
            paths |= {str(Path(v).parent) if name.endswith("index-url") else v for v in values if v.startswith("/")}
    mounts = []
    for p in sorted(paths):
        if Path(p).exists():
            mounts += ["-v", f"{p}:{p}:ro"]
    return mounts


def build(tag: str) -> None:
    """Build the Dockerfile's CPU variant on the local base, pip configured as on the host."""
    cli("build", "--network", "host", *pip_mounts(), "--build-arg", f"PYTHON_IMAGE={ensure_base()}",
        "--build-arg", "TORCH_VARIANT=cpu", "--build-arg", "TORCH_INDEX_URL=", "-t", tag, str(ROOT), cwd=ROOT)


def image_size(tag: str) -> int:
    return int(cli("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


PROMETHEUS_STAND_IN = """\
FROM {base}
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus wget \\
    && rm -rf /var/lib/apt/lists/*
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
"""


def ensure_prometheus(tag: str) -> None:
    """An image of Debian's prometheus package under the compose file's upstream tag (tests only: no
    registry is reachable here)."""
    if image_exists(tag):
        return
    folder = CACHE / "prometheus-image"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Containerfile").write_text(PROMETHEUS_STAND_IN.format(base=ensure_base()))
    cli("build", "--network", "host", "-t", tag, str(folder))
