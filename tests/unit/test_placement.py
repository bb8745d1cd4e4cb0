"""Which rank gives its host's cores to the workers first (pure logic; the niceness the
server really ran at is checked end to end in test_cli and test_async_cli)."""

import pytest

from mpitrain.comm import Role
from mpitrain.train.priority import defers_to_workers

SERVER, WORKER, SINGLE = Role.SERVER, Role.WORKER, Role.SINGLE


@pytest.mark.parametrize("async_mode,role,workers_on_host,defers", [
    (False, SERVER, 2, True),  # sync: evaluations are off the workers' path
    (False, SERVER, 0, False),  # a host of its own: nobody to make room for
    (True, SERVER, 1, False),  # async: every update goes through it
    (False, WORKER, 1, False),
    (False, SINGLE, 1, False),
])
def test_only_a_sync_server_sharing_its_host_with_workers_defers(async_mode, role,
                                                                  workers_on_host, defers):
    assert defers_to_workers(async_mode, role, workers_on_host) is defers
