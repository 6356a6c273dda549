"""The docs say what the code does: every constant, default and measured figure a doc quotes is
checked here against the one place it comes from (host/switchagg/protocol.py, the code that reads
the environment, the dissector, docker/testbed.py, bench/results/*.json, the reliability table's
own rows). A doc that disagrees with the code fails this test; fix the doc (or regenerate it)."""

from __future__ import annotations

import ast
import json
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from switchagg import protocol
from switchagg_lab.testing.docker_testbed import load_testbed

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
RESULTS = REPO / "bench" / "results"
ETH_IP_UDP = 14 + 20 + 8


def read(name: str) -> str:
    return (REPO / name).read_text()


def near(shown: str, actual: float, scale: float = 1.0) -> bool:
    """Whether ``shown`` is ``actual * scale`` rounded to the digits ``shown`` has."""
    exponent = Decimal(shown).as_tuple().exponent
    assert isinstance(exponent, int)
    return abs(float(shown) - actual * scale) <= 0.5 * 10.0**exponent + 1e-9


# ---- protocol constants ----


@pytest.mark.parametrize("doc", DOCS + [REPO / "bench" / "bench_bmv2.py"], ids=lambda p: p.name)
def test_header_length_and_frame_size(doc: Path) -> None:
    text = doc.read_text()
    k_bytes = 4 * protocol.P4_K
    frame = ETH_IP_UDP + protocol.packet_len(protocol.P4_K)
    for m in re.finditer(r"(\d+)-byte (?:aggregation )?header", text):
        assert int(m.group(1)) == protocol.HEADER_LEN, f"{doc.name}: {m.group(0)!r}"
    for m in re.finditer(r"aggregation header \((\d+) bytes\)", text):
        assert int(m.group(1)) == protocol.HEADER_LEN, f"{doc.name}: {m.group(0)!r}"
    for m in re.finditer(r"`(\d+) \+ 4K`", text):
        assert int(m.group(1)) == protocol.HEADER_LEN, f"{doc.name}: {m.group(0)!r}"
    for m in re.finditer(r"\b8 \+ (\d+) \+ (\d+)\b", text):
        assert (int(m.group(1)), int(m.group(2))) == (protocol.HEADER_LEN, k_bytes), (
            f"{doc.name}: {m.group(0)}"
        )
    for m in re.finditer(r"(\d+)-byte frames|frames (?:\(|of |are )(\d+) bytes", text):
        assert int(m.group(1) or m.group(2)) == frame, (
            f"{doc.name}: {m.group(0)!r} (frames are {frame} bytes)"
        )


def test_the_docs_name_the_header_length_where_it_matters() -> None:
    """The patterns above only check what a doc says: these places must say it."""
    bmv2 = read("docs/BMV2.md")
    assert f"{protocol.HEADER_LEN}-byte header" in bmv2
    assert f"8 + {protocol.HEADER_LEN} + {4 * protocol.P4_K}" in bmv2
    assert f"frames are {ETH_IP_UDP + protocol.packet_len(protocol.P4_K)} bytes" in bmv2
    for name in ("docs/PROTOCOL.md", "docs/OBSERVABILITY.md"):
        assert f"`{protocol.HEADER_LEN} + 4K`" in read(name), name


def test_the_software_defaults_quoted_in_the_readme() -> None:
    m = re.search(r"slots 0-(\d+), K = (\d+): the defaults", read("README.md"))
    assert m, "README: the Session example names the default slots and K"
    assert (int(m.group(1)) + 1, int(m.group(2))) == (protocol.DEFAULT_SW_SLOTS, protocol.DEFAULT_SW_K)


# ---- the dissector's fields ----


def dissector_fields() -> set[str]:
    lua = read("tools/wireshark/switchagg.lua")
    fields = set(re.findall(r'ProtoField\.\w+\("(switchagg\.[\w.]*\w)"', lua))
    assert 'ProtoField.bool("switchagg.flags." .. name:lower()' in lua  # one per protocol.FLAG_NAMES
    fields |= {f"switchagg.flags.{name.lower()}" for name in protocol.FLAG_NAMES.values()}
    return fields


def test_observability_lists_every_dissector_field() -> None:
    text = read("docs/OBSERVABILITY.md")
    start = text.index("Fields: `switchagg.version`")
    listed_text = text[start : text.index("A packet the", start)]
    listed = {"switchagg" + n if n.startswith(".") else n for n in re.findall(r"`([\w.]+)`", listed_text)}
    listed.discard("none")
    assert listed == dissector_fields(), (
        f"docs/OBSERVABILITY.md lists {sorted(listed - dissector_fields())} that the dissector lacks "
        f"and lacks {sorted(dissector_fields() - listed)}"
    )
    assert {f"switchagg.{h}" for h in protocol.HEADER_FIELDS} <= listed


# ---- the torch backend's environment ----


def _constant(node: ast.expr, namespace: dict[str, Any]) -> Any:
    """The value of a default or bound in the code (a name of the module's, protocol.X, a number);
    None where it is not a constant (e.g. a bound that is the group's size)."""
    try:
        return eval(compile(ast.Expression(node), "<dataplane>", "eval"), dict(namespace))
    except NameError:
        return None


def _environment_reads() -> dict[str, dict[str, Any]]:
    """SWITCHAGG_* variables host/switchagg reads, with the default and upper bound of those read
    through dataplane.py's _env_int/_env_float (evaluated in their module)."""
    import switchagg.torch.dataplane as dataplane

    found: dict[str, dict[str, Any]] = {}
    for path in (REPO / "host" / "switchagg").rglob("*.py"):
        source = path.read_text()
        for name in re.findall(r'"(SWITCHAGG_[A-Z_]+)"', source):
            found.setdefault(name, {})
        if path.name != "dataplane.py":
            continue
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("_env_int", "_env_float")
                and isinstance(node.args[0], ast.Constant)
            ):
                values = [_constant(a, vars(dataplane)) for a in node.args[1:]]
                found[str(node.args[0].value)] = {
                    "default": values[0],
                    "max": values[2] if len(values) > 2 else None,
                }
    return found


def torch_table() -> dict[str, str]:
    text = read("docs/TORCH.md")
    section = text[text.index("## Data plane selection (environment)") :]
    rows: dict[str, str] = {}
    for line in section.splitlines()[2:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = line.split("|")
        for name in re.findall(r"`(SWITCHAGG_[A-Z_]+)`", cells[1]):
            rows[name] = cells[2]
    return rows


def test_the_torch_environment_table_matches_the_code() -> None:
    reads = _environment_reads()
    table = torch_table()
    torch_doc = read("docs/TORCH.md")
    observability = read("docs/OBSERVABILITY.md")
    assert not set(table) - set(reads), (
        f"TORCH.md's table names variables no code reads: {set(table) - set(reads)}"
    )
    for name in reads:
        # the metrics variables are the Session's (docs/OBSERVABILITY.md), the rest the backend's
        if name.startswith("SWITCHAGG_METRICS_"):
            assert f"`{name}" in observability, name
        else:
            assert name in table, f"docs/TORCH.md's environment table lacks {name}"
    assert f"`{'SWITCHAGG_METRICS_PORT'}`" in torch_doc
    # K and the window follow the path MTU (docs/PROTOCOL.md, K by MTU): the examples quoted are the code's
    k = re.search(
        r"elements per packet \(default: [^;]*?(\d+) at MTU 1500, (\d+) on loopback; at most (\d+)\)",
        table["SWITCHAGG_K"],
    )
    slots = re.search(
        r"slots \(window\) of the job \(default: (\d+) KiB of packets, at least (\d+)",
        table["SWITCHAGG_SLOTS"],
    )
    assert k and slots, table["SWITCHAGG_K"]
    assert int(k.group(1)) == protocol.k_for_mtu(1500)
    assert int(k.group(2)) == protocol.DEFAULT_SW_K == protocol.k_for_mtu(65535)
    assert int(k.group(3)) == reads["SWITCHAGG_K"]["max"] == protocol.MAX_K
    assert int(slots.group(1)) << 10 == protocol.WINDOW_BYTES
    assert int(slots.group(2)) == protocol.DEFAULT_SW_SLOTS == protocol.window_slots(protocol.MAX_K)
    for name in ("SWITCHAGG_TIMEOUT", "SWITCHAGG_LANES", "SWITCHAGG_SHARDS"):
        m = re.search(r"\(default (\d+)(?:, at most (\d+))?", table[name])
        assert m, f"TORCH.md: {name} names its default"
        assert float(m.group(1)) == reads[name]["default"], name
        if m.group(2):
            assert int(m.group(2)) == reads[name]["max"], name


def test_the_nan_block_size_quoted_is_the_default_k() -> None:
    for doc in DOCS:
        for m in re.finditer(r"blanks ([\d,]+) values", doc.read_text()):
            assert int(m.group(1).replace(",", "")) == protocol.DEFAULT_SW_K, f"{doc.name}: {m.group(0)}"


# ---- Docker: the services each variant has ----


@pytest.mark.parametrize("variant", ["soft", "bmv2"])
def test_docker_md_lists_each_variants_services(variant: str) -> None:
    services = set(load_testbed().compose(variant, 3)["services"])
    m = re.search(rf"\* \*\*{variant}\*\* \(services ([^)]*)\)", read("docs/DOCKER.md"))
    assert m, f"docs/DOCKER.md: the {variant} bullet lists its services"
    listed = set(re.findall(r"`([\w-]+?)(?:0`\.\.|`)", m.group(1)))
    workers = {s for s in services if re.fullmatch(r"worker\d+", s)}
    assert listed == (services - workers) | {"worker"}, (listed, services)
    if "controller" not in services:  # the README must not promise a controller container there
        readme = read("README.md")
        assert (
            "no controller container" in readme
            and "A rack in Docker: a switch container and N workers" in readme
        )


def test_the_readme_quotes_the_soft_images_sizes_docker_md_measured() -> None:
    """What `make test` builds (the soft variant's images) is the sum of DOCKER.md's table."""
    sizes: dict[str, float] = {}
    for name, size, unit in re.findall(
        r"^\| `switchagg-([\w-]+):\w+` \|.*\| ([\d.]+) (MB|GB)", read("docs/DOCKER.md"), re.M
    ):
        sizes[name] = float(size) * (1000 if unit == "GB" else 1)
    soft = ("base", "build", "torch-build", "controller", "worker")
    m = re.search(r"images \(about ([\d.]+) GB", read("README.md"))
    assert m and set(soft) <= set(sizes), sizes
    assert near(m.group(1), sum(sizes[s] for s in soft), 1e-3)


# ---- measured figures: the flood's cost, the benchmarks ----


def test_the_flood_cost_in_protocol_md_is_the_reliability_tables() -> None:
    measured = [float(x) for x in re.findall(r"the job took ([\d.]+)x its time", read("docs/RELIABILITY.md"))]
    assert measured, "docs/RELIABILITY.md has the foreign flood rows"
    m = re.search(r"a flood takes aggregator CPU \(measured: ([\d.]+)x-([\d.]+)x", read("docs/PROTOCOL.md"))
    assert m, "docs/PROTOCOL.md quotes the flood's cost"
    assert (float(m.group(1)), float(m.group(2))) == (min(measured), max(measured))


def _readme_section(title: str) -> str:
    text = read("README.md")
    start = text.index(title)
    end = text.find("\n### ", start + len(title))
    return text[start : end if end >= 0 else len(text)]


def _span(values: list[float]) -> str:
    lo, hi = round(min(values) * 100), round(max(values) * 100)
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


def test_the_readme_testbed_table_is_testbed_json() -> None:
    data = json.loads((RESULTS / "testbed.json").read_text())
    section = _readme_section("### Where in-network aggregation wins")
    rows = re.findall(r"^\| (200 Mbit/s|1 Gbit/s) \| (\d+) \|(.*)\|$", section, re.M)
    assert len(rows) == 5
    for rate, n, rest in rows:
        mbit = 200 if rate == "200 Mbit/s" else 1000
        points = sorted(
            (p for p in data["points"] if p["rate_mbit"] == mbit and p["n"] == int(n)),
            key=lambda p: p["size_mb"],
        )
        cells = [c.strip() for c in rest.split("|")]
        for cell, p in zip(cells[:3], points, strict=True):
            m = re.fullmatch(r"([\d.]+)(?: s)? / ([\d.]+)(?: s)? \((?:\*\*)?([\d.]+)x(?:\*\*)?\)", cell)
            assert m, cell
            assert near(m.group(1), p["gloo_s"]) and near(m.group(2), p["switchagg_s"]), (rate, n, cell, p)
            assert near(m.group(3), p["speedup"]), (rate, n, cell, p["speedup"])
        assert cells[3] == _span([p["switchagg_of_bound"] for p in points]), (rate, n, cells[3])
        assert cells[4] == _span([p["cpu_busy_switchagg"] for p in points]), (rate, n, cells[4])


def test_the_readme_ethernet_tables_are_their_json() -> None:
    """Every row of the Ethernet tables (200 Mbit/s: n, MTU, loss; 1 Gbit/s: n, MTU) is its run's."""
    section = _readme_section("### A real Ethernet: MTU 1500 and 9000, frame loss")
    rows = re.findall(
        r"^\| (200 Mbit/s|1 Gbit/s) \| (\d+) \| (\d+), (\d+) \| ([\d.]+)% \|(.*)\|$", section, re.M
    )
    assert len(rows) == 14, len(rows)
    files = {"200 Mbit/s": "testbed_ethernet.json", "1 Gbit/s": "testbed_gbit.json"}
    for rate, n, mtu, k, loss, rest in rows:
        data = json.loads((RESULTS / files[rate]).read_text())
        (p,) = [
            p for p in data["points"]
            if (p["n"], p["mtu"], p["k"], p["loss_pct"]) == (int(n), int(mtu), int(k), float(loss))
        ]  # fmt: skip
        gloo, sa, of_bound, vs, resends, cpu = (c.strip() for c in rest.split("|"))
        assert near(gloo.removesuffix(" s"), p["gloo_s"]), (gloo, p["gloo_s"])
        assert near(sa.removesuffix(" s"), p["switchagg_s"]), (sa, p["switchagg_s"])
        assert of_bound == f"{round(p['switchagg_of_bound'] * 100)}%", (of_bound, p["switchagg_of_bound"])
        assert near(vs.strip("*x"), p["speedup"]), (vs, p["speedup"])
        assert resends == f"{p['retransmits']} / {p['frames_lost_switchagg']}", (resends, p)
        assert cpu == f"{round(p['cpu_share_switchagg'] * 100)}%", (cpu, p["cpu_share_switchagg"])


def test_the_readme_ddp_figures_say_which_run_they_are() -> None:
    """Two DDP results for one setup: testbed.json's older one-epoch run and time_to_accuracy.json's
    current one; each figure must be its own file's, and the README must say which is current."""
    training = {t["backend"]: t for t in json.loads((RESULTS / "testbed.json").read_text())["training"]}
    section = _readme_section("### Where in-network aggregation wins")
    m = re.search(r"(\d+) ms per step on gloo, (\d+) ms on switchagg\s+\(([\d.]+)x\)", section)
    assert m and "older run" in section and "testbed.json's `training`" in section
    assert near(m.group(1), training["gloo"]["step_ms"]) and near(
        m.group(2), training["switchagg"]["step_ms"]
    )
    assert near(m.group(3), training["gloo"]["step_ms"] / training["switchagg"]["step_ms"])

    tta = json.loads((RESULTS / "time_to_accuracy.json").read_text())
    current = re.search(r"The current figure.*?\*\*([\d.]+)x\*\*", section, re.S)
    assert current and near(current.group(1), tta["main"]["runs"]["switchagg32"]["vs_gloo"])


def _tables(section: str, header: str) -> list[tuple[re.Match[str], list[list[str]]]]:
    """Each table of ``section`` whose header row matches ``header``: the match, and its rows' cells
    (without the header and the |---| line)."""
    found: list[tuple[re.Match[str], list[list[str]]]] = []
    lines = section.splitlines()
    for i, line in enumerate(lines):
        m = re.match(header, line)
        if not m:
            continue
        rows = []
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            rows.append([c.strip() for c in row.strip().strip("|").split("|")])
        found.append((m, rows))
    return found


def _x(cell: str) -> str:
    """A ratio cell's number: ``**1.52x**`` -> ``1.52``."""
    return cell.strip("*").removesuffix("x")


def _check_training_row(cells: list[str], run: dict[str, Any], target: float) -> None:
    ms, vs_gloo, vs_fp16, per_epoch, final, to_target = cells[1:]
    if run["status"] == "hung":
        assert ms == f"hung: no epoch in {run['hung_after_s']} s", (cells, run["status"])
        return
    assert run["status"] == "ok" and near(ms, run["step_ms"]), (cells, run.get("step_ms"))
    assert near(_x(vs_gloo), run["vs_gloo"]) and near(_x(vs_fp16), run["vs_fp16_hook"]), cells
    accuracies = [a.strip() for a in per_epoch.removesuffix("%").split(" / ")]
    assert len(accuracies) == len(run["history"]), cells
    for shown, record in zip(accuracies, run["history"], strict=True):
        assert near(shown, record["accuracy"], 100), (cells, record)
    assert near(final.removesuffix("%"), run["final_accuracy"], 100), cells
    seconds = run["time_to_target_s"]
    assert (to_target == "never") if seconds is None else near(to_target.removesuffix(" s"), seconds), cells


def test_the_readme_time_to_accuracy_tables_are_its_json() -> None:
    """One table per width of bench_time_to_accuracy.py's run, one row per method (its label), every
    figure the JSON's: steady ms per step, the ratios, accuracy per epoch, final, time to the target."""
    tta = json.loads((RESULTS / "time_to_accuracy.json").read_text())
    section = _readme_section("### Time to accuracy")
    header = (
        r"^\| `--hidden (\d+)` \| ms per step \| vs gloo \| vs fp16 hook \| "
        rf"accuracy per epoch \| final accuracy \| time to {round(tta['target'] * 100)}% \|$"
    )
    tables = _tables(section, header)
    parts = {part["hidden"]: part for key, part in tta.items() if key in ("main", "small")}
    assert sorted(int(m.group(1)) for m, _ in tables) == sorted(parts), "a table per width run"
    for m, rows in tables:
        part = parts[int(m.group(1))]
        by_label = {run["label"]: run for run in part["runs"].values()}
        assert [r[0] for r in rows] == [run["label"] for run in part["runs"].values()], "every run, in order"
        for cells in rows:
            _check_training_row(cells, by_label[cells[0]], tta["target"])
    assert f"{tta['n']} workers, {tta['rate_mbit']:g} Mbit/s" in section


def test_the_readme_narrow_allreduce_table_is_testbed_lanes_json() -> None:
    data = json.loads((RESULTS / "testbed_lanes.json").read_text())
    section = _readme_section("### Time to accuracy")
    tables = _tables(section, r"^\| n = (\d+), (\d+) Mbit/s \| size \| gloo \| switchagg \| its bound \|")
    assert len(tables) == 1
    m, rows = tables[0]
    points = {(p["bits"], p["size_mb"]): p for p in data["points"]}
    assert len(rows) == len(points)
    for cells in rows:
        lanes = re.fullmatch(r"(\d+)-bit lanes \(gloo (\w+)\)", cells[0])
        assert lanes, cells
        p = points[int(lanes.group(1)), int(cells[1].removesuffix(" MB"))]
        assert (p["n"], p["rate_mbit"]) == (int(m.group(1)), int(m.group(2)))
        assert lanes.group(2) == p["gloo_dtype"]
        gloo, switchagg, bound, of_bound, vs_gloo = cells[2:]
        assert near(gloo.removesuffix(" s"), p["gloo_s"]) and near(
            switchagg.removesuffix(" s"), p["switchagg_s"]
        )
        assert near(bound.split(" s")[0], p["ina_bound_s"]), cells
        assert of_bound.strip("*") == f"{round(p['switchagg_of_bound'] * 100)}%", cells
        assert near(_x(vs_gloo), p["speedup"]), cells


def test_the_readme_charlm_table_is_charlm_json() -> None:
    data = json.loads((RESULTS / "charlm.json").read_text())
    section = _readme_section("### Time to accuracy")
    tables = _tables(
        section, r"^\| char-LM, (\d+) ranks, (\d+) steps \| final eval loss \| vs gloo \| ms per step \|$"
    )
    assert len(tables) == 1
    m, rows = tables[0]
    assert (int(m.group(1)), int(m.group(2))) == (data["ranks"], data["steps"])
    by_label = {run["label"]: run for run in data["runs"].values()}
    assert [r[0] for r in rows] == [run["label"] for run in data["runs"].values()]
    for cells in rows:
        run = by_label[cells[0]]
        loss, vs_gloo, ms = cells[1:]
        assert near(loss, run["final_eval_loss"]) and near(ms, run["step_ms"]), cells
        if vs_gloo:
            assert near(vs_gloo.strip("*").removesuffix("%"), run["vs_gloo"], 100), cells


def test_the_readme_reducer_table_is_reducers_json() -> None:
    points = json.loads((RESULTS / "reducers.json").read_text())["points"]
    section = _readme_section("### Without a switch")
    rows = re.findall(r"^\| (gloo ring|switchagg[^|]*|M = \d+) \|(.*)\|$", section, re.M)
    assert len(rows) == len(points)
    for (name, rest), p in zip(rows, points, strict=True):
        cells = [c.strip() for c in rest.split("|")]
        if name.startswith("M = ") or "M = " in name:
            assert p["system"] == "reducers" and f"M = {p['shards']}" in name, (name, p)
        seconds, speedup, bound, of_bound, of_sr = cells
        assert near(seconds.removesuffix(" s"), p["seconds"]), (name, seconds)
        assert near(speedup.strip("*").removesuffix("x"), p["speedup_vs_gloo"]), (name, speedup)
        assert near(bound.split(" s")[0], p["bound_s"]), (name, bound)
        assert of_bound == f"{round(p['of_bound'] * 100)}%", (name, of_bound)
        if of_sr:
            assert of_sr == f"{round(p['of_s_over_r'] * 100)}%", (name, of_sr)


def test_the_readme_aggregator_threads_figures() -> None:
    data = json.loads((RESULTS / "aggregator_threads.json").read_text())
    median = data["median"]
    section = _readme_section("### On loopback")
    m = re.search(
        r"pump (\d+)k datagrams/s \((\d+) Gbit/s; two pairs (\d+)k/s\); 1 thread ([\d.]+)k/s\s+"
        r"\(([\d.]+) Gbit/s of payload, [\d.]+ of the pump\), "
        r"2 threads ([\d.]+)k/s \(([\d.]+) Gbit/s, [\d.]+\), "
        r"\*\*([\d.]+)x\*\*",
        section,
    )
    assert m, "README: the aggregator threads sentence"
    assert near(m.group(1), median["pump x1"]["pkts_per_s"], 1e-3)
    assert near(m.group(2), median["pump x1"]["gbit_per_s"])
    assert near(m.group(3), median["pump x2"]["pkts_per_s"], 1e-3)
    assert near(m.group(4), median["aggregator 1 thread"]["pkts_per_s"], 1e-3)
    assert near(m.group(5), median["aggregator 1 thread"]["gbit_per_s"])
    assert near(m.group(6), median["aggregator 2 threads"]["pkts_per_s"], 1e-3)
    assert near(m.group(7), median["aggregator 2 threads"]["gbit_per_s"])
    assert near(m.group(8), data["ratio_2_over_1_threads"])


# ---- docs/RELIABILITY.md: its counts are its table's ----


def test_the_reliability_doc_counts_its_own_rows() -> None:
    text = read("docs/RELIABILITY.md")
    table = [
        line
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith(("| Fault", "| **Total"))
    ]
    m = re.search(r": (\d+) tests, (\d+) rows passed, (\d+) skipped, (\d+) failed\.", text)
    assert m, "docs/RELIABILITY.md's header counts"
    assert sum(int(x) for x in m.groups()[1:]) == len(table), (m.group(0), len(table))
    tests_section = text[text.index("## The tests behind each row") :]
    bullets = [line for line in tests_section.splitlines() if line.startswith("- ")]
    assert len(bullets) == len(table)
    ids = re.findall(r"`([^`]+::[^`]+)`", tests_section)
    assert len(ids) == len(set(ids)) == int(m.group(1)), "each test is behind one row"
    for bullet, row in zip(bullets, table, strict=True):  # the whole description, colons and all
        fault, tried = (c.strip() for c in row.split(" | ")[:2])
        assert bullet.startswith(f"- {fault.removeprefix('| ')}, {tried}: "), (bullet, tried)
    runs = sum(int(row.split(" | ")[2]) for row in table)
    total = re.search(r"\*\*Totals: (\d+) runs", text)
    assert total and int(total.group(1)) == runs


def test_the_reliability_table_keeps_each_tests_latest_run_and_whole_descriptions(tmp_path: Path) -> None:
    """tools/reliability_table.py: a test run twice (the file appended to) is one row with the later
    run's numbers; the header's counts are the table's; a description keeps its colons."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "reliability_table", REPO / "tools" / "reliability_table.py"
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def row(test: str, tried: str, session: str, sums: int, **kw: Any) -> dict[str, Any]:
        return {"fault": "loss", "tried": tried, "runs": 1, "sums": sums, "wrong": 0, "outcome": "exact"} | {
            "test": test,
            "status": "passed",
            "session": session,
            **kw,
        }

    rows = [
        row("t.py::a[1]", "1% lost: 3 ranks x 20 allreduces, 9 dropped", "s1", 60),
        row("t.py::b", "none: the baseline", "s1", 60),
        row("t.py::a[1]", "1% lost: 3 ranks x 40 allreduces, 17 dropped", "s2", 120),
        row("t.py::c[x]", "two ways: tcp and unix", "s2", 6),
        row("t.py::c[y]", "two ways: tcp and unix", "s2", 6),
        {**row("t.py::d", "skipped here: no nft", "s2", 0), "status": "skipped", "note": "needs nft"},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "RELIABILITY.md"
    assert tool.main([str(path), "-o", str(out)]) == 0
    text = out.read_text()
    assert (
        "20 allreduces" not in text and text.count("3 ranks x 40 allreduces, 17 dropped") == 2
    )  # row, bullet
    assert ": 5 tests, 3 rows passed, 1 skipped, 0 failed." in text
    assert "**Totals: 4 runs, 192 sums checked, 0 wrong sums" in text
    assert "- loss, two ways: tcp and unix: `t.py::c[x]`, `t.py::c[y]`" in text
    assert "- loss, none: the baseline: `t.py::b`" in text
    # without sessions (older files) a run is a block of consecutive lines of one test
    for r in rows:
        del r["session"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    merged = tool.table_rows(tool.load([path]))
    assert [m["sums"] for m in merged if m["tests"] == ["t.py::a[1]"]] == [120]
