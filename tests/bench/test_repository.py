"""`bench repository` on the tiny model: loads are timed and each unloaded again, memory is read before, loaded
and after, and a reload and an unload under traffic leave every request answered (200, or 404 for the
unloaded model only)."""

from __future__ import annotations

from pathlib import Path

from service.bench import repository


def test_measures_loads_memory_and_answers_under_traffic(tiny_repo: Path, tmp_path: Path) -> None:
    texts = ["a short text", "another one, a little longer", "x"]
    got = repository.measure(tiny_repo, "tiny", texts, loads=2, concurrency=4, seconds=3.0, logs=tmp_path)
    loading, load = got["loading"], got["under_load"]
    assert len(loading["load_ms"]) == 2 and all(ms > 0 for ms in loading["server_load_ms"])
    pss = loading["pss_mib"]
    assert pss["before_load"] > 0 and pss["loaded"] > 0 and pss["after_unload"] > 0
    statuses = load["statuses"]
    assert statuses.get("tiny 200", 0) > 0 and statuses.get("tiny-copy 200", 0) > 0
    assert statuses.get("tiny-copy 404", 0) > 0  # after the unload
    assert load["errors"] == 0 and load["answered"] == sum(statuses.values())
