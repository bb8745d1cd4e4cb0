"""mpitrain.results.schema: the one definition of the run files' columns, for writers and readers."""

import pytest

from mpitrain.results import run_dir as results, schema, telemetry
from mpitrain.results.schema import Column


def test_writers_take_their_headers_from_the_schema():
    assert results.CURVE_COLUMNS is schema.CURVE_COLUMNS
    assert telemetry.TELEMETRY_COLUMNS is schema.TELEMETRY_COLUMNS
    assert telemetry.TIMING_COLUMNS is schema.TIMING_COLUMNS
    assert telemetry.COMM_COLUMNS is schema.COMM_COLUMNS


def test_file_formats_are_pinned():
    """The headers as files on disk have them: a change here is a file-format change
    (readers of older results, scripts, spreadsheets), so it must be deliberate."""
    assert schema.CURVE_COLUMNS == ("epoch", "step", "wall_time_s", "train_loss", "test_loss",
                                    "test_accuracy", "examples_per_s")
    assert schema.TELEMETRY_COLUMNS == ("time_s", "rank", "host", "role", "cpu_percent",
                                        "rss_mb", "host_cpu_percent", "net_rx_bytes",
                                        "net_tx_bytes", "net_rx_packets", "net_tx_packets")
    assert schema.TIMING_COLUMNS == ("epoch", "rank", "host", "role", "wall_s", "compute_s",
                                     "comm_s", "wait_s", "codec_s")
    assert schema.COMM_COLUMNS == ("rank", "host", "role", "kind", "sent_bytes", "sent_msgs",
                                   "recv_bytes", "recv_msgs", "wait_s")
    assert schema.STALENESS_COLUMNS == ("worker", "staleness", "count", "server")


@pytest.mark.parametrize("table", [schema.CURVE, *schema.OPTIONAL_TABLES.values()])
def test_every_table_has_distinct_names_and_required_columns(table):
    assert len(set(schema.names(table))) == len(table)
    assert any(not c.optional for c in table)


def test_runs_columns_types_the_header():
    columns = {c.name: c for c in schema.runs_columns(
        ["run", "model", "np", "test_accuracy", "node0_host", "node0_cpu_avg", "future"])}
    assert columns["run"] == Column("run", text=True)
    assert not columns["np"].text and not columns["node0_cpu_avg"].text
    assert columns["model"].text and columns["node0_host"].text and columns["future"].text
    assert all(c.optional and c.blank_ok for name, c in columns.items() if name != "run")
