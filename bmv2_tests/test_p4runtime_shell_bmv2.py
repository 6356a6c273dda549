"""An outside cross-check of what the controller writes: p4runtime-shell (the p4lang client, not
finsy) reads back the table entries and multicast groups a running ``switchagg-ctl serve`` put on
bmv2, and they are exactly the desired state of the job it placed.

p4runtime-shell pins protobuf 3.20 (the controller needs 6), so it runs from a virtualenv this
test creates; the test skips, saying why, when that virtualenv cannot be built (no package index).
It connects with a lower election id than the controller's: a backup, reads only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from switchagg import jobclient
from switchagg_controller import p4_program, p4rt
from switchagg_controller.model import Job, WorkerAddr
from switchagg_controller.topology import dump_topology, parse_topology
from switchagg_lab.bmv2.controller_switch import topology_yaml
from switchagg_lab.testbed.bmv2 import Bmv2Switch
from switchagg_lab.testing.controller import SECRET, Controller

P4SH_VERSION = "0.0.6"
WORKERS = (("10.0.0.1", 40100), ("10.0.0.2", 40101))  # rank -> address

READ_BACK = """
import json, sys
import p4runtime_sh.shell as sh
address, device_id = sys.argv[1], int(sys.argv[2])
sh.setup(device_id=device_id, grpc_addr=address, election_id=(0, 1), config=None)
try:
    out = {"tables": [], "groups": []}
    for table in sh.context.get_objs(sh.P4Type.table):
        name = table[0] if isinstance(table, tuple) else table.preamble.name
        for te in sh.TableEntry(name).read():
            m = te.msg()
            out["tables"].append([
                m.table_id,
                sorted([f.field_id, int.from_bytes(f.exact.value, "big")] for f in m.match),
                m.action.action.action_id,
                sorted([p.param_id, int.from_bytes(p.value, "big")] for p in m.action.action.params),
            ])
    for g in sh.MulticastGroupEntry().read():
        m = g.msg().multicast_group_entry
        out["groups"].append([m.multicast_group_id, sorted([r.egress_port, r.instance] for r in m.replicas)])
    print(json.dumps(out))
finally:
    sh.teardown()
"""


def _p4sh_python(root: Path) -> Path:
    """The interpreter of a virtualenv holding p4runtime-shell, made once per cache directory."""
    venv = root / f"p4runtime-shell-{P4SH_VERSION}"
    python = venv / "bin" / "python"
    if (
        python.exists()
        and subprocess.run([python, "-c", "import p4runtime_sh"], capture_output=True).returncode == 0
    ):
        return python
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True, timeout=300
        )
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        r = subprocess.run(
            [*pip, f"p4runtime-shell=={P4SH_VERSION}"], capture_output=True, text=True, timeout=900
        )
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"cannot build a virtualenv for p4runtime-shell: {e}")
    if r.returncode != 0:
        pytest.skip(
            f"p4runtime-shell {P4SH_VERSION} cannot be installed: {(r.stderr or r.stdout).strip()[-500:]}"
        )
    return python


def _join_pair(address: str, name: str) -> list[jobclient.Assignment]:
    out: list[jobclient.Assignment] = []
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        ip, port = WORKERS[rank]
        try:
            out.append(jobclient.join(address, SECRET, name, 2, ip, port, rank=rank, timeout=60))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(len(WORKERS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    return sorted(out, key=lambda a: a.rank)


def _expected(state: Any) -> dict[str, Any]:
    schema = p4rt.load_schema(p4_program.P4INFO)
    tables = []
    for entry in state.entries:
        m = p4rt.build_entry(entry, schema)
        tables.append([
            m.table_id,
            sorted([f.field_id, int.from_bytes(f.exact.value, "big")] for f in m.match),
            m.action.action.action_id,
            sorted([p.param_id, int.from_bytes(p.value, "big")] for p in m.action.action.params),
        ])  # fmt: skip
    groups = [[g.group_id, sorted([p, i] for p, i in g.replicas)] for g in state.groups]
    return {"tables": sorted(tables), "groups": sorted(groups)}


def test_p4runtime_shell_reads_back_the_desired_state(bmv2: Bmv2Switch, tmp_path: Path) -> None:
    cache = Path(os.environ.get("SWITCHAGG_P4SH_CACHE", tmp_path))
    python = _p4sh_python(cache)
    topo = replace(parse_topology(topology_yaml(bmv2.grpc_address)), election_id=(0, 5))
    path = tmp_path / "topology.yaml"
    path.write_text(dump_topology(topo))
    c = Controller(tmp_path, ["--topology", str(path), "--reap-timeout", "600"]).start()
    try:
        a = _join_pair(c.address, "crosscheck")
        r = subprocess.run(
            [python, "-c", READ_BACK, bmv2.grpc_address, str(topo.device_id)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        c.stop()
    workers = tuple(WorkerAddr(rank, ip, port) for rank, (ip, port) in enumerate(WORKERS))
    job = Job(
        a[0].job_id,
        "crosscheck",
        2,
        a[0].slot_base,
        a[0].slot_count,
        a[0].k,
        a[0].generation,
        workers,
        0,
        key=a[0].key,
    )
    want = _expected(p4_program.desired_state(topo, [job]))
    assert {"tables": sorted(got["tables"]), "groups": sorted(got["groups"])} == want
