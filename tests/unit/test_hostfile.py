"""Hostfile parsing and the rank -> host -> role mapping of the shipped hostfiles."""

import pytest

from mpitrain.launch import hostfile
from mpitrain.comm import Role
from mpitrain.errors import UsageError
from conftest import REPO


@pytest.mark.parametrize("name,np_,expected", [
    ("single", 1, ["node0"]),
    ("cluster", 3, ["node0", "node0", "node1"]),
    ("cluster2", 4, ["node0", "node0", "node1", "node2"]),
    ("local", 4, ["localhost"] * 4),
])
def test_shipped_hostfiles(name, np_, expected):
    hosts = hostfile.read(REPO / "hostfiles" / name)
    assert hostfile.placement(hosts, np_) == expected
    roles = [Role.of(r, np_) for r in range(np_)]
    assert roles[0] in (Role.SINGLE, Role.SERVER)
    assert all(r is Role.WORKER for r in roles[1:])


@pytest.mark.parametrize("text,pattern", [
    ("node0 slots=two\n", r"hostfile:1: slots must be a positive integer"),
    ("node0 slots=0\n", r"slots must be a positive integer"),
    ("# c\nnode0\nnode1 cpus=3\n", r"hostfile:3: cannot read 'cpus=3'"),
    ("node0\nnode0\n", r"hostfile:2: host node0 is listed twice"),
    ("# only comments\n\n", r"no hosts listed"),
    ("node0 slots=4 max_slots=2\n", r"max_slots is smaller"),
])
def test_malformed_hostfiles(text, pattern):
    with pytest.raises(UsageError, match=pattern):
        hostfile.parse(text)


def test_too_many_ranks_for_slots():
    with pytest.raises(UsageError, match="-np 5 needs 5 slots but the hostfile offers 4"):
        hostfile.placement(hostfile.parse("a slots=2\nb slots=2"), 5)


def test_missing_hostfile(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        hostfile.read(tmp_path / "nope")
