"""Thread defaults come from the CPUs the process may use, a cgroup CPU quota included, and the OpenMP
wait policy is only set while it can still take effect."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from service import threads


@pytest.mark.parametrize(("cpu_max", "expected"), [
    ("150000 100000\n", lambda n: min(n, 2)),  # 1.5 CPUs of quota: 2 threads (rounded up)
    ("100000 100000\n", lambda n: 1),
    ("max 100000\n", lambda n: n),  # no quota
    (None, lambda n: n),  # no cgroup v2 file
])
def test_available_cpus_honours_the_cgroup_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_max, expected
                                                 ) -> None:
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    monkeypatch.setattr(threads, "CGROUP_CPU_MAX", path)
    affinity = len(os.sched_getaffinity(0))
    assert threads.available_cpus() == expected(affinity) >= 1


def test_torch_threads_default_and_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "available_cpus", lambda: 1)
        assert threads.set_torch_threads(None) == 1 and torch.get_num_threads() == 1
        assert threads.set_torch_threads(2) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_openmp_settings_are_not_set_once_torch_is_loaded(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with caplog.at_level(logging.WARNING):
        threads.set_openmp("passive", 10000)  # torch is loaded in this process: too late
    assert "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ
    assert "OMP_WAIT_POLICY=PASSIVE ignored" in caplog.text and "GOMP_SPINCOUNT=10000 ignored" in caplog.text
    threads.set_openmp(None, None)
    assert "OMP_WAIT_POLICY" not in os.environ


def test_the_serve_command_can_still_set_the_openmp_settings() -> None:
    """`routing-service serve` builds its settings and sets OpenMP's before anything imports torch; a spin count
    the environment sets is kept."""
    import subprocess
    import sys

    code = ("import os, sys; import service.cli, service.config; loaded = 'torch' in sys.modules; "
            "from service.threads import set_openmp; set_openmp('passive', service.config.Settings().omp_spin_count); "
            "import torch; print(loaded, os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["False", "PASSIVE", "10000"]
    env["GOMP_SPINCOUNT"] = "123"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["False", "PASSIVE", "123"]


def test_serve_rejects_a_bad_option_with_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from service.cli import app

    res = CliRunner().invoke(app, ["serve", "--omp-wait-policy", "sometimes"])
    assert res.exit_code == 2 and "omp_wait_policy" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["serve", "--model-replicas", "2", "--no-model-process"])
    assert res.exit_code == 2 and "model_replicas > 1 needs model_process" in res.output
    monkeypatch.setenv("ROUTING_MAX_BATCH_SIZE", "0")
    res = CliRunner().invoke(app, ["serve"])
    assert res.exit_code == 2 and "max_batch_size" in res.output


def test_serve_takes_a_default_model_only_when_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from service import threads
    from service.cli import app
    from service.config import Settings
    from service.serving import server

    started: list[Settings] = []
    monkeypatch.setattr(server, "run_server", started.append)
    monkeypatch.setattr(threads, "set_openmp", lambda *_: None)  # this process's environment stays as it is
    monkeypatch.delenv("ROUTING_DEFAULT_MODEL", raising=False)
    assert CliRunner().invoke(app, ["serve", "--default-model", "bbc-news-topics"]).exit_code == 0
    assert CliRunner().invoke(app, ["serve"]).exit_code == 0
    named, unnamed = started
    assert named.default_model == "bbc-news-topics" and "default_model" in named.model_fields_set
    assert "default_model" not in unnamed.model_fields_set  # the start then picks it (default_model_at_start)


@pytest.mark.parametrize("serial", [True, False])
def test_a_serving_process_tokenizes_on_its_own_thread(tiny_backbone_dir: Path, serial: bool) -> None:
    """With serial_tokenizer (what every serving process calls before it serves, even after its tokenizer was
    used), a call of many texts starts no pool of threads; without it (the variable unset), the library's pool
    starts; a value the environment sets is kept."""
    import subprocess
    import sys

    code = ("import os; from service import threads; from service.modeling.tokenizer import ChunkTokenizer; "
            f"c = ChunkTokenizer.load({str(tiny_backbone_dir)!r}); "
            f"{'threads.serial_tokenizer(); ' if serial else ''}c.encode_lengths(['a text of some words'] * 64, [16]); "
            "print(len(os.listdir('/proc/self/task')), os.environ.get('TOKENIZERS_PARALLELISM'))")
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    n, value = out.split()
    assert (int(n) == 1, value) == ((True, "false") if serial else (False, "None"))
    env["TOKENIZERS_PARALLELISM"] = "true"
    if serial:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
        assert out.split()[1] == "true"
