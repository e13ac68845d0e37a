"""Custom rewards in the bubblewrap jail: results, the admin's limits, and every escape the
attack on a shared box tried (environment, database and data dir, network, daemons, memory,
fork bombs, endless loops) — each must fail inside the jail."""
from __future__ import annotations

import os
import re
import socket
import sqlite3
import threading
import time
from pathlib import Path

import psutil
import pytest

from app.settings import Settings
from app.store.specs import RewardSpec
from worker.rewards import jail
from worker.rewards.base import Batch, RewardError, score_all, validate
from worker.rewards.sandbox import SandboxedReward, make_custom

REPO = Path(__file__).resolve().parents[2]


def _batch(n=4, **columns):
    cols = {"answer": ["a", "b", "c", "d"][:n]}
    cols.update({k: [v] * n for k, v in columns.items()})
    return Batch([f"p{i}" for i in range(n)], ["Lily went home", "a cat", "Lily and Tom", "x"][:n],
                 [3] * n, cols)


def _reward(src, entry="reward", style="reward", **limits):
    return SandboxedReward("mine", src, entry=entry, style=style, limits=jail.Limits(**limits))


def _texts(values):
    """What a probing reward returned (strings come back as opaque values)."""
    return [repr(v).strip("'\"") for v in values]


def test_custom_reward_scores_and_sees_columns():
    r = _reward("import re\n"
                "def reward(prompt, completion, item):\n"
                "    print('debug output must not break the protocol')\n"
                "    return float('Lily' in completion) + (item['answer'] == 'c')\n")
    b = _batch()
    assert validate(r.name, r.score(b), b) == [1.0, 0.0, 2.0, 0.0]
    assert r._proc is None  # one jail per batch, gone when the call returns
    assert r.score(b) == [1.0, 0.0, 2.0, 0.0]


def test_openai_grade_style():
    r = _reward("def grade(sample, item):\n    return len(sample['output_text']) > 5\n",
                entry="grade", style="openai")
    assert r.score(_batch()) == [1.0, 0.0, 1.0, 0.0]


def test_runs_as_another_user_with_only_the_system_mounted():
    r = _reward("import os, sys\n"
                "def reward(prompt, completion, item):\n"
                "    return f'{os.getuid()} {sorted(os.listdir(\"/\"))} {sys.path}'\n")
    uid, rest = _texts(r.score(_batch(1)))[0].split(" ", 1)
    assert uid == "65534"
    top = set(re.findall(r"'(\w+)'", rest.split("] [")[0]))
    assert top <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev",
                   "tmp", "root", "opt", "home"} and "work" not in top
    assert "site-packages" not in rest and ".venv" not in rest


def test_make_custom_takes_the_admins_limits_not_the_submitters(monkeypatch):
    monkeypatch.setattr("app.settings.get_settings", lambda: Settings(
        reward_memory_mb=300, reward_cpu_seconds=7, reward_timeout_seconds=9,
        reward_max_processes=3))
    spec = RewardSpec(name="custom", params={"source": "def reward(p, c, i):\n    return 1\n",
                                             "memory_mb": 65536, "timeout_s": 600})
    assert spec.params == {"source": "def reward(p, c, i):\n    return 1\n"}
    r = make_custom("mine", {**spec.params, "memory_mb": 65536, "timeout_s": 600})
    assert r.limits == jail.Limits(memory_mb=300, cpu_seconds=7, timeout_s=9, max_processes=3)


# ---- the admin's limits --------------------------------------------------------------------
def test_timeout_kills_the_process():
    r = _reward("def reward(prompt, completion, item):\n    while True:\n        pass\n",
                timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RewardError,
                       match=r"'mine' took longer than the 1 s limit set by the admin"):
        r.score(_batch())
    assert time.monotonic() - t0 < 8
    assert r._proc is None


def test_cpu_limit():
    r = _reward("def reward(prompt, completion, item):\n    while True:\n        pass\n",
                cpu_seconds=1, timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(RewardError,
                       match=r"ran out of CPU time: the limit set by the admin is 1 s"):
        r.score(_batch())
    assert time.monotonic() - t0 < 15


def test_memory_limit():
    r = _reward("def reward(prompt, completion, item):\n"
                "    block = bytearray(800 * 1024 * 1024)\n    return 1.0\n", memory_mb=256)
    with pytest.raises(RewardError, match=r"'mine' raised MemoryError.*past the memory limit of "
                                          r"256 MiB set by the admin.*#0"):
        r.score(_batch())


def test_fork_bomb_is_bounded_and_reaped():
    r = _reward("import os, time\n"
                "def reward(prompt, completion, item):\n"
                "    n = 0\n"
                "    for _ in range(200):\n"
                "        try:\n"
                "            pid = os.fork()\n"
                "        except OSError:\n"
                "            break\n"
                "        if pid == 0:\n"
                "            os.execv('/usr/bin/sleep', ['sleep', '4322.5'])\n"
                "        n += 1\n"
                "    return n\n", max_processes=5)
    n = r.score(_batch(1))[0]
    assert 1 <= n <= 5
    assert _wait_gone("4322.5") == []


# ---- escapes -------------------------------------------------------------------------------
def test_no_worker_environment(monkeypatch):
    monkeypatch.setenv("WHETSTONE_DATABASE_URL", "postgresql://secret")
    monkeypatch.setenv("WHETSTONE_REWARD_TEST_SECRET", "hunter2")
    r = _reward("import os\n"
                "def reward(prompt, completion, item):\n"
                "    try:\n"
                "        host = open(f'/proc/{item[\"pid\"]}/environ', 'rb').read()\n"
                "        host = 'read, secret ' + str(b'hunter2' in host)\n"
                "    except OSError as e:\n"
                "        host = type(e).__name__\n"
                "    return '|'.join([*sorted(os.environ), host])\n")
    *keys, host = _texts(r.score(_batch(1, pid=os.getpid())))[0].split("|")
    assert set(keys) <= {"PATH", "LANG", "PWD"} and "WHETSTONE_REWARD_TEST_SECRET" not in keys
    assert host == "FileNotFoundError"  # the worker's /proc is not in the jail's PID namespace


def test_no_view_of_the_data_dir_or_database(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    db = data / "whetstone.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE job_events (id INTEGER PRIMARY KEY, job_id TEXT, data TEXT)")
        con.execute("INSERT INTO job_events (job_id, data) VALUES ('job1', 'mine')")
    r = _reward("import os, sqlite3\n"
                "def reward(prompt, completion, item):\n"
                "    seen = [p for p in item['paths'] if os.path.exists(p)]\n"
                "    try:\n"
                "        con = sqlite3.connect(f\"file:{item['db']}?mode=rw\", uri=True)\n"
                "        con.execute(\"INSERT INTO job_events (job_id, data) \"\n"
                "                    \"VALUES ('job1', 'x')\")\n"
                "        con.commit()\n"
                "        wrote = 'WROTE'\n"
                "    except sqlite3.Error as e:\n"
                "        wrote = str(e)\n"
                "    return f'{seen} {wrote}'\n")
    paths = [str(data), str(db), str(REPO), str(REPO / ".venv"), str(Path.home())]
    out = _texts(r.score(_batch(1, db=str(db), paths=paths)))[0]
    assert out == "[] unable to open database file"
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT data FROM job_events").fetchall() == [("mine",)]


def test_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        r = _reward("import socket\n"
                    "def reward(prompt, completion, item):\n"
                    "    try:\n"
                    "        socket.create_connection(('127.0.0.1', item['port']), timeout=3)\n"
                    "        return 'CONNECTED'\n"
                    "    except OSError as e:\n"
                    "        return type(e).__name__\n")
        out = _texts(r.score(_batch(1, port=server.getsockname()[1])))[0]
        assert out in ("ConnectionRefusedError", "OSError")  # refused or unreachable
        with pytest.raises(BlockingIOError):
            server.accept()


def _sandbox_procs(marker):
    found = []
    for p in psutil.process_iter(["cmdline", "status", "uids"]):
        if marker in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


def _wait_gone(marker, seconds=3.0):
    end = time.monotonic() + seconds
    while (left := _sandbox_procs(marker)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def test_no_daemon_survives_the_call():
    r = _reward("import os, time\n"
                "def reward(prompt, completion, item):\n"
                "    if os.fork() == 0:\n"
                "        os.setsid()\n"
                "        if os.fork() == 0:\n"
                "            os.execv('/usr/bin/sleep', ['sleep', '4321.5'])\n"
                "        os._exit(0)\n"
                "    time.sleep(1.5)\n"
                "    return 1.0\n")
    seen = []

    def watch():
        end = time.monotonic() + 5
        while not seen and time.monotonic() < end:
            seen.extend(_sandbox_procs("4321.5"))
            time.sleep(0.05)

    t = threading.Thread(target=watch)
    t.start()
    assert r.score(_batch(1)) == [1.0]
    t.join()
    assert seen, "the daemon never started, so the test proves nothing"
    if os.geteuid() == 0:  # the jail dropped root: on the host it is nobody, not root
        assert seen[0].info["uids"].real == jail.NOBODY
    assert _wait_gone("4321.5") == []


def test_without_bubblewrap_custom_rewards_refuse_to_run(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    marker = tmp_path / "ran"
    r = _reward(f"open({str(marker)!r}, 'w').write('x')\n"
                "def reward(prompt, completion, item):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"bubblewrap \(bwrap\) is not installed.*"
                                          r"apt-get install bubblewrap"):
        r.score(_batch())
    assert not marker.exists()


# ---- the code's own failures -----------------------------------------------------------------
def test_exception_names_sample():
    r = _reward("def reward(prompt, completion, item):\n"
                "    return 1 / (len(completion) - 1)\n")
    with pytest.raises(RewardError) as ei:
        score_all([r], _batch(), 2)
    msg = str(ei.value)
    assert "'mine' raised ZeroDivisionError" in msg and "#3" in msg and "'x'" in msg


@pytest.mark.parametrize("body, needle", [
    ("return None", "returned None"),
    ("return 'high'", "returned a str ('high'), not a number"),
    ("return float('nan')", "returned nan"),
    ("return [1, 2]", "returned a list"),
])
def test_bad_return_values(body, needle):
    r = _reward(f"def reward(prompt, completion, item):\n    {body}\n")
    with pytest.raises(RewardError, match=re.escape(needle)):
        score_all([r], _batch(), 2)


def test_load_errors():
    r = _reward("x = 1\n")
    with pytest.raises(RewardError, match="no function named 'reward'"):
        r.score(_batch())
    r = _reward("import numpy\n")  # the venv's packages are not in the jail
    with pytest.raises(RewardError, match="could not be loaded: ModuleNotFoundError"):
        r.score(_batch())


def test_a_jail_that_cannot_start_says_why(monkeypatch):
    real = jail.build

    def broken(code, limits):  # as bwrap answers where user namespaces are not allowed
        spec = real(code, limits)
        spec.argv.insert(1, "--no-such-option")
        return spec

    monkeypatch.setattr(jail, "build", broken)
    with pytest.raises(RewardError, match=r"cannot run: the sandbox did not start \(bwrap: "
                                          r".*no-such-option.*needs unprivileged user namespaces"):
        _reward("def reward(prompt, completion, item):\n    return 1.0\n").score(_batch())
