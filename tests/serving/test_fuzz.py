"""Schema-driven fuzzing (schemathesis) of the real server's /openapi.json: no 5xx, no response that
breaks its own schema, no schema-violating request accepted, right answers to undeclared methods.

`positive_data_acceptance` is left out on purpose: labels are model-specific, so a schema-valid
`target` naming no label of the model is rejected with 422 by design."""

import re
import shutil
import subprocess
from pathlib import Path

import httpx

from tests.serving.server import Server


def test_schemathesis_finds_no_failure(tiny: Server, tmp_path: Path) -> None:
    paths = set(httpx.get(f"{tiny.url}/openapi.json").json()["paths"])
    assert {"/v2", "/v2/health/ready", "/v2/models/{model}", "/v2/models/{model}/ready", "/v2/models/{model}/infer",
            "/v1/models/{model}:predict", "/v1/models/{model}:explain"} <= paths  # the protocols are fuzzed too
    st = shutil.which("st") or shutil.which("schemathesis")
    assert st, "schemathesis is not installed (pip install -e '.[test]')"
    out = subprocess.run([st, "run", f"{tiny.url}/openapi.json", "--checks", "all", "--exclude-checks",
                          "positive_data_acceptance", "--max-examples", "40", "--workers", "1", "--seed", "7",
                          "--report-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    tail = out.stdout[-4000:]
    assert out.returncode == 0, tail
    m = re.search(r"(\d+) generated, (\d+) passed", out.stdout)
    assert m and int(m.group(1)) == int(m.group(2)) >= 200, tail
    print(f"schemathesis: {m.group(0)}")
