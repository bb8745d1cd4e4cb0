"""Smoke of the benchmarks on the emulated cluster (network namespaces): each runs its
--quick mode end to end (see test_bench.py)."""

import pytest

from bench.ddp import torch_python
from conftest import ON_THE_EMULATED_CLUSTER, bench, netns_cluster_turn, read_rows


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quick_benchmarks_on_the_emulated_cluster_run():
    with netns_cluster_turn():
        out, summary = bench(ON_THE_EMULATED_CLUSTER)
    if "| netns | emulated cluster | skipped |" in summary:
        pytest.skip("network namespaces unavailable here: " + summary.split("skipped |")[1][:80])
    assert {r["model"] for r in read_rows(out / "netns.csv")} == {"lr"}
    assert {(r["model"], r["mode"], r["compression"])
            for r in read_rows(out / "compression.csv")} == {
        ("lenet", "sync", name) for name in ("none", "fp16", "powersgd", "topk")}
    for name in ("powersgd", "topk"):
        assert f"| compression | lenet sync epoch time at 1 GbE, {name} / fp16 (its compute" \
            in summary
    if torch_python():  # PowerSGD beside DDP's powerSGD_hook, on the same nodes
        assert {(r["side"], r["compression"]) for r in read_rows(out / "compression_ddp.csv")} \
            == {(side, name) for side in ("mpitrain", "ddp") for name in ("none", "powersgd")}
        assert "mpitrain powersgd / DDP powerSGD_hook" in summary
    # one server and two, each on a node of its own, the 3 workers on three others
    servers = read_rows(out / "servers.csv")
    assert [(r["model"], r["servers"], r["server_nodes"]) for r in servers] == [
        ("lr", "1", "node0"), ("lr", "2", "node0 node1")]
    assert all(r["worker_nodes"] == "node3 node4 node5" and float(r["updates_per_s"]) > 0
               for r in servers)
