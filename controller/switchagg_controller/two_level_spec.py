"""The two-level file: software leaves behind a software spine (docs/PROTOCOL.md, Two levels;
docs/CONTROLLER.md, Two levels in software).

The file (``switchagg-ctl serve --two-level FILE``) names one UDP address per role; the controller
runs one embedded software aggregator on each, and a worker belongs to the leaf whose subnets hold
its IP:

spine: {listen: 127.0.0.254:48879}
leaves:
  - {name: rack0, listen: 127.0.1.254:48879, subnets: [127.0.1.0/24]}
  - {name: rack1, listen: 127.0.2.254:48879, subnets: [127.0.2.0/24], advertise: 127.0.2.254}

``advertise`` (optional): the IP told to the leaf's workers (default: the listen IP).

A node may also run elsewhere: a ``switchagg-aggregator --control ...`` on another host (a leaf in
its rack), which the controller reaches through that aggregator's control service
(docs/PROTOCOL.md, The software aggregator) instead of running it. ``listen`` then says where it
serves (checked against what it reports), ``control`` how to reach it and ``secret_file`` (relative
to this file) its shared secret:

  - {name: rack2, listen: 10.0.3.254:48879, subnets: [10.0.3.0/24],
     control: 10.0.0.13:50061, secret_file: rack2.secret}
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml

from switchagg_controller.model import Remote
from switchagg_controller.topology import (
    REMOTE_KEYS,
    TopologyError,
    YamlNode,
    parse_address,
    parse_remote,
    read_config,
)

Address = tuple[str, int]
SPINE = "spine"  # the spine's node name (leaves are named in the file)


@dataclass(frozen=True)
class LeafSpec:
    name: str
    listen: Address
    subnets: tuple[ipaddress.IPv4Network, ...]
    advertise: str = ""  # "" = the listen IP
    remote: Remote | None = None  # None: embedded in the controller


@dataclass(frozen=True)
class TwoLevelSpec:
    spine: Address
    leaves: tuple[LeafSpec, ...]
    spine_remote: Remote | None = None

    def leaf_of(self, ip: str) -> int | None:
        """The index of the leaf whose subnets hold ``ip``."""
        addr = ipaddress.IPv4Address(ip)
        return next((i for i, leaf in enumerate(self.leaves) if any(addr in s for s in leaf.subnets)), None)


def parse_two_level(text: str, source: str = "<two-level>", base: Path | None = None) -> TwoLevelSpec:
    """``base``: the directory relative secret_file paths start from (default: the working one)."""
    base = base if base is not None else Path()
    try:
        root_node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise TopologyError(f"{source}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if root_node is None:
        raise TopologyError(f"{source}:1: the file is empty")
    top = YamlNode(source, root_node, "").mapping(("spine", "leaves"))
    spine_f = top["spine"].mapping(("listen",), REMOTE_KEYS)
    spine = parse_address(spine_f["listen"])
    spine_remote = parse_remote(spine_f, base)
    leaves: list[LeafSpec] = []
    seen: dict[str, str] = {}
    for node in top["leaves"].sequence():
        f = node.mapping(("name", "listen", "subnets"), ("advertise", *REMOTE_KEYS))
        name = f["name"].text()
        subnets = []
        for s in f["subnets"].sequence():
            try:
                subnets.append(ipaddress.IPv4Network(s.text()))
            except ValueError:
                raise s.fail(f"{s.text()!r} is not an IPv4 subnet (a.b.c.d/len)") from None
        if not subnets:
            raise f["subnets"].fail("at least one subnet is needed")
        leaf = LeafSpec(
            name,
            parse_address(f["listen"]),
            tuple(subnets),
            f["advertise"].ipv4() if "advertise" in f else "",
            parse_remote(f, base),
        )
        for key in (f"name {name}", f"listen {leaf.listen}"):
            if key in seen or (key.startswith("listen") and leaf.listen == spine):
                raise node.fail(f"{key} is used twice")
            seen[key] = name
        for other in leaves:
            if any(a.overlaps(b) for a in leaf.subnets for b in other.subnets):
                raise f["subnets"].fail(f"overlaps the subnets of leaf {other.name!r}")
        leaves.append(leaf)
    if not leaves:
        raise top["leaves"].fail("at least one leaf is needed")
    return TwoLevelSpec(spine, tuple(leaves), spine_remote)


def load_two_level(path: str | Path) -> TwoLevelSpec:
    return parse_two_level(*read_config(path, "two-level file"), base=Path(path).parent)
