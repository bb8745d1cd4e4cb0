"""bench servers' pure parts: BytePS's bound on async updates/s, the hostfile that gives
every rank a node of its own, the placement read back from comm.csv, how busy a link
was, and the checks."""

import csv

import pytest

from bench.servers import (Case, checks_of, hostfile, link_use, placement,
                           predicted_updates_per_s, with_ratios)

GBE = 1e9 / 8
ALEXNET_32 = 110.19e6  # bytes of one push


def test_one_server_binds_on_its_link_and_k_servers_share_it():
    rate, bound = predicted_updates_per_s(3, 1, ALEXNET_32, GBE, compute_s=0.5)
    assert bound == "server links" and rate == pytest.approx(GBE / ALEXNET_32)  # 1.13/s
    assert predicted_updates_per_s(3, 2, ALEXNET_32, GBE, 0.5)[0] == pytest.approx(2 * rate)
    assert predicted_updates_per_s(3, 3, ALEXNET_32, GBE, 0.5)[0] == pytest.approx(3 * rate)


def test_past_one_server_per_worker_the_workers_links_bind():
    rate, bound = predicted_updates_per_s(3, 4, ALEXNET_32, GBE, compute_s=0.1)
    assert bound == "worker links" and rate == pytest.approx(3 * GBE / ALEXNET_32)


def test_a_small_model_is_compute_bound():
    rate, bound = predicted_updates_per_s(3, 1, 31_400, GBE, compute_s=0.004)
    assert (bound, rate) == ("compute", pytest.approx(750))


def test_ranks_0_to_k_minus_1_serve_from_nodes_of_their_own(tmp_path):
    assert hostfile(tmp_path, 2).read_text() == ("node0 slots=1\nnode1 slots=1\n"
                                                 "node3 slots=1\nnode4 slots=1\nnode5 slots=1\n")


def write_comm(run_dir, hosts):
    with open(run_dir / "comm.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["rank", "host", "role", "kind", "sent_bytes", "recv_bytes"])
        writer.writerows([rank, host, "server" if rank < 2 else "worker", "push", 1, 1]
                         for rank, host in enumerate(hosts))


def test_the_placement_comes_from_the_run_and_must_give_each_rank_a_node(tmp_path):
    write_comm(tmp_path, ["node0", "node1", "node3", "node4", "node5"])
    assert placement(tmp_path, 2) == {"servers": ["node0", "node1"],
                                      "workers": ["node3", "node4", "node5"]}
    write_comm(tmp_path, ["node0", "node0", "node3", "node4", "node5"])
    with pytest.raises(RuntimeError, match="share nodes"):
        placement(tmp_path, 2)


def row(model, servers, measured, predicted, bound, accuracy=0.9):
    return {"model": model, "servers": servers, "updates_per_s": measured,
            "predicted_per_s": predicted, "bound": bound, "test_accuracy": accuracy}


def test_the_speed_up_is_judged_only_where_the_links_bind():
    rows = with_ratios([row("alexnet", 1, 1.0, 1.1, "server links"),
                        row("alexnet", 2, 1.7, 2.2, "server links"),
                        row("resnet", 1, 10, 12, "compute"),
                        row("resnet", 2, 11, 12, "compute"),
                        row("lr", 1, 1000, 1300, "compute", 0.905),
                        row("lr", 2, 850, 900, "compute", 0.891)])
    models = {"alexnet": Case([], True), "resnet": Case([], True),
              "lr": Case([], False, accuracy=True)}
    checks = {c["ratio"]: c for c in checks_of(rows, models)}
    alexnet = checks["alexnet updates/s, 2 servers / 1"]
    assert (alexnet["value"], alexnet["met"]) == (1.7, True)  # >= 0.8 x 2
    assert "model 2.0" in alexnet["target"]
    assert checks["resnet updates/s, 2 servers / 1"]["met"] is None  # compute-bound
    assert "compute-bound" in checks["resnet updates/s, 2 servers / 1"]["target"]
    assert checks["lr updates/s, 2 servers / 1"]["met"] is False  # 0.85 < 0.9
    accuracy = checks["lr test accuracy, 2 servers - 1 (pp)"]
    assert (accuracy["value"], accuracy["met"]) == (-1.4, False)


def test_a_links_use_is_its_busier_direction_over_the_wall_time():
    row = {"wall_time_s": "10", "node0_host": "node0", "node0_rx_mb": "625",
           "node0_tx_mb": "500", "node1_host": "node3", "node1_rx_mb": "1250",
           "node1_tx_mb": "0"}
    assert link_use(row, ["node0"]) == 0.5  # 625 MB in 10 s of a 125 MB/s link
    assert link_use(row, ["node0", "node3"]) == 1.0  # the busiest of them
