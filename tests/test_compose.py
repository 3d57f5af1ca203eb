"""docker-compose.yml and the Dockerfile, checked without a Docker engine: the
compose-spec JSON schema, then what a schema cannot see (health dependencies,
commands that exist, ports and environment names that match the code)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainguard.ops.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
CODE_DIRS = ("trainguard", "ingest_service", "checkpoint_store", "trainer_client", "examples")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_compose_file_matches_the_compose_spec_schema():
    """check-jsonschema with its vendored compose-spec schema (works offline)
    accepts the file."""
    binary = Path(sys.executable).with_name("check-jsonschema")
    result = subprocess.run(
        [str(binary), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_a_broken_file(tmp_path):
    """The schema check is not vacuous: a misspelled service key fails it."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("    healthcheck:", "    healthchek:", 1))
    binary = Path(sys.executable).with_name("check-jsonschema")
    result = subprocess.run(
        [str(binary), "--builtin-schema", "vendor.compose-spec", str(broken)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1 and "healthchek" in result.stdout


def test_health_dependencies_have_healthchecks_and_profiles_line_up(compose):
    """Every depends_on target exists; every service_healthy target has a
    healthcheck; a service outside a profile never depends on a profiled one."""
    services = compose["services"]
    for name, svc in services.items():
        for target, cond in (svc.get("depends_on") or {}).items():
            assert target in services, (name, target)
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in services[target], (name, target)
            if not svc.get("profiles"):
                assert not services[target].get("profiles"), (name, target)


def test_redis_is_aof_everysec_on_a_named_volume(compose):
    """Redis 7, AOF with appendfsync everysec, data on a declared named volume."""
    redis = compose["services"]["redis"]
    # The default of ${TRAINGUARD_REDIS_IMAGE-...}: the image a normal user gets.
    image = re.sub(r"^\$\{[A-Z_]+:?-(.*)\}$", r"\1", redis["image"])
    assert re.match(r"redis:7(\.|-|$)", image), redis["image"]
    cmd = _command(redis)
    assert _flag(cmd, "--appendonly") == "yes" and _flag(cmd, "--appendfsync") == "everysec"
    (volume,) = [v for v in redis["volumes"] if v.endswith(":/data")]
    assert volume.split(":")[0] in compose["volumes"]


def test_trainguard_commands_exist_and_ports_match(compose):
    """Every `trainguard ...` command in compose and the Dockerfile parses with the
    real CLI; the service serves on 0.0.0.0 inside, on the port it publishes (host
    side 127.0.0.1), which its healthcheck probes on /readyz; EXPOSE agrees."""
    parser = build_parser()
    svc = compose["services"]["trainguard"]
    cmd = _command(svc)
    assert cmd[0] == "trainguard"
    args = parser.parse_args(cmd[1:])
    assert args.handler is not None
    assert _flag(cmd, "--host") == "0.0.0.0"
    port = _flag(cmd, "--port")
    (published,) = svc["ports"]
    host_ip, _host_port, container_port = published.split(":")
    assert (host_ip, container_port) == ("127.0.0.1", port)
    health = " ".join(svc["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/readyz" in health
    docker = DOCKERFILE.read_text()
    assert re.search(rf"^EXPOSE {port}$", docker, re.M)
    assert f"127.0.0.1:{port}/readyz" in docker
    cmd_line = re.search(r"^CMD (\[.*\])$", docker, re.M)
    assert cmd_line is not None
    docker_cmd = yaml.safe_load(cmd_line.group(1))
    assert docker_cmd[0] == "trainguard"
    assert parser.parse_args(docker_cmd[1:]).handler is not None


def test_python_commands_are_scripts_that_start(compose):
    """Every `python <script>` command (example data, example trainer) is a script in
    the repo that starts (--help) with its imports resolved, and accepts every flag
    compose passes to it."""
    commands = [_command(s) for s in compose["services"].values()]
    scripts = [c for c in commands if c and c[0] == "python"]
    assert {c[1] for c in scripts} == {"examples/train_mlp.py", "examples/make_tokens.py"}
    for cmd in scripts:
        assert (ROOT / cmd[1]).is_file(), cmd
        result = subprocess.run(
            [sys.executable, cmd[1], "--help"], cwd=ROOT, capture_output=True, text=True,
            timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        )
        assert result.returncode == 0, result.stderr
        for flag in (c for c in cmd[2:] if c.startswith("--")):
            assert flag in result.stdout, (cmd[1], flag)


def test_trainer_profile_chain_is_complete(compose):
    """The trainer waits for the service to be healthy and the example data to be
    registered; the data volume the producer reads is mounted in the service."""
    services = compose["services"]
    needs = services["trainer"]["depends_on"]
    assert needs["example-data"]["condition"] == "service_completed_successfully"
    assert needs["trainguard"]["condition"] == "service_healthy"
    out = _flag(_command(services["example-data"]), "--out")
    assert out is not None
    mounts = [v.split(":")[1] for v in services["trainguard"]["volumes"]]
    assert any(out.startswith(m + "/") for m in mounts), (out, mounts)


def test_environment_names_are_read_by_the_code(compose):
    """Every TRAINGUARD_* variable compose sets is read somewhere in the code, so a
    typo cannot silently do nothing."""
    sources = "\n".join(
        p.read_text() for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")
    )
    names = {
        name
        for svc in compose["services"].values()
        for name in (svc.get("environment") or {})
        if name.startswith("TRAINGUARD_")
    }
    assert names
    for name in names:
        assert f'"{name}"' in sources, name


def test_dockerfile_copies_what_exists_and_dockerignore_keeps_it():
    """Every COPY source is in the repo and not excluded by .dockerignore."""
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
                assert src not in ignored, src


def test_cluster_profile_is_three_masters_three_replicas(compose):
    """The cluster profile: six cluster-enabled AOF nodes on their own volumes, each
    announcing its service name; one init job joins all six with one replica per
    master once they are healthy; the second service starts after it, on a
    redis+cluster:// URL naming nodes of this profile (which trainguard parses)."""
    from trainguard.core import redis_url

    services = compose["services"]
    nodes = sorted(n for n, s in services.items() if s.get("profiles") == ["cluster"]
                   and n.startswith("redis-c") and n != "redis-cluster-init")
    assert nodes == [f"redis-c{i}" for i in range(1, 7)]
    for name in nodes:
        svc = services[name]
        cmd = " ".join(_command(svc))
        assert "--cluster-enabled yes" in cmd and "--appendonly yes" in cmd
        assert "--cluster-announce-hostname $(hostname)" in cmd.replace("$$", "$")
        assert svc["hostname"] == name and "healthcheck" in svc
        (volume,) = svc["volumes"]
        assert volume == f"{name}-data:/data" and f"{name}-data" in compose["volumes"]
    init = services["redis-cluster-init"]
    assert set(init["depends_on"]) == set(nodes)
    script = " ".join(_command(init))
    assert "--cluster-replicas 1" in script and "for n in 1 2 3 4 5 6" in script
    svc = services["trainguard-cluster"]
    assert svc["depends_on"] == {"redis-cluster-init": {"condition": "service_completed_successfully"}}
    url = _flag(_command(svc), "--redis-url")
    assert url == svc["environment"]["TRAINGUARD_REDIS_URL"]
    target = redis_url.parse(url)
    assert target.cluster and {h for h, _ in target.nodes} <= set(nodes)
    assert build_parser().parse_args(_command(svc)[1:]).handler is not None


def test_urls_name_services_and_store_roots_parse(compose):
    """Every redis:// or http:// host in commands and environment is a compose
    service, and the admin's checkpoint store setting parses."""
    from ingest_service.service.admin_checkpoints import parse_store_roots

    services = compose["services"]
    text = yaml.safe_dump(services)
    hosts = set(re.findall(r"(?:redis|http)://(?:(?::\$\{[^}]*\}|[^@/\s]*)@)?([a-z0-9_-]+):\d+", text))
    assert hosts - {"127.0.0.1"} <= set(services), hosts
    assert "redis" in hosts
    stores = services["trainguard"]["environment"]["TRAINGUARD_CHECKPOINT_STORES"]
    # Compose interpolation: ${VAR:-default} is the default when VAR is unset.
    stores = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", stores)
    assert parse_store_roots(stores) and "$" not in stores


def test_example_data_script_writes_and_registers(redis_server, tmp_path):
    """examples/make_tokens.py writes N token records and registers the dataset
    (a re-run with the same settings is accepted, as a container restart does)."""
    import redis

    from trainguard.core.streams import DatasetSpec, meta_key

    out = tmp_path / "data" / "tokens.jsonl"
    argv = [sys.executable, "examples/make_tokens.py", "--out", str(out), "--records", "50",
            "--dataset", "ex", "--redis-url", redis_server.url]
    for _ in range(2):
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120,
                                env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        assert result.returncode == 0, result.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 50 and [json_id(line) for line in lines] == list(range(50))
    spec = DatasetSpec.from_redis(redis.Redis.from_url(redis_server.url).hgetall(meta_key("ex")))
    assert (spec.source, spec.format, spec.partitions) == (str(out), "jsonl", 4)


def test_secrets_have_no_defaults_and_env_example_lists_them(compose):
    """Redis requires a password and every Redis URL carries it; MinIO's credentials
    and the Redis password have no default (compose refuses to start without them);
    .env.example names every such variable, and `make compose`'s generator fills
    each CHANGE_ME with a distinct random value."""
    services = compose["services"]
    text = COMPOSE.read_text()
    assert _flag(_command(services["redis"]), "--requirepass", ) == (
        "${REDIS_PASSWORD:?set REDIS_PASSWORD in .env (make compose writes one)}")
    for url in re.findall(r"redis://\S+", yaml.safe_dump(services)):
        assert url.startswith("redis://:${REDIS_PASSWORD:?"), url
    required = set(re.findall(r"\$\{([A-Z_]+):\?", text))
    assert {"REDIS_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"} <= required
    assert not re.search(r"\$\{(MINIO_ROOT_[A-Z]+|REDIS_PASSWORD):-", text)
    example = (ROOT / ".env.example").read_text()
    listed = set(re.findall(r"^([A-Z_]+)=", example, re.M))
    assert required <= listed, required - listed
    make = (ROOT / "Makefile").read_text()
    generator = re.search(r'-c "(import pathlib, re, secrets;[^"]+)"', make)
    assert generator is not None
    code = generator.group(1).replace("'.env.example'", repr(str(ROOT / ".env.example"))) \
        .replace("pathlib.Path('.env')", "OUT")
    out: dict[str, str] = {}

    class Out:
        @staticmethod
        def write_text(t: str) -> None:
            out["text"] = t

    exec(code, {"OUT": Out})
    values = dict(re.findall(r"^([A-Z_]+)=(.*)$", out["text"], re.M))
    assert "CHANGE_ME" not in out["text"]
    assert len(values["REDIS_PASSWORD"]) == 32 and values["REDIS_PASSWORD"] != values["MINIO_ROOT_PASSWORD"]
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def json_id(line: str) -> int:
    import json

    return int(json.loads(line)["id"])
