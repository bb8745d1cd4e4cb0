"""3-node emulation: ranks in network namespaces node0..node2, talking over real TCP.

scripts/netns-cluster builds the namespaces; where the machine forbids them
(no CAP_NET_ADMIN, not root) the tests are skipped with the script's reason.
The runs use the CloudLab shapes (cluster: 3 ranks on 2 nodes, cluster2: 4 on 3)
and check each node's own network counters in runs.csv.
"""

import subprocess
import sys

import pytest

from conftest import REPO, mpi_env, read_rows, run_bounded

pytestmark = pytest.mark.slow
NETNS = REPO / "scripts" / "netns-cluster"


@pytest.fixture(scope="module")
def cluster():
    up = run_bounded([NETNS, "up", "--link", "1gbit"], 120)
    if up.returncode == 77:
        pytest.skip("network namespaces unavailable: " + (up.stdout + up.stderr).strip())
    assert up.returncode == 0, up.stdout + up.stderr
    args = subprocess.run([NETNS, "mpirun-args"], capture_output=True, text=True,
                          check=True).stdout.split()
    yield args
    down = run_bounded([NETNS, "down"], 120)
    assert down.returncode == 0, down.stdout + down.stderr


def hostfile(shape):
    return subprocess.run([NETNS, "hostfile", shape], capture_output=True, text=True,
                          check=True).stdout.strip()


def run_on(cluster, shape, np_, tmp_path, mnist, *extra):
    cmd = ["mpirun", *cluster, "-np", str(np_), "-hostfile", hostfile(shape), sys.executable,
           "-m", "mpitrain", "lr", *extra, "--epochs", "3", "--data-dir", str(mnist),
           "--results-dir", str(tmp_path), "--quiet", "--sample-interval", "0.2"]
    result = run_bounded(cmd, 600, env=mpi_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return read_rows(tmp_path / "runs.csv")[-1]


def node_traffic(run):
    nodes = {}
    for i in range(3):
        if run.get(f"node{i}_host"):
            nodes[run[f"node{i}_host"]] = float(run[f"node{i}_rx_mb"]) + float(run[f"node{i}_tx_mb"])
    return nodes


@pytest.mark.parametrize("shape,np_", [("cluster", 3), ("cluster2", 4)])
def test_async_parameter_server_node_carries_the_most(cluster, tmp_path, mnist, shape, np_):
    run = run_on(cluster, shape, np_, tmp_path, mnist, "--async")
    traffic = node_traffic(run)
    assert sorted(traffic) == ["node0", "node1", "node2"][:np_ - 1]
    # node0 serves every remote worker: its traffic is the sum of theirs (with one
    # remote node, cluster, the two are equal; with two, cluster2, node0 has twice)
    remote = sum(v for k, v in traffic.items() if k != "node0")
    assert traffic["node0"] == pytest.approx(remote, rel=0.25), traffic
    assert traffic["node0"] >= 0.9 * max(traffic.values()), traffic


@pytest.mark.parametrize("shape,np_", [("cluster", 3), ("cluster2", 4)])
def test_sync_allreduce_spreads_traffic(cluster, tmp_path, mnist, shape, np_):
    """Rank 0 is not in the per-step allreduce: every node moves gradients."""
    run = run_on(cluster, shape, np_, tmp_path, mnist)
    traffic = node_traffic(run)
    assert sorted(traffic) == ["node0", "node1", "node2"][:np_ - 1]
    steps = int(run["steps"])
    gradient_mb = 7850 * 4 / 2**20
    for node, mb in traffic.items():  # each node carries at least its share of allreduces
        assert mb > 0.5 * steps * gradient_mb, (node, traffic)
