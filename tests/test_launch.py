"""launch/slurm.sh's control flow under `set -euo pipefail`, with stub `srun`, `scontrol` and `moejax` on
PATH: exit 75 requeues the job, 0 and other codes do not; and docs/LAUNCH.md shows the file verbatim."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "slurm.sh"

STUBS = {
    # srun: record the call, then run the task command (what follows srun's own --options) once
    "srun": '#!/bin/bash\necho "srun $*" >> "$STUB_LOG"\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
    # scontrol: a node list (long enough that `head -n1` could close the pipe early), and requeue
    "scontrol": '#!/bin/bash\necho "scontrol $*" >> "$STUB_LOG"\n'
                'if [ "$1 $2" = "show hostnames" ]; then for i in $(seq 0 5000); do echo "node$i"; done; fi\n',
    # moejax: record its arguments, exit with the code under test
    "moejax": '#!/bin/bash\necho "moejax $*" >> "$STUB_LOG"\nexit "$STUB_RC"\n',
}


def _run(tmp_path, rc):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    log = tmp_path / f"log{rc}"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log), "STUB_RC": str(rc),
           "MOEJAX": str(bin_dir / "moejax"), "RUN_DIR": "/shared/runs/x", "SLURM_JOB_NODELIST": "node[0-5000]",
           "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "176", "SLURM_PROCID": "3"}
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    return r, log.read_text().splitlines()


@pytest.mark.parametrize("rc, requeued, script_rc", [(75, True, 0), (0, False, 0), (1, False, 1), (143, False, 143)])
def test_requeue_only_on_exit_75(tmp_path, rc, requeued, script_rc):
    r, calls = _run(tmp_path, rc)
    assert r.returncode == script_rc, r.stderr
    assert ("scontrol requeue 4242" in calls) == requeued, calls
    train = [c for c in calls if c.startswith("moejax ")]
    assert train == ["moejax train --preset hero --run-dir /shared/runs/x --coordinator node0:8476 "
                     "--num-processes 176 --process-id 3 --wandb offline"]


def test_launch_doc_shows_the_tested_script():
    doc = (REPO / "docs" / "LAUNCH.md").read_text()
    assert f"```bash\n{SCRIPT.read_text()}```" in doc
